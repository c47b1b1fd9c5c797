"""Per-rank reports for checking a distributed run (`--record_rank_reports true`): OUTPUT/rank_reports/rankN.json.

Each rank writes the rows it trained on (a digest per example), a digest of the weights it holds, the bytes of
parameters, gradients and optimizer state it really held, its host RAM while loading, and its memory plan. The
strategy-matrix tests compare them across ranks and against a 1-process run and the planner.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer

from ..data.packing import SEQUENCES
from ..metrics.memory import local_tensor, nbytes
from ..models.counts import LoadRecord
from ..settings.mesh import sequence_split


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


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of parameters, optimizer state and master weights (what the optimizer steps in the model's
    parameters' place: training/precision.py) this rank really holds (its shard, under ZeRO-3 or FSDP)."""
    params = list(model.parameters())
    while hasattr(optimizer, "optimizer"):  # accelerate's wrapper, then DeepSpeed's, then torch's
        optimizer = optimizer.optimizer
    state = sum(
        nbytes(t)
        for per_param in optimizer.state.values()
        for t in per_param.values()
        if torch.is_tensor(t) and t.dim() > 0  # not the scalar step counters
    )
    own = {id(p) for p in params}
    masters = sum(nbytes(p) for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    return {"param_bytes": sum(nbytes(p) for p in params), "optimizer_state_bytes": state, "master_bytes": masters}


class RankReports(TrainerCallback):
    """Trainer part, with `--record_rank_reports`: the rows of every micro-batch (`record`, a device sync: only
    when asked for), the host RAM loading took up to the first step, the most gradient bytes held at an optimizer
    step, and at the end of training the report, written by every rank."""

    def __init__(self, trainer, load: LoadRecord | None):
        self.trainer = trainer
        self.load = load or LoadRecord()
        self.rows: list[str] = []
        self.load_host: dict[str, Any] | None = None  # the loading footprint through placing and sharding
        self.gradient_bytes: int | None = None
        self.saved_bytes: int | None = None
        self.saved_width: int | None = None  # the tokens per row of that first step's batch, on this rank
        self.measure_saved = sequence_split() > 1  # see saving()
        self.micro_batches = 0
        # How many decoder-layer forwards backward ran again (activation checkpointing's recomputation: each layer
        # of this rank once a micro-batch when the recipe checkpoints and the model trains in training mode).
        self.layers = [m for m in trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.recomputed = 0

    def counting_recomputation(self, checkpoint):
        """A layer's checkpoint function (transformers' `_gradient_checkpointing_func`) that counts the forwards it
        runs inside backward: its recomputations."""

        def counted_checkpoint(forward, *args, **kwargs):
            def counted(*inner, **named):
                if torch._C._current_autograd_node() is not None:
                    self.recomputed += 1
                return forward(*inner, **named)

            return checkpoint(counted, *args, **kwargs)

        return counted_checkpoint

    @contextlib.contextmanager
    def saving(self):
        """Around the first training step: the bytes autograd saves in its forward pass, once per storage, the
        parameters (ZeRO-3's gathered ones too) and backward's recomputation of checkpointed layers left out:
        what the planner calls `activations`, on this rank. Only under a sequence split (the one strategy whose
        activations a test compares with the plan): autograd hands the hooks' tensors back without their
        Parameter class, and ZeRO-3's fused head (TRL reads `ds_status` in backward) needs it."""
        if self.saved_bytes is not None or not self.measure_saved:
            yield
            return
        storages: dict[int, int] = {}

        def pack(tensor):
            if not isinstance(tensor, torch.nn.Parameter) and torch._C._current_autograd_node() is None:
                storage = local_tensor(tensor).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        parameters = {local_tensor(p).untyped_storage().data_ptr() for p in self.trainer.model.parameters()}
        self.saved_bytes = sum(n for ptr, n in storages.items() if ptr not in parameters)

    def record(self, inputs: dict[str, torch.Tensor]) -> None:
        self.micro_batches += 1
        self.rows += [hashlib.sha1(json.dumps(row).encode()).hexdigest()
                      for row in sequences_of(inputs, SEQUENCES in inputs)]  # fmt: skip
        if self.saved_width is None and self.measure_saved:
            self.saved_width = inputs["input_ids"].shape[1]

    def on_train_begin(self, args, state, control, **kwargs):
        for layer in self.layers:  # the Trainer has turned the recipe's activation checkpointing on by now
            if layer.gradient_checkpointing:
                layer._gradient_checkpointing_func = self.counting_recomputation(layer._gradient_checkpointing_func)
        # The Trainer has wrapped, placed and (FSDP, ZeRO-3) sharded the model; no optimizer state yet.
        if self.load.memory is not None:
            self.load_host = self.load.memory.stop()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # Under DeepSpeed the gradients live in the engine's own partitioned buffers, not in `.grad`: None there.
        held = [nbytes(local_tensor(p.grad)) for p in model.parameters() if p.grad is not None]
        if held:
            self.gradient_bytes = max(self.gradient_bytes or 0, sum(held))

    def on_train_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        digest = hashlib.sha256()
        for name, param in sorted(trainer.model.named_parameters()):  # this rank's shard where sharded
            digest.update(name.encode())
            digest.update(local_tensor(param).detach().float().cpu().numpy().tobytes())
        plan = trainer.plan
        report: dict[str, Any] = {
            "process_index": trainer.accelerator.process_index,
            "strategy": plan.strategy,
            "rows": self.rows,
            "weights_sha256": digest.hexdigest(),
            "layers": len(self.layers),  # the decoder layers this rank holds (its stage's, under a pipeline)
            "micro_batches": self.micro_batches,
            "recomputed": self.recomputed,  # layer forwards run again in backward (activation checkpointing)
            "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules()),  # FP8 ran
            "tokens_seen": state.num_input_tokens_seen,
            **held_bytes(trainer.model_wrapped, trainer.optimizer),
            "gradient_bytes": self.gradient_bytes,
            "saved_bytes": self.saved_bytes,  # activations of the first step's forward
            "saved_width": self.saved_width,  # its batch's tokens per row on this rank
            "loaded_param_bytes": self.load.param_bytes,  # held right after from_pretrained, before sharding
            "loaded_host": self.load.host,  # peak host RAM (PSS) added by from_pretrained: anon and file-backed
            "load_host": self.load_host,  # the same through placing and sharding
            "memory_plan": {"device": plan.memory.device, "host_per_node": plan.memory.host_per_node},
            "losses": [e["loss"] for e in state.log_history if "loss" in e],
            "learning_rates": [e["learning_rate"] for e in state.log_history if "loss" in e],
        }
        folder = Path(args.output_dir) / "rank_reports"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
