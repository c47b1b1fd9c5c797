"""Where a run and each command may write: one rule for all of them, checked before anything is written.

A run writes into its own output folder only (`--output_dir`): its log, samples, summary, card, checkpoints
(`checkpoint-N`, staged in `.staging` first) and its export. So a run's folder is never inside another run's folder
or checkpoint (it would write over that run's files, or be pushed and rotated with them), and it must be writable
before the first step, not at the first save. The commands that write (`toolkit eval` into the run it evaluates,
`toolkit report` into its --output) check their folder the same way before any model loads; the others (push,
generate, chat, plan) write nothing into a run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import ConfigError

# A run folder's own files, which mark a folder as a run's (the rooms that write them import the names from here).
SUMMARY = "run_summary.json"  # a run's end: its summary and config
OWNER = "toolkit_run.json"  # in every checkpoint: which recipe and model wrote it
STAGING = ".staging"  # checkpoints being written, renamed into place when complete
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def writable(folder: str | Path) -> str | None:
    """Why `folder` cannot be written (or created), or None. Read off its nearest existing folder: os.access
    answers for a read-only file system (EROFS) whoever asks, and for permissions unless the asker is root."""
    path = Path(folder).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable (a read-only file system, or no permission)"
    return None


def check_writable(folder: str | Path, what: str, fix: str) -> None:
    """One error line, before anything is written, where `what` cannot go into `folder`; `fix` names the flag."""
    if why := writable(folder):
        raise ConfigError(f"cannot write {what} to {folder}: {why}. {fix}")


def run_folder_of(folder: Path) -> Path | None:
    """The run folder or checkpoint that `folder` is, or is inside: the nearest folder at or above it that is a
    checkpoint (`checkpoint-N` with the Trainer's or the toolkit's record, or `.staging`), or above it that holds a
    run's own files (its summary, its checkpoints). `folder` itself holding an earlier run is not counted."""
    for path in (folder, *folder.parents):
        if is_checkpoint(path) or (path != folder and is_run_folder(path)):
            return path
    return None


def is_checkpoint(path: Path) -> bool:
    if path.name == STAGING:
        return path.is_dir()
    return bool(CHECKPOINT.match(path.name)) and any((path / f).is_file() for f in (OWNER, "trainer_state.json"))


def is_run_folder(path: Path) -> bool:
    try:
        return (path / SUMMARY).is_file() or any(CHECKPOINT.match(p.name) and p.is_dir() for p in path.iterdir())
    except OSError:  # a folder this user cannot list: not one a run of theirs wrote
        return False


def check_run_output(output_dir: str | Path) -> None:
    """A run's --output_dir: writable, and not inside another run's folder or checkpoint (an earlier run in the folder
    itself is the caller's: resumed, or replaced with a warning)."""
    folder = Path(output_dir).expanduser().absolute()
    fix = "Pass another --output_dir."
    if (found := run_folder_of(folder)) is not None:
        kind = "a checkpoint" if found.name == STAGING or CHECKPOINT.match(found.name) else "another run's folder"
        where = "is" if found == folder else "is inside"
        raise ConfigError(f"--output_dir {output_dir} {where} {kind} ({found}): a run writes into its own folder, "
                          f"never over another run's checkpoint or files. {fix}")  # fmt: skip
    check_writable(folder, "the run's checkpoints and model", fix)
