"""Checkpoint folders that are either complete or absent, `--resume auto`, and an output folder's owner.

The Trainer writes `checkpoint-N` in place: a process killed mid-save (a spot preemption, `kill -9`, a full
disk) leaves a folder that looks like the newest checkpoint and cannot be resumed from. Here every rank writes
into `OUTPUT/.staging/checkpoint-N`; once all ranks are done, rank 0 flushes it to disk and renames it into
place (one atomic `rename` on the same file system). So any `OUTPUT/checkpoint-N` is complete, `--resume auto`
can take the newest, and rotation (`save_total_limit`) only ever counts complete ones. `StagedCheckpoints` is
the trainer part that writes them, and makes the final save one consolidated Hugging Face folder. Which checkpoint
a run resumes from and what refuses it are resume.py's; whether a folder's files are whole, checkpoint_damage.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..metrics.memory import plain_tensor
from ..outputs import CHECKPOINT, OWNER, STAGING, SUMMARY
from ..settings.arguments import global_batch_size
from ..settings.experiment import settings
from .checkpoint_damage import TRAINER_STATE

# What a GRPO step is (GRPOConfig's, resolved): completions a prompt, completions sampled at once, micro-batches each
# sampling serves. The same global batch can be cut into other groups, whose prompts, advantages and data order a
# resume would silently change.
GRPO_STEP = ("num_generations", "generation_batch_size", "steps_per_generation")


def step_shape(training) -> dict[str, int]:
    """GRPO's step settings of a run's config (TRL's GRPOConfig), empty for the other tasks' configs."""
    return {key: getattr(training, key) for key in GRPO_STEP if getattr(training, key, None) is not None}


def engine_of(distributed_type: str) -> str:
    """What decides a checkpoint's format: DeepSpeed's, FSDP's, or the Trainer's own (single, DDP)."""
    return distributed_type if distributed_type in ("DEEPSPEED", "FSDP") else "replicated"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """`checkpoint-N` folders of OUTPUT, oldest first (staged ones are not there until complete)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and CHECKPOINT.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT.match(p.name).group(1)))


def staging_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / STAGING


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under root to disk: a rename must not publish data still in page cache."""
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(staged: Path, output_dir: str | Path, owner: dict) -> Path:
    """Rank 0, after every rank finished writing `staged`: record the owner, flush, rename into OUTPUT."""
    (staged / OWNER).write_text(json.dumps(owner, indent=2))
    fsync_tree(staged)
    target = Path(output_dir) / staged.name
    if target.exists():  # the same step saved again (a run resumed from before it): the new one wins
        shutil.rmtree(target)
    os.replace(staged, target)
    fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)
    return target


# ------------------------------------------------------------------------------------ damage, before a resume


# An export's weights as from_pretrained and peft read them: whole, sharded with an index, or an adapter.
EXPORT_FILES = (
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_config.json",
)


def export_files(output_dir: str | Path) -> list[Path]:
    folder = Path(output_dir)
    return sorted({p for pattern in EXPORT_FILES for p in folder.glob(pattern)})


def replace_finished_run(output_dir: str | Path, resuming: bool) -> None:
    """A run started afresh into a folder that holds an earlier run's results (its summary, its exported model):
    said in one warning line, before anything is written. They are replaced as the new run writes its own: its log
    and samples at the first step (start_afresh), its model at the end (replacing_export)."""
    from ..errors import warn

    folder = Path(output_dir)
    found = [p for p in (folder / SUMMARY, *export_files(folder)) if p.is_file()]
    if resuming or not found:
        return
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(max(p.stat().st_mtime for p in found)))
    warn(f"{folder} holds an earlier run's results (written {when}): this run replaces its model, log and "
         "summary; pass another --output_dir to keep them.")  # fmt: skip


def start_afresh(output_dir: str | Path) -> None:
    """A run starting from step 0 (not resumed), on rank 0 once every check has passed: an earlier run's log and
    samples in its folder removed, so that the new run's are its own and not appended to the old ones."""
    from ..metrics.samples import RUN_LOG, SAMPLES_FILE

    for name in (RUN_LOG, SAMPLES_FILE):
        (Path(output_dir) / name).unlink(missing_ok=True)


@contextlib.contextmanager
def replacing_export(output_dir: str | Path, main: bool, merged: bool):
    """Around the final save: an earlier export's weight files that the new one did not rewrite (a whole
    model.safetensors beside a pipeline's shards, an adapter beside a full model, an earlier merged/ folder where
    this run merges none) are removed once it is written (rank 0, `main`), so that from_pretrained, eval,
    generate and push read this run's weights only. Nothing is removed if the save fails."""
    folder = Path(output_dir)
    before = {path: written(path) for path in export_files(folder)} if main else {}
    yield
    for path, stamp in before.items():
        if path.is_file() and written(path) == stamp:
            path.unlink()  # not rewritten by this save: the earlier run's
    if main and not merged and (folder / "merged").is_dir():
        shutil.rmtree(folder / "merged")


