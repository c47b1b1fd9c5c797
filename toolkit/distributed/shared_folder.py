"""The output folder of a multi-node run, shared by every node, and one resume point for every rank.

Checkpoints hold each rank's part (its shards, its RNG state) and `--resume auto` reads the newest complete one:
both hold only where every node sees the same folder. On node-local disks (Ray's default, a pod's own volume)
each node kept its own ranks' files, and after a restart each rank decided from its own disk, so rank 0 could
start fresh while the others resumed. Checked once the process group exists, before any weights load: rank 0
writes a mark in the folder, and every rank must see it within SEEN_WITHIN_S. The resume point each rank found
is compared too: one line where they differ, never a run whose ranks started from different steps.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from ..errors import ConfigError

# NFS shows another client's new file after its attribute cache (seconds); a bucket mounted with a write-back
# cache (SkyPilot's MOUNT_CACHED: upload after 5 s, the other node's listing cached 10 s) after about 15 s.
SEEN_WITHIN_S = 30.0


def multi_node() -> bool:
    """A distributed run over more than one machine (torchrun's and Ray Train's LOCAL_WORLD_SIZE below the job's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size()) < dist.get_world_size()


def gathered(value: object) -> list:
    """Every rank's `value`, over a gloo group (host-side, whatever the run's backend)."""
    group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group)
    return values


def check_shared(folder: str | Path) -> None:
    """Refuse, on every rank at once, an output folder that some node does not share with rank 0's."""
    if not multi_node():
        return
    folder = Path(folder)
    mark = None
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        mark = folder / f".shared-{uuid.uuid4().hex}"
        mark.touch()
    mark = gathered(mark)[0]  # written before any rank looks
    end = time.monotonic() + SEEN_WITHIN_S
    while not (seen := mark.exists()) and time.monotonic() < end:
        time.sleep(0.5)
    views = gathered((seen, socket.gethostname()))
    if dist.get_rank() == 0:
        mark.unlink(missing_ok=True)
    blind = sorted({host for seen, host in views if not seen})
    if blind:
        raise ConfigError(
            f"the output folder {folder} is not shared by every node: {', '.join(blind)} cannot see what rank 0 "
            f"({views[0][1]}) wrote there, so checkpoints would be split across the nodes' disks and a resume "
            "would not hold. Pass an --output_dir on storage every node mounts (NFS, a shared volume)."
        )


def check_agreed(resume: str | None, folder: str | Path) -> None:
    """Every rank resumes from the same checkpoint (or none), or one line on every rank."""
    if not multi_node():
        return
    points = gathered(resume)
    if len(set(points)) > 1:
        found = ", ".join(f"rank {rank}: {point or 'none'}" for rank, point in enumerate(points))
        raise ConfigError(f"the ranks see different checkpoints in {folder} ({found}): is a checkpoint still being "
                          "written, or copied in by hand? Relaunch once it is complete.")  # fmt: skip
