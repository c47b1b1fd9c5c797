"""Checkpoint folders that are either complete or absent, `--resume auto`, and an output folder's owner.

The Trainer writes `checkpoint-N` in place: a process killed mid-save (a spot preemption, `kill -9`, a full
disk) leaves a folder that looks like the newest checkpoint and cannot be resumed from. Here every rank writes
into `OUTPUT/.staging/checkpoint-N`; once all ranks are done, rank 0 flushes it to disk and renames it into
place (one atomic `rename` on the same file system). So any `OUTPUT/checkpoint-N` is complete, `--resume auto`
can take the newest, and rotation (`save_total_limit`) only ever counts complete ones. `StagedCheckpoints` is
the trainer part that writes them, and makes the final save one consolidated Hugging Face folder.
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

from ..errors import ConfigError
from ..metrics.memory import plain_tensor
from ..outputs import CHECKPOINT, OWNER, STAGING, SUMMARY
from ..settings.arguments import global_batch_size
from ..settings.mesh import data_parallel_replicas, pipeline_stages

TRAINER_STATE = "trainer_state.json"  # the Trainer's, in every checkpoint
# What a GRPO step is (GRPOConfig's, resolved): completions a prompt, completions sampled at once, micro-batches each
# sampling serves. The same global batch can be cut into other groups, whose prompts, advantages and data order a
# resume would silently change.
GRPO_STEP = ("num_generations", "generation_batch_size", "steps_per_generation")


def step_shape(training) -> dict[str, int]:
    """GRPO's step settings of a run's config (TRL's GRPOConfig), empty for the other tasks' configs."""
    return {key: getattr(training, key) for key in GRPO_STEP if getattr(training, key, None) is not None}


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


def json_damage(path: Path) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{path.name} is not JSON"
    return None


def torch_file_damage(path: Path) -> str | None:
    """A torch.save file (a zip archive): present, and its central directory, written last, readable: a file cut
    short by a kill or a full disk fails here in microseconds, without reading its tensors."""
    import zipfile

    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return f"{path.name} is truncated or not a torch file"


def safetensors_damage(path: Path) -> str | None:
    """A safetensors file: its header readable and the file as long as the header says its tensors reach."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_bytes))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, MemoryError, OverflowError):
        return f"{path.name} has no readable safetensors header"
    expected = 8 + header_bytes + end
    return f"{path.name} is truncated ({size:,} of {expected:,} bytes)" if size < expected else None


def dcp_damage(folder: Path) -> str | None:
    """A torch.distributed.checkpoint folder (FSDP's sharded state dicts): its metadata readable and every shard file
    as long as the metadata says its tensors reach."""
    if not folder.is_dir():
        return f"{folder.name}/ is missing"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - a missing or unpicklable .metadata, whatever the error
        return f"{folder.name}/.metadata is missing or unreadable"
    for info in storage.values():
        path = folder / info.relative_path
        if not path.is_file() or path.stat().st_size < info.offset + info.length:
            return f"{folder.name}/{info.relative_path} is missing or truncated"
    return None


def weights_damage(folder: Path, engine: str) -> str | None:
    """The model's weights as the engine checkpoints them: DeepSpeed's global_step folder (named by `latest`), FSDP's
    sharded folder or whole file, the Trainer's safetensors (sharded with an index, or a LoRA adapter)."""
    if engine == "DEEPSPEED":
        latest = folder / "latest"
        if not latest.is_file() or not (folder / latest.read_text().strip()).is_dir():
            return "latest (DeepSpeed's pointer to its global_step folder) or that folder is missing"
        for part in sorted((folder / latest.read_text().strip()).glob("*.pt")):
            if damage := torch_file_damage(part):
                return f"{latest.read_text().strip()}/{damage}"
        return None
    if engine == "FSDP" and (folder / "pytorch_model_fsdp_0").exists():
        return dcp_damage(folder / "pytorch_model_fsdp_0")
    for single in ("model.safetensors", "adapter_model.safetensors"):
        if (folder / single).exists():
            return safetensors_damage(folder / single)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        if damage := json_damage(index):
            return damage
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            if damage := safetensors_damage(folder / shard):
                return damage
        return None
    return "the model's weights are missing (no model.safetensors, adapter or shards)"


def stage_optimizer(folder: str | Path, stage: int) -> Path:
    """A pipeline stage's optimizer state in a checkpoint (training/pipeline.py writes one a stage)."""
    return Path(folder) / f"optimizer-stage{stage}.pt"


def rank_optimizer(folder: str | Path, rank: int) -> Path:
    """A rank's optimizer state in a checkpoint of a model transformers sharded at load (sharded_state.py)."""
    return Path(folder) / f"optimizer-rank{rank}.pt"


def optimizer_damage(folder: Path, engine: str, stages: int = 1, ranks: int = 1) -> str | None:
    """The optimizer's state and the scheduler's, without which a resume would silently start a fresh optimizer
    (DeepSpeed keeps both in its global_step folder, checked with the weights; a pipeline one file a stage; a model
    sharded at load one file a rank)."""
    if engine == "DEEPSPEED":
        return None
    if engine == "FSDP" and (folder / "optimizer_0").exists():
        damage = dcp_damage(folder / "optimizer_0")
    elif engine == "PIPELINE":
        damage = next(filter(None, (torch_file_damage(stage_optimizer(folder, s)) for s in range(stages))), None)
    elif rank_optimizer(folder, 0).exists():
        damage = next(filter(None, (torch_file_damage(rank_optimizer(folder, r)) for r in range(ranks))), None)
    else:
        damage = torch_file_damage(folder / "optimizer.pt")
    return damage or torch_file_damage(folder / "scheduler.pt")


def checkpoint_damage(folder: Path, engine: str, weights_only: bool) -> str | None:
    """Why `folder` cannot be resumed from, or None: a checkpoint is used only when complete and readable. The
    Trainer's state, the toolkit's own files (where the toolkit wrote it), the weights, and unless checkpoints are
    of the weights only (`weights_only`: --save_only_model) the optimizer and scheduler. Cheap: headers, zip
    directories and file sizes, never the tensors."""
    from ..metrics.tracking import SPENT_FILE

    if damage := json_damage(folder / TRAINER_STATE):
        return damage
    toolkit_files = [folder / name for name in (OWNER, SPENT_FILE)]
    if any(p.exists() for p in toolkit_files):
        for path in toolkit_files:
            if damage := json_damage(path):
                return damage
    recorded = json.loads((folder / OWNER).read_text()) if (folder / OWNER).is_file() else {}
    engine = recorded.get("engine", engine)
    stages = recorded.get("pipeline_stages", 1)
    ranks = recorded.get("world_size", 1)
    return weights_damage(folder, engine) or (None if weights_only else optimizer_damage(folder, engine, stages, ranks))


def resume_point(resume: str | None, output_dir: str | Path, engine: str = "replicated",
                 weights_only: bool = False) -> tuple[str | None, str]:  # fmt: skip
    """What to resume from, and a line saying so. `auto`: the newest checkpoint in OUTPUT that is complete and
    readable (checkpoint_damage), the damaged ones after it named and skipped; a run whose every checkpoint is
    damaged is refused rather than started over them. An explicit folder that is damaged: one error line."""
    if not resume:
        return None, ""
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        if not found:
            return None, f"resume auto: no complete checkpoint in {output_dir}, starting fresh"
        skipped = []
        for folder in reversed(found):
            damage = checkpoint_damage(folder, engine, weights_only)
            if damage is None:
                note = "; ".join(f"skipped {name}: {why}" for name, why in skipped)
                return str(folder), f"resume auto: continuing from {folder}" + (f" ({note})" if note else "")
            skipped.append((folder.name, damage))
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise ConfigError(f"resume auto: no checkpoint in {output_dir} can be resumed from ({reasons}). Move them "
                          "away, or pass another --output_dir, to start over.")  # fmt: skip
    folder = Path(resume)
    if not folder.is_dir():
        raise ConfigError(f"Cannot resume from '{resume}': no such folder. Pass --resume auto to take the newest "
                          "complete checkpoint in the output folder.")  # fmt: skip
    if damage := checkpoint_damage(folder, engine, weights_only):
        raise ConfigError(f"Cannot resume from '{resume}': {damage}. Pass --resume auto to take the newest complete "
                          "and readable checkpoint in the output folder, or another checkpoint.")  # fmt: skip
    return resume, f"resuming from {resume}"


def engine_of(distributed_type: str) -> str:
    """What decides a checkpoint's format: DeepSpeed's, FSDP's, or the Trainer's own (single, DDP)."""
    return distributed_type if distributed_type in ("DEEPSPEED", "FSDP") else "replicated"


def check_resumable(checkpoint: str | Path, engine: str, world_size: int, global_batch: int, accumulation: int,
                    owner: dict | None = None, shape: dict[str, int] | None = None) -> str:  # fmt: skip
    """Refuse, before any weights load, a resume that would fail deep in the engine or silently change the
    schedule or what a step is (`shape`: GRPO's, step_shape), or one of another recipe or model (`owner`: this
    run's, as check_output_dir takes it), whose optimizer groups would not match; returns a note when the process
    count changes (supported: the Trainer's and FSDP's formats)."""
    path = Path(checkpoint) / OWNER
    if json_damage(path):  # not written by the toolkit (a damaged record was refused before): its config.json
        from ..models.loading import architecture_difference

        if owner and (difference := architecture_difference(checkpoint, owner["model"])):
            raise ConfigError(f"{checkpoint} holds {difference}: its weights and optimizer states do not fit. Pass the "
                              "--model_name_or_path it was trained from, or resume from a checkpoint of this "
                              "model.")  # fmt: skip
        return ""
    then = json.loads(path.read_text())
    other = [k for k in ("recipe", "model") if owner and k in then and then[k] != owner[k]]
    if other:
        fix = " and ".join({"recipe": f"run recipe {then['recipe']}",
                            "model": f"pass --model_name_or_path {then['model']}"}[k] for k in other)  # fmt: skip
        raise ConfigError(f"{checkpoint} is a checkpoint of recipe {then.get('recipe')} with model "
                          f"{then.get('model')}, and this run is recipe {owner['recipe']} with model {owner['model']}: "
                          f"its weights and optimizer states do not fit. To continue it, {fix}; or resume from a "
                          "checkpoint of this run.")  # fmt: skip
    if "engine" not in then:
        return ""
    if then["engine"] != engine:
        raise ConfigError(f"{checkpoint} was written under {then['engine']} and this launch runs {engine}: the "
                          "formats differ. Resume with a config of the same kind.")  # fmt: skip
    if then["global_batch_size"] != global_batch:
        per_device, rest = divmod(then["global_batch_size"], data_parallel_replicas(world_size) * accumulation)
        fix = f"--per_device_train_batch_size {per_device}" if per_device and not rest else "a matching batch"
        raise ConfigError(f"{checkpoint} was trained with a global batch of {then['global_batch_size']}; this launch "
                          f"has {global_batch}, which would change the data order and the schedule it resumes. "
                          f"Pass {fix} (or change --gradient_accumulation_steps) to continue the same "
                          "run.")  # fmt: skip
    check_step_shape(checkpoint, then, shape or {})
    stages = pipeline_stages()
    if engine == "PIPELINE" and then.get("pipeline_stages", 1) != stages:
        raise ConfigError(f"{checkpoint} holds the optimizer states of {then['pipeline_stages']} pipeline stages and "
                          f"this launch cuts the model into {stages}: resume with parallelism_config_pp_size "
                          f"{then['pipeline_stages']}.")  # fmt: skip
    if then["world_size"] == world_size:
        return ""
    if rank_optimizer(checkpoint, 0).exists():
        raise ConfigError(f"{checkpoint} holds the optimizer shards of a model split over {then['world_size']} "
                          f"processes (tensor or expert parallel) and this launch has {world_size}: resume on "
                          f"{then['world_size']} processes, with the same mesh.")  # fmt: skip
    if engine == "DEEPSPEED":
        step = Path(checkpoint).name.split("-")[-1]
        raise ConfigError(f"{checkpoint} holds ZeRO partitions for {then['world_size']} processes and this launch "
                          f"has {world_size}; DeepSpeed cannot repartition them on load. Resume on "
                          f"{then['world_size']} processes, or convert it to DeepSpeed's universal format: "
                          f"`python -m deepspeed.checkpoint.ds_to_universal --input_folder {checkpoint}/global_step"
                          f"{step} --output_folder {checkpoint}/global_step{step}_universal` and set "
                          '"checkpoint": {"load_universal": true} in the DeepSpeed JSON.')  # fmt: skip
    return (
        f"resuming a {then['world_size']}-process checkpoint on {world_size} process(es), same global batch "
        f"{global_batch}"
    )


def check_step_shape(checkpoint: str | Path, then: dict, shape: dict[str, int]) -> None:
    """GRPO: a resume whose step is cut otherwise (another group size, sampling batch or micro-batches a sampling)
    is refused, naming the setting and the value that continues the run. Only num_generations is a flag; the other
    two follow from the batch settings (TRL's steps_per_generation is gradient_accumulation_steps)."""
    changed = [key for key in GRPO_STEP if key in then and key in shape and then[key] != shape[key]]
    if not changed:
        return
    key = changed[0]
    fix = {"num_generations": f"--num_generations {then[key]}",
           "steps_per_generation": f"--gradient_accumulation_steps {then[key]}"}.get(
        key, f"the batch settings that sample {then[key]} completions at once")  # fmt: skip
    raise ConfigError(f"{checkpoint} was trained with {key} {then[key]}; this launch has {shape[key]}, which would "
                      f"change what a step samples and trains on (its prompts, groups and data order). Pass {fix} "
                      "to continue the same run, or another --output_dir to start a new one.")  # fmt: skip


def check_steps_left(checkpoint: str | Path, steps: int) -> None:
    """A resume with nothing left to train (its checkpoint at or past the run's last step, e.g. --max_steps lowered
    below it) is refused: the Trainer would train a step past it and rewrite the finished run's summary and log."""
    state = json.loads((Path(checkpoint) / TRAINER_STATE).read_text())
    step, planned = state.get("global_step", 0), state.get("max_steps")
    if step >= steps:
        raise ConfigError(f"{checkpoint} is at step {step}, and this run ends at step {steps}: there is nothing left "
                          f"to train. Raise --max_steps (or --num_train_epochs) above {step} to train on from it (on "
                          "a learning-rate schedule for the new length), or pass another --output_dir to train "
                          "afresh.")  # fmt: skip
    if planned and planned != steps:
        from ..errors import warn

        # The Trainer builds the scheduler for this run's length and loads the checkpoint's step into it: the first
        # step keeps the rate the checkpoint ended on, the next jumps to the new schedule's.
        warn(f"{checkpoint} was saved by a run of {planned} steps and this one ends at step {steps}: from step "
             f"{step + 1} the learning rate follows a {steps}-step schedule, not the one it was on (it jumps there); "
             f"--max_steps {planned} continues the run as it was.")  # fmt: skip


def check_output_dir(output_dir: str | Path, owner: dict, resuming: bool) -> None:
    """Refuse, before any weights load, to train into a folder whose checkpoints a new run would mix with or
    rotate away: another recipe's or model's, or this one's when not resuming."""
    found = complete_checkpoints(output_dir)
    if not found:
        return
    newest = found[-1]
    recorded = {}
    if json_damage(newest / OWNER) is None:  # a damaged one names no owner (resume_point says why it is skipped)
        recorded = json.loads((newest / OWNER).read_text())
    mismatch = {k: v for k, v in recorded.items() if k in owner and owner[k] != v}
    if mismatch:
        held = ", ".join(f"{k} {v}" for k, v in recorded.items())
        raise ConfigError(f"{output_dir} holds checkpoints of another run ({held}); this is "
                          f"{', '.join(f'{k} {v}' for k, v in owner.items())}. Pass another --output_dir, or move "
                          "those checkpoints away.")  # fmt: skip
    if not resuming:
        raise ConfigError(f"{output_dir} already holds checkpoints of this recipe (newest: {newest.name}); training "
                          "again from the start would mix with them and rotate them away. Pass --resume auto to "
                          "continue, or another --output_dir to start over.")  # fmt: skip


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
