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


def model_parallel_size() -> int:
    """Ranks that share one batch (tensor, context and sequence parallel axes): a data-parallel replica's size."""
    mesh = launch_mesh()
    return mesh.get("tp", 1) * mesh.get("cp", 1) * mesh.get("sp", 1)
