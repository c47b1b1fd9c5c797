"""The distributed strategy: what the launch asked for, what is in effect, and a refusal when they differ.

accelerate degrades silently in several ways (../shared/cpu-distributed.md): an FSDP config becomes plain DDP
on CPU, `--cpu --num_processes 2` starts one process, and ranks that never joined a process group each train
alone on the whole data set. Every one of these costs a full run before anyone notices, so we refuse to start.

What was asked is read from the environment `accelerate launch` and torchrun give the script:
- WORLD_SIZE: set by torchrun (accelerate's multi-GPU and DeepSpeed launchers use it) to the processes started.
- MASTER_ADDR without WORLD_SIZE: accelerate's simple launcher sets MASTER_ADDR only when more than one
  process or machine was asked for, yet starts a single process (`prepare_simple_launcher_cmd_env`).
- ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED: set from the config's distributed_type.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType


class StrategyMismatch(RuntimeError):
    """The launch does not run the strategy its config asked for."""


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


@dataclass
class Requested:
    num_processes: int | None  # None: not known from the environment
    fsdp: bool
    deepspeed: bool
    collapsed_launch: bool  # accelerate's simple launcher was asked for several processes

    @classmethod
    def from_env(cls) -> Requested:
        world = os.environ.get("WORLD_SIZE")
        under_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
        return cls(
            num_processes=int(world) if world else None,
            fsdp=env_flag("ACCELERATE_USE_FSDP"),
            deepspeed=env_flag("ACCELERATE_USE_DEEPSPEED"),
            collapsed_launch=under_accelerate and world is None and "MASTER_ADDR" in os.environ,
        )


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_config_paths() -> None:
    """Let an accelerate config name its DeepSpeed JSON relative to the project, from any working directory."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or Path(path).is_file():
        return
    candidate = PROJECT_ROOT / path
    if not candidate.is_file():
        raise StrategyMismatch(
            f"DeepSpeed config file '{path}' (deepspeed_config_file in the accelerate config) not found from "
            f"{Path.cwd()} nor from {PROJECT_ROOT}."
        )
    os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(candidate)


def check_processes(num_processes: int, requested: Requested | None = None) -> None:
    """Run as soon as the process group exists, before any weights are loaded."""
    requested = requested or Requested.from_env()
    if requested.collapsed_launch:
        raise StrategyMismatch(
            "accelerate was asked for several processes but started only this one (its simple launcher: "
            "`--cpu` or `distributed_type: MULTI_CPU` without MPI). On a CPU machine launch with "
            "`accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes N ...` instead: the "
            "toolkit runs it over gloo."
        )
    if requested.num_processes is not None and requested.num_processes != num_processes:
        raise StrategyMismatch(
            f"{requested.num_processes} processes were launched but this one sees a job of {num_processes}: "
            "the ranks are training independently on the same data. On a machine without GPUs pass "
            "--use_cpu true so they join one gloo process group."
        )


def check_strategy(accelerator: Accelerator, requested: Requested | None = None) -> None:
    """Run once the Trainer has built its accelerator, before training."""
    requested = requested or Requested.from_env()
    check_processes(accelerator.num_processes, requested)
    in_effect = accelerator.distributed_type
    if requested.fsdp and in_effect != DistributedType.FSDP:
        raise StrategyMismatch(
            f"The config asks for FSDP but accelerate set up {in_effect.value} (no sharding). On CPU, accelerate "
            "turns FSDP into DDP; launch a DDP or DeepSpeed config instead, or run the FSDP config on GPUs."
        )
    if requested.deepspeed and in_effect != DistributedType.DEEPSPEED:
        raise StrategyMismatch(f"The config asks for DeepSpeed but accelerate set up {in_effect.value}.")
    check_hybrid_mesh(accelerator)


