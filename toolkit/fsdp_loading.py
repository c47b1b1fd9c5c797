"""RAM-efficient FSDP2 loading that keeps its promise: one copy of the model in host RAM across the ranks.

With `fsdp_cpu_ram_efficient_loading`, rank 0 loads the weights and the other ranks start empty (models.py).
accelerate's `fsdp2_prepare_model` then captures rank 0's full state dict, moves the model to the meta device,
shards it, and hands the full state dict to `fsdp2_load_full_state_dict`, which sends each tensor to the ranks
and keeps the shards. The full state dict stays referenced until the last tensor is sent, so at the end rank 0
holds the whole model plus its own shard, and the ranks together hold two copies: as much as loading without
the option. Measured (bench/ram_loading.py, bf16 checkpoint trained in bf16 mixed precision, whose fp32 master
copy accelerate makes on rank 0): 2 copies of anonymous memory across 2 ranks, 1.0 with this module.

This module hands accelerate the same state dict behind a view that lets go of each tensor once it has been
read, so each full tensor is freed as soon as its shards exist and the total stays at about one copy. Nothing
else changes: same function, same order, same shards. If accelerate stops calling the function this wraps,
tests/test_strategies.py::test_ram_efficient_loading_holds_one_copy fails; delete the module the day accelerate
frees the tensors itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import accelerate.utils.fsdp_utils as fsdp_utils

from .strategy import env_flag

_ORIGINAL = fsdp_utils.fsdp2_load_full_state_dict


class HandedOver(Mapping):
    """A state dict read once per key: reading a key removes it from the dict underneath, so the tensor is freed
    when the reader drops it (a tied weight, under two keys, lives until both are read)."""

    def __init__(self, state_dict: dict[str, Any]):
        self._state_dict = state_dict
        self._keys = list(state_dict)

    def __getitem__(self, key: str) -> Any:
        return self._state_dict.pop(key)

    def __contains__(self, key: object) -> bool:
        return key in self._state_dict

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@functools.wraps(_ORIGINAL)
def _load_releasing_as_sent(accelerator, model, full_sd, *args, **kwargs):
    return _ORIGINAL(accelerator, model, HandedOver(full_sd), *args, **kwargs)


def enable() -> None:
    """Call before the Trainer prepares the model. A no-op unless an FSDP launch asked for RAM-efficient loading."""
    if env_flag("ACCELERATE_USE_FSDP") and env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING"):
        fsdp_utils.fsdp2_load_full_state_dict = _load_releasing_as_sent
