"""RAM-efficient FSDP2 loading that keeps its promise: about one copy of the model in host RAM across the ranks.

With `fsdp_cpu_ram_efficient_loading`, rank 0 loads the weights and the other ranks start empty (models.py).
accelerate's `fsdp2_prepare_model` then captures rank 0's full state dict, moves the model to the meta device,
shards it, and hands the full state dict to `fsdp2_load_full_state_dict`, which for every tensor
  1. broadcasts the full tensor from rank 0 into a full-size buffer on every rank, then
  2. calls `distribute_tensor`, which scatters rank 0's tensor again (its `src_data_rank=0`) and keeps the shard,
and keeps the full state dict referenced until the last tensor. So at the end rank 0 holds the whole model plus
its shard, every other rank has written a whole copy of each tensor, and the model crosses the network twice.
Measured (bench/ram_loading.py, bf16 checkpoint in bf16 mixed precision, which accelerate upcasts to fp32 master
weights on rank 0): 3.2 copies of anonymous host RAM across 2 ranks, more than loading without the option (3.0);
with this module and fp32 placeholders on the receiving ranks (models.allocate_placeholders), 1.19.

`load_full_state_dict` below is that function without those costs: rank 0 lets go of each full tensor once its
shards are out, and the other ranks pass an untouched buffer (never written, so never committed) to
`distribute_tensor`, whose scatter is the only transfer. Same shards, same dtypes, same order. It replaces
accelerate's function when an FSDP launch asks for RAM-efficient loading; if accelerate stops calling it,
tests/test_strategies.py::test_ram_efficient_loading_holds_one_copy fails. Delete this module the day accelerate
does the same.
"""

from __future__ import annotations

import torch

from ..launch import env_flag
from .gate import Patch, Target


def load_full_state_dict(accelerator, model: torch.nn.Module, full_sd: dict, cpu_offload: bool = False):
    """Give every rank its shards of rank 0's `full_sd` (emptied on the way); the model's parameters are on meta."""
    from torch.distributed.tensor import distribute_tensor

    sharded = {}
    for name, meta in model.state_dict().items():  # DTensors on the meta device: global shape, mesh, placements
        mesh = meta.device_mesh
        if accelerator.is_main_process:
            full = full_sd.pop(name).detach().to(mesh.device_type)  # a tied weight's second key keeps it alive
        else:
            full = torch.empty(meta.size(), device=mesh.device_type, dtype=meta.dtype)  # only its shape is read
        shard = distribute_tensor(full, mesh, meta.placements)  # scattered from rank 0 (src_data_rank=0)
        del full
        if meta.dtype.is_floating_point and shard.dtype != meta.dtype:
            shard = shard.to(meta.dtype)
        sharded[name] = shard.to("cpu") if cpu_offload else shard  # CPU offload: FSDP expects host shards
    model.load_state_dict(sharded, assign=True)
    return model


def needed() -> bool:
    return env_flag("ACCELERATE_USE_FSDP") and env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING")


def install() -> None:
    """Before the Trainer prepares the model: accelerate's fsdp2_prepare_model calls this function by name."""
    import accelerate.utils.fsdp_utils as fsdp_utils

    fsdp_utils.fsdp2_load_full_state_dict = load_full_state_dict


PATCH = Patch(
    name="fsdp_loading",
    library="accelerate",
    versions=("1.15", "1.16"),
    targets=(
        Target("accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict",
               ("accelerator", "model", "full_sd", "cpu_offload")),
        Target("accelerate.utils.fsdp_utils:fsdp2_prepare_model"),  # the caller, which looks the name up
    ),
    needed=needed,
    install=install,
    without="RAM-efficient loading holds up to three copies of the model in host RAM across 2 ranks, not one",
    delete_when="accelerate scatters each tensor once and frees rank 0's full state dict as it goes",
)  # fmt: skip
