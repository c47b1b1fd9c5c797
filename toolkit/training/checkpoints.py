"""Checkpoint folders that are either complete or absent, `--resume auto`, and an output folder's owner.

The Trainer writes `checkpoint-N` in place: a process killed mid-save (a spot preemption, `kill -9`, a full
disk) leaves a folder that looks like the newest checkpoint and cannot be resumed from. Here every rank writes
into `OUTPUT/.staging/checkpoint-N`; once all ranks are done, rank 0 waits until it sees every rank's files there
with their sizes, then publishes it (publishing.py): flushed, renamed into place, and the marker last, the owner
record (`toolkit_run.json`) listing every file of the checkpoint and its size. A checkpoint is trusted only with
its marker and every file it lists (checkpoint_damage.py), so `--resume auto` can take the newest trusted one, and
rotation (`save_total_limit`) only ever counts published ones. `StagedCheckpoints` is the trainer part that writes
them, and makes the final save one consolidated Hugging Face folder. Which checkpoint a run resumes from and what
refuses it are resume.py's; whether a folder's files are whole, checkpoint_damage.py's.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..metrics.memory import plain_tensor
from ..outputs import CHECKPOINT, STAGING, SUMMARY
from ..settings.arguments import global_batch_size
from ..settings.experiment import settings
from .checkpoint_damage import TRAINER_STATE
from .publishing import POLL_S, VISIBLE_WITHIN_S, changed, listing, not_visible, publish, size_of

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
    """A run starting from step 0 (not resumed), on rank 0 once every check has passed: an earlier run's log,
    samples and episodes in its folder removed, so that the new run's are its own and not appended to the old
    ones."""
    from ..metrics.samples import EPISODES_FILE, RUN_LOG, SAMPLES_FILE

    for name in (RUN_LOG, SAMPLES_FILE, EPISODES_FILE):
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
    """Trainer part: checkpoints staged by every rank and published by rank 0 once it sees every rank's files, the
    marker (its owner, with every file and its size) last; rotated among complete ones, each with the files the
    trainer adds (the cost so far); the final save one consolidated folder. The trainer's `_get_output_dir`,
    `_save_checkpoint` and `save_model` hand over to it."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.active = False  # a checkpoint is being written: the Trainer's output folder is the staging one
        self.group = None  # the gloo group the saves' file lists travel on (host_group)

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
        """`write` (the Trainer's own checkpoint) into OUTPUT/.staging by every rank, then, once rank 0 sees every
        rank's files there, `files` (name: text) added and the folder published by rank 0, the marker last."""
        from transformers.trainer_utils import rotate_checkpoints

        args = self.trainer.args
        staged = staging_dir(args.output_dir) / f"checkpoint-{self.trainer.state.global_step}"
        if args.should_save and staged.exists():
            shutil.rmtree(staged)  # left by a save that was killed half-way
        # Each node's first rank reports what its node's ranks wrote, as its node sees it (a bucket mount's cache is
        # the node's): the files new or rewritten in its view since before anyone wrote.
        reporter = args.local_process_index == 0
        before = listing(staged) if reporter else {}
        accelerator = self.trainer.accelerator
        accelerator.wait_for_everyone()
        self.active = True
        try:
            write()
        finally:
            self.active = False
        accelerator.wait_for_everyone()  # every rank's files written (on its own node's view at least)
        expected: dict[str, int] = {}
        for wrote in self.gathered(changed(before, listing(staged)) if reporter else {}):
            for name, size in wrote.items():
                expected[name] = max(size, expected.get(name, 0))  # a stale view of another node's file: smaller
        self.await_files(staged, expected)
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

    def await_files(self, staged: Path, expected: dict[str, int]) -> None:
        """Rank 0 waits until every file the nodes wrote (`expected`, path -> size) is in its own view of `staged`
        with that size; every rank hears its word at each look (one broadcast: a rank lost meanwhile fails it at once,
        rather than rank 0 waiting alone), and all raise the same error where a file never shows within
        VISIBLE_WITHIN_S of the last one that did. On a local disk or NFS everything is there at the first look.

        Rank 0's own files are in its view as soon as written, before a bucket mount has uploaded them: they pass at
        once and may reach the bucket after the marker. That is still safe: the marker lists each with its size, and
        a fresh mount (a relaunch's) that lacks one or holds it short finds the checkpoint damaged
        (checkpoint_damage.manifest_damage), so --resume auto takes the one before."""
        main = self.trainer.is_world_process_zero()
        waiting, since = dict(expected), time.monotonic()
        while True:
            word = None
            if main:
                seen = [name for name, size in waiting.items() if size_of(staged / name) == size]
                for name in seen:
                    del waiting[name]
                now = time.monotonic()
                since = now if seen else since
                word = "wait" if waiting else "done"
                if waiting and now - since > VISIBLE_WITHIN_S:
                    word = not_visible(staged, waiting, now - since)
            word = self.told(word)
            if word == "done":
                return
            if word != "wait":
                raise ConfigError(word)
            if main:
                time.sleep(POLL_S)

    def host_group(self):
        """A gloo group over every rank (the run's own where it is gloo), made once, at the first save, by every
        rank: the file lists and rank 0's word are host-side, whatever the run's backend."""
        if self.group is None:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        return self.group

    def gathered(self, value: object) -> list:
        """Every rank's `value` (this one's alone without a process group)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [value]
        values: list = [None] * dist.get_world_size()
        dist.all_gather_object(values, value, group=self.host_group())
        return values

    def told(self, value: object) -> object:
        """Rank 0's `value`, on every rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.host_group())
        return box[0]

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