def check_hybrid_mesh(accelerator: Accelerator) -> None:
    """HYBRID_SHARD shards inside a node: a shard group that spans nodes all-gathers over the slow network.

    The mesh is replicate x shard with the shard dimension innermost, so shard groups are runs of consecutive
    ranks; they stay inside a node when the processes per node are a multiple of the shard size.
    """
    mesh = accelerator.parallelism_config
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    if mesh is None or not (mesh.dp_replicate_enabled and mesh.dp_shard_enabled) or per_node % mesh.dp_shard_size == 0:
        return
    nodes = max(1, accelerator.num_processes // per_node)
    raise StrategyMismatch(
        f"The HYBRID_SHARD mesh shards over {mesh.dp_shard_size} processes but a node runs {per_node}: set "
        f"parallelism_config_dp_shard_size: {per_node} and parallelism_config_dp_replicate_size: {nodes} in the "
        f"config, or pass --parallelism_config_dp_shard_size {per_node} "
        f"--parallelism_config_dp_replicate_size {nodes} to accelerate launch."
    )


def layer_class(model) -> str:
    """The model's repeated block (LlamaDecoderLayer, BertLayer): the class of its longest layer list."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    blocks = [m for m in lists if len({type(x) for x in m}) == 1]
    if not blocks:
        raise StrategyMismatch(f"{type(model).__name__} has no list of identical layers for FSDP to wrap.")
    return type(max(blocks, key=len)[0]).__name__


def set_fsdp_wrap_class(model) -> None:
    """FSDP wraps one unit per transformer layer: the config's class if it names one (checked), else the model's.

    Left empty, accelerate wraps every class in `_no_split_modules`, which for BERT includes the embeddings
    module; it then wraps the word embeddings inside it a second time and FSDP2 fails at set-up.
    """
    if not env_flag("ACCELERATE_USE_FSDP"):
        return
    configured = [c.strip() for c in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip()]
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in configured if c not in present]
    if missing:
        raise StrategyMismatch(
            f"fsdp_transformer_layer_cls_to_wrap names {missing}, which {type(model).__name__} does not have. "
            f"Set it to {layer_class(model)} or to null (the model's own layer class)."
        )
    if not configured:
        os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = layer_class(model)


def num_machines(num_processes: int) -> int:
    """Nodes in the job: torchrun sets LOCAL_WORLD_SIZE to the processes on this node."""
    return max(1, num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", num_processes)))


def describe(accelerator: Accelerator) -> dict[str, str | int]:
    """The strategy in effect, as printed in the run header and logged to W&B."""
    state = accelerator.state
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = state.fsdp_plugin
        if plugin.fsdp_version == 2:  # FSDP2 expresses FULL_SHARD / SHARD_GRAD_OP as reshard_after_forward
            mode = "FULL_SHARD" if plugin.reshard_after_forward else "SHARD_GRAD_OP"
        else:
            mode = getattr(plugin.sharding_strategy, "name", plugin.sharding_strategy)
        mesh = accelerator.parallelism_config
        if mesh is not None and mesh.dp_replicate_enabled and mesh.dp_shard_enabled:  # FSDP2's HSDP
            mode = f"HYBRID_SHARD ({mesh.dp_replicate_size} replicas x {mesh.dp_shard_size} shards)"
        sharding = f"FSDP{plugin.fsdp_version} {mode}"
        offload = plugin.cpu_offload  # FSDP1: CPUOffload(offload_params); FSDP2: an OffloadPolicy subclass
        if getattr(offload, "offload_params", False) or type(offload).__name__ == "CPUOffloadPolicy":
            sharding += " offload_params=cpu"
    elif kind == DistributedType.DEEPSPEED:
        zero = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        sharding = f"ZeRO-{zero.get('stage', 0)}"
        for what in ("offload_optimizer", "offload_param"):
            device = zero.get(what, {}).get("device", "none")
            if device not in ("none", None):
                sharding += f" {what}={device}"
    elif accelerator.num_processes > 1:
        sharding = "none (replicated, DDP)"
    else:
        sharding = "none (single process)"
    return {
        "distributed_type": kind.value,
        "num_processes": accelerator.num_processes,
        "num_machines": num_machines(accelerator.num_processes),
        "device": str(accelerator.device.type),
        "mixed_precision": accelerator.mixed_precision,
        "sharding": sharding,
        "backend": str(state.backend) if state.backend else "none",
    }
