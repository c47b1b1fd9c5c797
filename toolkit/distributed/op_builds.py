"""Locks left behind by a killed build of DeepSpeed's JIT-compiled ops (CPU Adam for ZeRO-Offload, ...).

torch builds an extension under a lock file (`torch.utils.file_baton.FileBaton`): the builder creates
`<extensions dir>/<op>/lock` and removes it when the build ends; everyone else polls until it is gone. A build
killed half-way (a timeout, `kill -9`, a preempted node) leaves the file behind, and every later run that needs
the op waits on it forever, saying nothing: DeepSpeed's users know this as the run that hangs before step 1.

The builder holds the lock file open for the whole build, so a lock that no process on this machine has open
was left by a dead build. On a local disk that is proof and the lock is removed; on a shared file system
another machine may be building, so the toolkit only says which file to remove.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import warn

SHARED_FILESYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.sshfs"}


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else its per-Python/accelerator default folder."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())  # its subfolders (py311_cpu, py311_cu121, ...) are searched too


def open_files() -> set[Path]:
    """Every file some process on this machine holds open (those whose /proc entries we may read)."""
    held = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    held.add(Path(os.readlink(fd)))
                except OSError:
                    pass  # closed meanwhile
        except OSError:
            pass  # another user's process, or one that exited
    return held


def filesystem_type(path: Path) -> str:
    """The type of the file system `path` lies on, from the longest matching mount point in /proc/mounts."""
    best, kind = "", ""
    real = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def clear_stale_locks(root: Path | None = None) -> list[Path]:
    """Removes build locks that no process holds (local disks), warns about them (shared file systems).

    Returns the locks removed. Linux only (it reads /proc); elsewhere it does nothing.
    """
    root = root or extensions_root()
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    held = open_files()
    removed = []
    for lock in locks:
        if lock.resolve() in held:
            continue  # a build is running on this machine
        if filesystem_type(lock) in SHARED_FILESYSTEMS:
            warn(
                f"{lock}: a build lock that no process on this machine holds. If no other machine is building "
                f"this op now, remove it (`rm {lock}`), or this run waits for it forever.",
                all_ranks=True,  # each node's first process checks its own disk
            )
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue  # another process removed it first
        warn(
            f"removed {lock}, left by a killed build of the {lock.parent.name} op (this run would have waited "
            "for it forever); the op is built again when first used.",
            all_ranks=True,
        )
        removed.append(lock)
    return removed
