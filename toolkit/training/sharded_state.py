"""The optimizer and scheduler of a model transformers sharded as it loaded (tensor, expert parallelism), in its
checkpoints: transformers refuses to write them ("Resuming is not supported for models sharded at load time"), so
a resume started a fresh AdamW and restarted the learning-rate schedule from its warmup, silently.

Each rank writes its optimizer state as it holds it, every DTensor as its local shard (`optimizer-rank{r}.pt`),
rank 0 the scheduler (the Trainer writes every rank's RNG state, as for any run). A resume on the same mesh gives
the optimizer its state first (a zero-learning-rate step, as FSDP2's path does) and puts each saved shard back into
the DTensor it came from: the run goes on exactly where it stopped. The toolkit's fp32 master weights travel in
the optimizer's state dict (precision.py), shards too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers.trainer import SCHEDULER_NAME

from .checkpoint_damage import rank_optimizer


def local(value: Any) -> Any:
    """A state dict with every DTensor replaced by this rank's shard (what torch.save can write and read back)."""
    if isinstance(value, DTensor):
        return value.to_local().clone()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(local(v) for v in value)
    return value


def placed(saved: Any, like: Any) -> Any:
    """`saved` (as `local` wrote it) with each shard put back into a DTensor placed as the one in `like`."""
    if isinstance(like, DTensor):
        return DTensor.from_local(saved.to(like.device), like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())  # fmt: skip
    if isinstance(like, dict):
        return {k: placed(v, like[k]) if k in like else v for k, v in saved.items()}
    if isinstance(like, list | tuple) and len(like) == len(saved):
        return type(saved)(placed(s, w) for s, w in zip(saved, like, strict=True))
    return saved


def save(trainer, output_dir: str) -> None:
    """The trainer's optimizer (this rank's shards) and, on rank 0, its scheduler, into `output_dir`."""
    torch.save(local(trainer.optimizer.state_dict()), rank_optimizer(output_dir, trainer.args.process_index))
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)


@torch.no_grad()
def zero_step(optimizer: torch.optim.Optimizer) -> None:
    """A step that changes no weight and gives the optimizer its state (torch's `_init_optim_state` passes over
    tensors that do not require grad, which the toolkit's fp32 masters are)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def load(trainer, checkpoint: str) -> None:
    """The state `save` wrote, into the trainer's optimizer (its shards placed as the live ones) and scheduler."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper steps when synced
    zero_step(optimizer)  # the live state a saved shard is placed like
    saved = torch.load(rank_optimizer(checkpoint, trainer.args.process_index), weights_only=True, map_location="cpu")
    trainer.optimizer.load_state_dict(placed(saved, optimizer.state_dict()))
    trainer.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True))
