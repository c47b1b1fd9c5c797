"""DeepSpeed's JIT-compiled ops (CPU Adam for ZeRO-Offload, the shared-memory collectives on a CPU): built once
per virtual environment, in its own folder, ahead of the first launch (`python -m toolkit build-ops`, which
`make install` runs), and the locks a killed build leaves behind.

Where: `<venv>/torch_extensions` unless TORCH_EXTENSIONS_DIR says otherwise. A build belongs to the environment
(its torch and DeepSpeed versions, its source paths): another environment's would be rebuilt anyway, and what a
killed build leaves in another environment's folder cannot reach this one. Ahead of time: a fresh machine's first
DeepSpeed launch otherwise spends 65 s building the collectives and its first offload launch 83 s more (2 cores).

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


def use_environment_folder() -> None:
    """Builds go to this environment's folder, unless TORCH_EXTENSIONS_DIR names another, and run this environment's
    ninja (DeepSpeed installs one) ahead of any other on PATH. torch runs whichever `ninja` PATH finds first, and a
    build log written by another version is one this one cannot read (a system ninja 1.11 and the environment's
    1.13: "build log version is too old; starting over"): every op was built again from scratch, CPU Adam in 70 s
    on 2 cores, whenever a run found the other ninja first (an activated environment, or not)."""
    import sys

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    own = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (own / "ninja").is_file() and path.split(os.pathsep)[0] != str(own):
        os.environ["PATH"] = os.pathsep.join([str(own), path]) if path else str(own)


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


# The ops a CPU machine's DeepSpeed launches build: the shared-memory collectives (every launch) and CPU Adam
# (ZeRO-Offload). On a GPU machine DeepSpeed's own CUDA builds happen at first use, as it documents.
CPU_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")


def build_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit build-ops`: build DeepSpeed's CPU ops into this environment's folder now, once, instead of
    inside the first launches that need them (each prints `built` or why it is skipped)."""
    import torch

    use_environment_folder()
    if torch.cuda.is_available():
        print("build-ops: a CUDA machine: DeepSpeed builds its ops when first used")
        return 0
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("build-ops: DeepSpeed is not installed: nothing to build")
        return 0
    clear_stale_locks()
    for name in CPU_OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build-ops: {name} cannot be built here (a C++ compiler and the Python headers are needed)")
            continue
        builder.load(verbose=False)
        print(f"build-ops: {builder.absolute_name()} built in {extensions_root() / builder.name}")
    return 0
