"""How rank 0 publishes a staged checkpoint (StagedCheckpoints, checkpoints.py): once it sees every rank's files,
flushed, renamed into place, and the marker last (the owner record, with every file of the checkpoint and its size).
On a bucket mounted with a write-back cache each node sees another's files only once uploaded and its listing
expired, and a rename moves only what its mount sees: so the wait, and a checkpoint trusted only with its marker
(checkpoint_damage.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from ..outputs import OWNER
from .checkpoint_damage import MANIFEST, whose

# How long rank 0 waits, from the last file it saw appear, for the next of the other nodes' files in its view of the
# staging folder. On a MOUNT_CACHED bucket a file shows after the writer's write-back delay (5 s), its upload and
# the reader's directory cache (10 s): about 10-15 s a checkpoint, plus the upload of the largest shard.
VISIBLE_WITHIN_S = 300.0
POLL_S = 1.0  # between rank 0's looks; every rank hears each one (a peer lost meanwhile fails it at once)


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under root to disk: a rename must not publish data still in page cache."""
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root as this node sees it: relative path -> (size, mtime_ns); {} where root is not there."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):  # removed while listed
                stat = os.stat(path)
                found[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return found


def changed(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The files of `after` that are new or rewritten since `before` (path -> size): what this node's ranks wrote, in
    its view. Files another node left there earlier (a bucket mount's stale listing) are not among them."""
    return {name: stat[0] for name, stat in after.items() if before.get(name) != stat}


def size_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def publish(staged: Path, output_dir: str | Path, owner: dict) -> Path:
    """Rank 0, once it sees every rank's files in `staged`: flush, rename into OUTPUT, then the marker last, the owner
    record with every file of the checkpoint and its size (`files`). A checkpoint without it is never trusted: a
    save killed between the rename and the marker, or a bucket's upload that did not finish, is skipped."""
    files = {name: size for name, (size, _) in sorted(listing(staged).items()) if name != OWNER}
    fsync_tree(staged)
    target = Path(output_dir) / staged.name
    if target.exists():  # the same step saved again (a run resumed from before it): the new one wins
        shutil.rmtree(target)
    os.replace(staged, target)
    fsync_dir(target.parent)  # the rename itself
    with open(target / OWNER, "w") as marker:
        marker.write(json.dumps({**owner, MANIFEST: files}, indent=2))
        marker.flush()
        os.fsync(marker.fileno())
    fsync_dir(target)
    return target


def not_visible(staged: Path, missing: dict[str, int], waited: float) -> str:
    """Rank 0's error where another node's files never showed in its view of the staging folder."""
    name, size = next(iter(missing.items()))
    more = f" and {len(missing) - 1} other file(s)" if len(missing) > 1 else ""
    return (f"{staged.name} cannot be published: for {waited:.0f} s rank 0 has not seen {whose(name)} ({size:,} "
            f"bytes){more} in {staged.parent}, which another node wrote: that node's uploads stalled or it was lost "
            "(on a bucket mount, see its log), or --output_dir is not storage every node shares. Relaunch with "
            "--resume auto (it continues from the newest complete checkpoint), with --output_dir on storage every node "
            "mounts.")  # fmt: skip
