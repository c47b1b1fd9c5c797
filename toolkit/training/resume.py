"""Which checkpoint a run resumes from (`--resume auto`, a path) and what refuses it before any weights load: its
damage (checkpoint_damage.py), another recipe or model, another engine, batch, GRPO step or pipeline cut, a
process count its format cannot be resharded to, no steps left; and an output folder of another run."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..outputs import OWNER
from ..settings.experiment import differences
from ..settings.mesh import data_parallel_replicas, pipeline_stages
from .checkpoint_damage import TRAINER_STATE, checkpoint_damage, json_damage, rank_optimizer
from .checkpoints import GRPO_STEP, complete_checkpoints


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


def check_same_experiment(checkpoint: str | Path, now: dict[str, object]) -> None:
    """`--resume auto` refused into a checkpoint of another experiment (settings/experiment.py): a job file
    resubmitted with a new learning rate, data set or LoRA rank would silently continue the old run."""
    path = Path(checkpoint) / OWNER
    then = {} if json_damage(path) else json.loads(path.read_text()).get("settings", {})
    if changed := differences(then, now):
        raise ConfigError(f"resume auto: {Path(checkpoint).parent} holds a run with other settings "
                          f"({', '.join(changed)}): continuing it would mix two experiments. Pass another "
                          "--output_dir (--job_name under `toolkit launch --on kubernetes`) to start this one, the "
                          "run's settings to continue it, or --resume "
                          f"{checkpoint} to continue it with these on purpose.")  # fmt: skip


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
        held = ", ".join(f"{k} {recorded.get(k)}" for k in owner)
        raise ConfigError(f"{output_dir} holds checkpoints of another run ({held}); this is "
                          f"{', '.join(f'{k} {v}' for k, v in owner.items())}. Pass another --output_dir, or move "
                          "those checkpoints away.")  # fmt: skip
    if not resuming:
        raise ConfigError(f"{output_dir} already holds checkpoints of this recipe (newest: {newest.name}); training "
                          "again from the start would mix with them and rotate them away. Pass --resume auto to "
                          "continue, or another --output_dir to start over.")  # fmt: skip
