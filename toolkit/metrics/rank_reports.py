"""Per-rank reports for checking a distributed run (`--record_rank_reports true`): OUTPUT/rank_reports/rankN.json.

Each rank writes the rows it trained on (a digest per example), a digest of the weights it holds, the bytes of
parameters, gradients and optimizer state it really held, its host RAM while loading, and its memory plan. The
strategy-matrix tests compare them across ranks and against a 1-process run and the planner.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .memory import HostMemoryPeak, local_tensor, nbytes


@dataclass
class LoadRecord:
    """What loading the model took on this rank, measured by the runner."""

    param_bytes: int | None = None  # parameter bytes held right after from_pretrained, before sharding
    host: dict[str, int] | None = None  # peak host RAM (PSS) that from_pretrained added: anon and file-backed
    memory: HostMemoryPeak | None = None  # still sampling, until the first step (LoadFootprint stops it)


def sequences_of(inputs: dict[str, torch.Tensor], packed: bool) -> list[list[int]]:
    """The token ids of each example in a batch: rows without their padding, and packed rows split into their
    conversations where position_ids restart."""
    mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).tolist()
    out = []
    for r, ids in enumerate(inputs["input_ids"].tolist()):
        real = [i for i, keep in enumerate(mask[r]) if keep]
        if not packed:
            out.append([ids[i] for i in real])
            continue
        positions = inputs["position_ids"][r].tolist()
        starts = [i for i in real if positions[i] == 0] + [len(real)]
        out += [ids[a:b] for a, b in zip(starts, starts[1:], strict=False)]
    return out


class LoadFootprint(TrainerCallback):
    """Peak host RAM that loading the model took, up to training: read when the Trainer has wrapped, placed and
    (FSDP, ZeRO-3) sharded it, before the first step allocates optimizer state."""

    def __init__(self, load: LoadRecord):
        self.load, self.through_sharding = load, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.load.memory is not None:
            self.through_sharding = self.load.memory.stop()


class GradientBytes(TrainerCallback):
    """The most gradient bytes this rank held at an optimizer step (for rank reports: it walks every parameter).
    Under DeepSpeed the gradients live in the engine's own partitioned buffers, not in `.grad`: None there."""

    def __init__(self) -> None:
        self.most: int | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        held = [nbytes(local_tensor(p.grad)) for p in model.parameters() if p.grad is not None]
        if held:
            self.most = max(self.most or 0, sum(held))


class RankReports:
    """Trainer part: with `record_rank_reports`, each rank writes OUTPUT/rank_reports/rank<N>.json after training.
    Call `record_rank_reports(load)` in the trainer's set-up; needs `self.plan` (RunPlan)."""

    _rows_seen: list[str] | None = None

    def record_rank_reports(self, load: LoadRecord | None) -> None:
        self._rows_seen = []
        self._load = load or LoadRecord()
        self._gradient_bytes, self._load_footprint = GradientBytes(), LoadFootprint(self._load)
        self.add_callback(self._gradient_bytes)
        self.add_callback(self._load_footprint)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._rows_seen is not None:  # costs a device sync: only when asked for
            from ..pipeline.packing import SEQUENCES

            self._rows_seen += [hashlib.sha1(json.dumps(row).encode()).hexdigest()
                                for row in sequences_of(inputs, SEQUENCES in inputs)]  # fmt: skip
        return super().training_step(model, inputs, num_items_in_batch)

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self._rows_seen is not None:
            self.write_rank_report()
        return output

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state this rank really holds (its shard, under ZeRO-3 or FSDP)."""
        params = sum(nbytes(p) for p in self.model_wrapped.parameters())
        optimizer = self.optimizer
        while hasattr(optimizer, "optimizer"):  # accelerate's wrapper, then DeepSpeed's, then torch's
            optimizer = optimizer.optimizer
        state = sum(
            nbytes(t)
            for per_param in optimizer.state.values()
            for t in per_param.values()
            if torch.is_tensor(t) and t.dim() > 0  # not the scalar step counters
        )
        return {"param_bytes": params, "optimizer_state_bytes": state}

    def write_rank_report(self) -> None:
        """Rows this rank trained on and a digest of the weights it holds, for verifying a distributed run."""
        digest = hashlib.sha256()
        for name, param in sorted(self.model.named_parameters()):  # this rank's shard where sharded
            digest.update(name.encode())
            digest.update(local_tensor(param).detach().float().cpu().numpy().tobytes())
        report: dict[str, Any] = {
            "process_index": self.accelerator.process_index,
            "strategy": self.plan.strategy,
            "rows": self._rows_seen,
            "weights_sha256": digest.hexdigest(),
            "tokens_seen": self.state.num_input_tokens_seen,
            **self.held_bytes(),
            "gradient_bytes": self._gradient_bytes.most,
            "loaded_param_bytes": self._load.param_bytes,  # held right after from_pretrained, before sharding
            "loaded_host": self._load.host,  # peak host RAM (PSS) added by from_pretrained: anon and file-backed
            "load_host": self._load_footprint.through_sharding,  # the same through placing and sharding
            "memory_plan": {"device": self.plan.memory.device, "host_per_node": self.plan.memory.host_per_node},
            "losses": [e["loss"] for e in self.state.log_history if "loss" in e],
            "learning_rates": [e["learning_rate"] for e in self.state.log_history if "loss" in e],
        }
        folder = Path(self.args.output_dir) / "rank_reports"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self.accelerator.process_index}.json").write_text(json.dumps(report))
