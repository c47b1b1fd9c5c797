"""The device mesh a launch asked for, from the environment `accelerate launch` sets: the lowest layer reads it,
so that a batch size, a token count and a loader all agree on what one data-parallel replica is."""

from __future__ import annotations

import math
import os

MESH_AXES = ("dp_replicate", "dp_shard", "tp", "cp", "sp", "pp", "ep")  # accelerate's ParallelismConfig's, pp, ep
# Pipeline and expert parallelism are the toolkit's axes (accelerate's ParallelismConfig has neither, and its
# launcher drops the keys): `toolkit launch` exports the file's parallelism_config_pp_size, _pp_schedule and
# _ep_size the same way accelerate exports the others.
LAUNCHER_KEYS = ("parallelism_config_pp_size", "parallelism_config_pp_schedule", "parallelism_config_ep_size")
PIPELINE_SCHEDULES = ("1F1B", "GPipe")  # torch.distributed.pipelining's schedules of one stage per rank


def launch_mesh() -> dict[str, int]:
    """The device mesh the accelerate config asked for (its `parallelism_config`, which `accelerate launch`
    exports as PARALLELISM_CONFIG_*_SIZE): each axis larger than 1, by accelerate's name."""
    sizes = {axis: int(os.environ.get(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE") or 1) for axis in MESH_AXES}
    return {axis: size for axis, size in sizes.items() if size > 1}


def pipeline_stages() -> int:
    """Stages the model's layers are split into (1: no pipeline)."""
    return launch_mesh().get("pp", 1)


def pipeline_schedule() -> str:
    """The pipeline's schedule (torch.distributed.pipelining's name): the config's, 1F1B unless it says."""
    return os.environ.get("PARALLELISM_CONFIG_PP_SCHEDULE") or PIPELINE_SCHEDULES[0]


def config_mesh(parallelism_config: dict | None) -> dict[str, int]:
    """The same, from an accelerate config file's `parallelism_config` section (`parallelism_config_tp_size`: 2)."""
    sizes = {key.removeprefix("parallelism_config_").removesuffix("_size"): int(value)
             for key, value in (parallelism_config or {}).items() if key.endswith("_size")}  # fmt: skip
    return {axis: size for axis, size in sizes.items() if size > 1}


def describe(mesh: dict[str, int]) -> str:
    """`dp_shard=2 x tp=2`, as the header and the errors write a mesh."""
    return " x ".join(f"{axis}={size}" for axis, size in mesh.items())


def mesh_processes(mesh: dict[str, int]) -> int:
    """The processes a mesh covers: the product of its axes but ep, whose groups lie across the dp_shard (x tp)
    ranks (transformers' DistributedConfig: ep divides dp_shard x tp)."""
    return math.prod(size for axis, size in mesh.items() if axis != "ep")


def model_parallel_size() -> int:
    """Ranks that share one batch (tensor, context, sequence and pipeline axes): a data-parallel replica's size."""
    mesh = launch_mesh()
    return math.prod(mesh.get(axis, 1) for axis in MODEL_PARALLEL_AXES)


def sequence_split() -> int:
    """Ranks one row's sequence is split over (context or sequence parallel): under a split, each batch is padded
    to a multiple of split_multiple(), so every rank's slice is equally long."""
    mesh = launch_mesh()
    return mesh.get("cp", 1) * mesh.get("sp", 1)


def split_multiple() -> int | None:
    """What every row's length must be a multiple of under a sequence split: sp (Ulysses gives each rank an equal
    slice) or 2 x cp (torch's load-balanced ring attention cuts a row into 2 x cp chunks); None without one."""
    mesh = launch_mesh()
    return 2 * mesh["cp"] if mesh.get("cp", 1) > 1 else mesh.get("sp") if mesh.get("sp", 1) > 1 else None


def sequence_attention() -> str:
    """The kernel DeepSpeed's Ulysses runs on each rank's heads (the config's
    `parallelism_config_sp_attn_implementation`; sdpa when unset): under sequence parallelism it, not the model's
    attn_implementation, computes attention."""
    value = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
    return value if value not in (None, "", "None") else "sdpa"


def data_parallel_replicas(world_size: int) -> int:
    """Groups of ranks that each train on their own rows."""
    return world_size // model_parallel_size()


MODEL_PARALLEL_AXES = ("tp", "cp", "sp", "pp")


def job_mesh(parallelism_config: dict | None, nodes: int, per_node: int) -> dict[str, int]:
    """A config file's mesh (its `parallelism_config`) sized for a job of `nodes` x `per_node` processes (a
    scheduler's, slurm/): the file's model-parallel axes as they are (tp, cp, sp, pp: what the model and rows
    need), its data-parallel axes filling the rest of the job, each kind as the file asks for it: HYBRID_SHARD
    (dp_replicate and dp_shard) replicates across the nodes and shards inside each; a dp_shard axis shards over
    every replica; a file with none, and a pipeline, replicates (tp, cp, pp); under DeepSpeed's sequence
    parallelism (sp) DeepSpeed forms data parallelism itself. Every size given, 1s included, so the job's flags
    replace the file's one for one. {} for a file without a mesh."""
    from ..errors import ConfigError

    file_mesh = {key.removeprefix("parallelism_config_").removesuffix("_size"): int(value)
                 for key, value in (parallelism_config or {}).items() if key.endswith("_size")}  # fmt: skip
    if not file_mesh:
        return {}
    split = {axis: file_mesh.get(axis, 1) for axis in MODEL_PARALLEL_AXES if file_mesh.get(axis, 1) > 1}
    model_parallel = math.prod(split.values())
    world = nodes * per_node
    inside = split.get("tp", 1) * split.get("cp", 1)  # all-reduces and ring passes in every layer: one node
    if per_node % inside:
        raise ConfigError(f"the mesh {describe(split)} needs {inside} processes inside one node and a node has "
                          f"{per_node}: use a tp/cp size that divides the GPUs per node (in the config, or for "
                          "slurm/launch_node.sh MESH_FLAGS=--parallelism_config_tp_size=N).")  # fmt: skip
    if world % model_parallel:
        raise ConfigError(f"the mesh {describe(split)} does not divide the job's {world} processes ({nodes} node(s) "
                          f"x {per_node}): use sizes whose product divides {world} (in the config, or for "
                          "slurm/launch_node.sh MESH_FLAGS=--parallelism_config_<axis>_size=N).")  # fmt: skip
    if "sp" in split:
        return split
    replicas = world // model_parallel
    experts = {"ep": file_mesh["ep"]} if "ep" in file_mesh else {}  # no process axis: inside dp_shard, as given
    if "pp" in split:  # stages across nodes (only activations cross), their replicas inside and across them
        return {"dp_replicate": replicas, "dp_shard": 1, **split}
    if "dp_replicate" in file_mesh:
        return {"dp_replicate": nodes, "dp_shard": per_node // inside, **split, **experts}
    if "dp_shard" in file_mesh:
        return {"dp_replicate": 1, "dp_shard": replicas, **split, **experts}
    return {"dp_replicate": replicas, "dp_shard": 1, **split}


def launch_flags(mesh: dict[str, int]) -> list[str]:
    """accelerate launch's flags for a mesh."""
    return [f"--parallelism_config_{axis}_size={size}" for axis, size in mesh.items()]