def written(path: Path) -> tuple[int, int]:
    """Which write a file's content is from: a save that rewrites it replaces the file or its time."""
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


class StagedCheckpoints:
    """Trainer part: checkpoints staged by every rank and published whole by rank 0, rotated among complete ones,
    each with its owner and the files the trainer adds (the cost so far); the final save one consolidated folder.
    The trainer's `_get_output_dir`, `_save_checkpoint` and `save_model` hand over to it."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.active = False  # a checkpoint is being written: the Trainer's output folder is the staging one

    def owner(self) -> dict:
        """What a checkpoint of this run records about it (check_output_dir and check_resumable compare it)."""
        trainer = self.trainer
        return {
            "recipe": trainer.recipe.recipe_name,
            "model": trainer.recipe.model.model_name_or_path,
            "engine": "PIPELINE" if trainer.pipeline else engine_of(trainer.accelerator.distributed_type.value),
            "pipeline_stages": trainer.pipeline.stages if trainer.pipeline else 1,
            "world_size": trainer.accelerator.num_processes,
            "global_batch_size": global_batch_size(trainer.args),
            **step_shape(trainer.args),  # GRPO's (check_step_shape)
            "settings": settings(trainer.recipe),  # the experiment (resume.check_same_experiment)
        }

    def save(self, write: Callable[[], None], files: dict[str, str]) -> None:
        """`write` (the Trainer's own checkpoint) into OUTPUT/.staging by every rank, then `files` (name: text) added
        and the folder published whole by rank 0."""
        from transformers.trainer_utils import rotate_checkpoints

        args = self.trainer.args
        staged = staging_dir(args.output_dir) / f"checkpoint-{self.trainer.state.global_step}"
        if args.should_save and staged.exists():
            shutil.rmtree(staged)  # left by a save that was killed half-way
        accelerator = self.trainer.accelerator
        accelerator.wait_for_everyone()
        self.active = True
        try:
            write()
        finally:
            self.active = False
        accelerator.wait_for_everyone()  # every rank's shards are on disk
        state = self.trainer.state
        best = self.best(published=[state.global_step])
        if args.should_save:
            for name, text in files.items():
                (staged / name).write_text(text)
            if best is not None:  # the Trainer recorded the staging path: the one a resume reads is the final one
                trainer_state = json.loads((staged / TRAINER_STATE).read_text())
                (staged / TRAINER_STATE).write_text(json.dumps({**trainer_state, "best_model_checkpoint": best},
                                                               indent=2, sort_keys=True) + "\n")  # fmt: skip
            publish(staged, args.output_dir, self.owner())
            # By step, among complete checkpoints only: the newest complete one, and the best, are never deleted.
            rotate_checkpoints(args.output_dir, save_total_limit=args.save_total_limit, best_model_checkpoint=best,
                               use_mtime=False)  # fmt: skip
        accelerator.wait_for_everyone()
        state.best_model_checkpoint = self.best() or state.best_model_checkpoint

    def best(self, published: list[int] = ()) -> str | None:
        """The best checkpoint's folder as published, where the Trainer tracks a best model (it would record the
        staging folder it wrote it to): OUTPUT/checkpoint-<best step>, if that is published (or in `published`)."""
        step = self.trainer.state.best_global_step
        if not step:
            return None
        folder = Path(self.trainer.args.output_dir) / f"checkpoint-{step}"
        return str(folder) if step in published or folder.is_dir() else None

    def gathered_state_dict(self) -> dict | None:
        """For the final save under a sharded FSDP state dict, where the Trainer would write no weights at all: the
        shards gathered into one state dict on rank 0. None where the Trainer's own save is whole."""
        trainer = self.trainer
        plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
        if plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
            return None
        return trainer.accelerator.get_state_dict(trainer.model)  # untied by the trainer's _save


def plain_state_dict(model, state_dict: dict | None) -> dict | None:
    """What a save writes, with weight wrappers unwrapped (plain_tensor): the given state dict, or the model's own
    where it holds wrapped weights (the Trainer would save its state_dict(), wrappers and all; peft's save takes it
    whole and keeps the adapter's part). None where there is nothing to unwrap: the Trainer's own save."""
    if state_dict is None:
        if all(plain_tensor(t) is t for t in model.state_dict().values()):
            return None
        state_dict = model.state_dict()
    return {name: plain_tensor(t) for name, t in state_dict.items()}


def untied(model, state_dict: dict) -> dict:
    """A gathered state dict (FSDP's, DeepSpeed's) without the second name of tied weights (lm_head.weight beside the
    embeddings), as from_pretrained's own checkpoints are: gathered, the two names hold two equal tensors, saved
    twice. The trainer's _save applies it to every state dict it is given."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # {tied name: source name}, transformers 5
    for target, source in tied.items():
        if target in state_dict and source in state_dict and torch.equal(state_dict[target], state_dict[source]):
            del state_dict[target]
    return state_dict
