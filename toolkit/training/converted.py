"""Resuming the weights of a model whose checkpoint names are not its modules' names.

transformers 5 renames and reshapes weights as it loads them (an image-text model's legacy layout,
`language_model.model.layers...` into `model.language_model.layers...`; a mixture of experts' per-expert
matrices into fused ones) and reverts that on every `save_pretrained`, checkpoints included. The Trainer resumes a
single process or DDP run with `model.load_state_dict(saved, strict=False)`: no saved name matches, nothing loads,
a warning is logged, and the run goes on from its first weights with the checkpoint's optimizer state. Here such a
checkpoint is read as `from_pretrained` reads it, conversions applied, and copied in.

A model transformers sharded as it loaded (tensor or expert parallelism: DTensor shards, no engine of
accelerate's) fails the Trainer's load outright ('mixed torch.Tensor and DTensor'): its checkpoint is read as the
model was, by the same DistributedConfig, and each rank's shards copied in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME


def saved_names(checkpoint: Path) -> set[str] | None:
    """The tensor names of a checkpoint's full safetensors weights (one file or an index); None without them."""
    if (checkpoint / SAFE_WEIGHTS_NAME).is_file():
        with safe_open(checkpoint / SAFE_WEIGHTS_NAME, "pt") as weights:
            return set(weights.keys())
    if (checkpoint / SAFE_WEIGHTS_INDEX_NAME).is_file():
        return set(json.loads((checkpoint / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"])
    return None


def load_converted(model: torch.nn.Module, checkpoint: str | Path) -> bool:
    """Load `checkpoint`'s weights into `model` through transformers' conversions where its names are not the
    model's own; False where the Trainer's own load fits (the names match, or the weights are an adapter's)."""
    checkpoint = Path(checkpoint)
    if not isinstance(model, PreTrainedModel) or (names := saved_names(checkpoint)) is None:
        return False
    if names <= set(model.state_dict()):
        return False
    dtype = next(model.parameters()).dtype
    loaded = type(model).from_pretrained(checkpoint, config=model.config, dtype=dtype).state_dict()
    missing = model.load_state_dict(loaded, strict=False).missing_keys
    if missing:  # the same class and config: a name missing would be transformers' own mistake, said at once
        raise RuntimeError(f"{checkpoint}: {len(missing)} of the model's weights not read back, e.g. {missing[0]}")
    return True


def load_sharded(model: torch.nn.Module, checkpoint: str | Path) -> bool:
    """Load `checkpoint` into a model transformers sharded at load, shard by shard; False for any other model."""
    from torch.distributed.tensor import DTensor

    if not getattr(model, "is_distributed_loading_by_transformers", False):
        return False
    loaded = type(model).from_pretrained(checkpoint, config=model.config, dtype="auto",
                                         distributed_config=model.config.distributed_config)  # fmt: skip

    def local(tensor: torch.Tensor) -> torch.Tensor:  # a shard, or a tensor the plan leaves whole (TP's norms)
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            local(param).copy_(local(loaded.get_parameter(name)))
    return True
