"""What the launch asked for, read from the environment `accelerate launch` and torchrun give the script.

- WORLD_SIZE: set by torchrun (accelerate's multi-GPU and DeepSpeed launchers use it) to the processes started.
- MASTER_ADDR without WORLD_SIZE: accelerate's simple launcher sets MASTER_ADDR only when more than one
  process or machine was asked for, yet starts a single process (`prepare_simple_launcher_cmd_env`).
- ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED: set from the config's distributed_type; FSDP_* and
  ACCELERATE_DEEPSPEED_* carry the config's settings.
- LOCAL_WORLD_SIZE, LOCAL_RANK: the processes on this node, and this one's index among them (torchrun).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def weights_arrive_upcast(mixed_precision: bool) -> bool:
    """Whether rank 0's trainable 16-bit weights are fp32 when FSDP sends them to the other ranks. FSDP2: yes under
    mixed precision (accelerate's fsdp2_prepare_model upcasts them before it shards). FSDP1: no, its
    sync_module_states broadcasts them at wrapping, in the checkpoint's dtype, and accelerate upcasts the flat
    parameters after. The receiving ranks' placeholders take that dtype (models/loading.py)."""
    return mixed_precision and os.environ.get("FSDP_VERSION", "1") == "2"


def receives_weights_from_rank0() -> bool:
    """FSDP with RAM-efficient loading on a rank other than 0: this rank starts empty and receives its shard."""
    ram_efficient = env_flag("ACCELERATE_USE_FSDP") and env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING")
    return ram_efficient and os.environ.get("RANK", "0") != "0"


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

    @property
    def engine(self) -> str:
        """What decides a checkpoint's format: DeepSpeed's, FSDP's, a pipeline's (one optimizer file a stage), or
        the Trainer's own (single, DDP)."""
        from ..settings.mesh import pipeline_stages

        if self.deepspeed or self.fsdp:
            return "DEEPSPEED" if self.deepspeed else "FSDP"
        return "PIPELINE" if pipeline_stages() > 1 else "replicated"


def num_machines(num_processes: int) -> int:
    """Nodes in the job: torchrun sets LOCAL_WORLD_SIZE to the processes on this node."""
    return max(1, num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", num_processes)))


def tell_deepspeed_the_local_processes() -> None:
    """DeepSpeed's CPU accelerator counts a node's devices from LOCAL_SIZE, which its own launcher sets and torchrun
    does not; without it every count runs `numactl --hardware` in a subprocess, forked from the whole rank, and
    ZeRO-3 counts at each reduction of gradients: 2 ZeRO-3 steps of SmolLM2-135M on 2 CPU processes took 32 s, most
    of it in the kernel. torchrun's LOCAL_WORLD_SIZE is the same number (GPU accelerators count their GPUs)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])


def is_local_main_process() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


def release_deepspeed_shm() -> None:
    """DeepSpeed's CPU all-reduce (its shm_comm op) gives each rank a 67 MB segment in RAM-backed /dev/shm, named
    deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, that every rank maps and none unlinks
    (DeepSpeed defines shared_close and never calls it): each CPU DeepSpeed launch kept 134 MB of RAM after it
    ended, 13 GB on this machine after a day of test runs, until the OOM killer took a test worker. Once every rank
    has mapped its peers' segments (DeepSpeed's comm init waits for them all; then a barrier), each removes its
    own name: the mappings stay valid, and the memory is freed when the processes end, however they end. Called
    once the engine exists (DeepSpeed makes its comm backend, and the segments, in deepspeed.initialize)."""
    import torch
    import torch.distributed as dist

    if not (env_flag("ACCELERATE_USE_DEEPSPEED") and dist.is_available() and dist.is_initialized()):
        return
    if torch.cuda.is_available():  # DeepSpeed's CUDA accelerator all-reduces with NCCL, no segments
        return
    dist.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}"
    with contextlib.suppress(OSError):
        os.unlink(f"/dev/shm/{name}_{dist.get_rank()}")
