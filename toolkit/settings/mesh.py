"""The device mesh a launch asked for, from the environment `accelerate launch` sets: the lowest layer reads it,
so that a batch size, a token count and a loader all agree on what one data-parallel replica is."""

from __future__ import annotations

import os

MESH_AXES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # accelerate's ParallelismConfig, in its order


def launch_mesh() -> dict[str, int]:
    """The device mesh the accelerate config asked for (its `parallelism_config`, which `accelerate launch`
    exports as PARALLELISM_CONFIG_*_SIZE): each axis larger than 1, by accelerate's name."""
    sizes = {axis: int(os.environ.get(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE") or 1) for axis in MESH_AXES}
    return {axis: size for axis, size in sizes.items() if size > 1}


def config_mesh(parallelism_config: dict | None) -> dict[str, int]:
    """The same, from an accelerate config file's `parallelism_config` section (`parallelism_config_tp_size`: 2)."""
    sizes = {key.removeprefix("parallelism_config_").removesuffix("_size"): int(value)
             for key, value in (parallelism_config or {}).items() if key.endswith("_size")}  # fmt: skip
    return {axis: size for axis, size in sizes.items() if size > 1}


def describe(mesh: dict[str, int]) -> str:
    """`dp_shard=2 x tp=2`, as the header and the errors write a mesh."""
    return " x ".join(f"{axis}={size}" for axis, size in mesh.items())


def model_parallel_size() -> int:
    """Ranks that share one batch (tensor, context and sequence parallel axes): a data-parallel replica's size."""
    mesh = launch_mesh()
    return mesh.get("tp", 1) * mesh.get("cp", 1) * mesh.get("sp", 1)


def sequence_split() -> int:
    """Ranks one row's sequence is split over (context or sequence parallel): under a split, rows are padded to
    max_seq_length, a multiple of it, so every rank's slice is equally long."""
    mesh = launch_mesh()
    return mesh.get("cp", 1) * mesh.get("sp", 1)


def sequence_attention() -> str:
    """The kernel DeepSpeed's Ulysses runs on each rank's heads (the config's
    `parallelism_config_sp_attn_implementation`; sdpa when unset): under sequence parallelism it, not the model's
    attn_implementation, computes attention."""
    value = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
    return value if value not in (None, "", "None") else "sdpa"


def data_parallel_replicas(world_size: int) -> int:
    """Groups of ranks that each train on their own rows."""
    return world_size // model_parallel_size()
