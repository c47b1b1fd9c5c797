"""What a model holds and what loading it took: parameter counts and the bytes this rank holds (4-bit weights and
ZeRO-3 partitions as the model defines them), and the host RAM from_pretrained added (for the rank reports)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..metrics.memory import HostMemoryPeak, nbytes


@dataclass
class ParameterCounts:
    total: int
    trainable: int
    held_bytes: int  # parameter bytes this rank holds: 0 on ranks > 0 under RAM-efficient loading

    @classmethod
    def of(cls, model: torch.nn.Module) -> ParameterCounts:
        # parameters() yields a tied weight once, so tied embeddings are not counted twice
        params = list(model.parameters())
        numel = [logical_numel(p) for p in params]
        return cls(
            total=sum(numel),
            trainable=sum(n for n, p in zip(numel, params, strict=True) if p.requires_grad),
            held_bytes=sum(nbytes(p) + quant_state_bytes(p) for p in params),
        )


def logical_numel(p: torch.Tensor) -> int:
    """A parameter's element count as the model defines it: whole under ZeRO-3, which partitions at load
    (ds_numel), and unpacked for a 4-bit weight (two to a byte: its quant_state keeps the shape)."""
    state = getattr(p, "quant_state", None)
    return getattr(p, "ds_numel", None) or (state.shape.numel() if state is not None else p.numel())


def quant_state_bytes(p: torch.Tensor) -> int:
    """The block scales of a bitsandbytes 4-bit weight (8-bit absmax per block, fp32 scales of those, and the
    quantization tables); 0 for any other tensor."""
    state, total = getattr(p, "quant_state", None), 0
    while state is not None:
        total += sum(nbytes(t) for t in (state.absmax, state.code, getattr(state, "offset", None)) if t is not None)
        state = getattr(state, "state2", None)
    return total


@dataclass
class LoadRecord:
    """What loading the model took on this rank, measured around from_pretrained."""

    param_bytes: int | None = None  # parameter bytes held right after from_pretrained, before sharding
    host: dict[str, int] | None = None  # peak host RAM (PSS) that from_pretrained added: anon and file-backed
    memory: HostMemoryPeak | None = None  # still sampling, until the first step (the rank reports stop it)
