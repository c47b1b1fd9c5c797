"""A run's checks before it reads its data or loads a weight, as one ordered list: the order is read here, each
entry calls the function of the room whose concern it is. The runner runs them (runner.py); a new task or
strategy adds an entry, not a branch in the runner. Cheapest first, so a bad launch fails in seconds.

  LAUNCH  the settings, the environment and the processes, before the model's config is read; the checkpoint a
          run resumes from is found among them (a resume is refused by what that checkpoint holds)
  MODEL   the model's config.json (a few KB) against the settings: before the tokenizer, the data, the weights
  DATA    the prepared data's rows against the settings: before the weights

Each entry takes the `Launch` (the settings, and what the entries before it found) and refuses with a ConfigError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .distributed.launch import Requested, env_flag
from .distributed.shared_folder import check_agreed, check_shared
from .distributed.strategy import (
    check_4bit_engine,
    check_fp8,
    check_launcher_axes,
    check_mesh_engine,
    check_processes,
    cuda_capability,
)
from .errors import ConfigError
from .metrics.cost import check_device_name
from .metrics.memory import device_memory
from .models.attention import FLEX_ON_CPU
from .models.loading import checkpoint_dtype
from .models.model_checks import check_experts_kernel, check_model_settings, check_sequence_length, check_teacher
from .models.parallel import check_expert_parallel, check_sequence_split, check_split_task, check_tensor_parallel
from .models.pipeline import check_pipeline
from .outputs import check_run_output
from .settings import experiment
from .settings.arguments import Arguments, global_batch_size
from .settings.mesh import launch_mesh, model_parallel_size, pipeline_schedule
from .training import checkpoints, resume
from .training.batch_finder import check_batch_finder


@dataclass
class Launch:
    """What the checks read: the run's settings, the engine its config asked for, and what they find."""

    args: Arguments
    engine: str = field(default_factory=lambda: Requested.from_env().engine)
    config: object = None  # the model's PretrainedConfig, once read (MODEL's entries)
    rows: int = 0  # the training rows, once prepared (DATA's entries)
    train: object = None  # those rows (a Dataset), for what their columns hold (DATA's entries)
    resume: str | None = None  # the checkpoint to resume from, and the line that says so
    note: str = ""

    @property
    def owner(self) -> dict[str, str]:
        """Whose a checkpoint or output folder must be: this recipe's, with this model."""
        return {"recipe": self.args.recipe_name, "model": self.args.model.model_name_or_path}


def qlora_engine(launch: Launch) -> None:
    """QLoRA's 4-bit base under an engine that cannot shard it (distributed/strategy.py)."""
    if launch.args.model.load_in_4bit:
        check_4bit_engine("tensor parallel" if model_parallel_size() > 1 else launch.engine)


def fp8_engine(launch: Launch) -> None:
    """The config's FP8 (the recipe's bf16 would override it) against the engine, the device and the loading."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp8":
        check_fp8(os.environ.get("ACCELERATE_FP8_BACKEND"), launch.args.model.load_in_4bit, cuda_capability(),
                  launch.engine, env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING"))  # fmt: skip


def flex_attention_device(launch: Launch) -> None:
    if launch.args.model.attn_implementation == "flex_attention" and not torch.cuda.is_available():
        raise ConfigError(FLEX_ON_CPU)


def resume_point(launch: Launch) -> None:
    """The checkpoint --resume names (or none), and the output folder: this run's own, a finished run's replaced
    only by a new one (training/resume.py, checkpoints.py)."""
    training = launch.args.training
    launch.resume, launch.note = resume.resume_point(launch.args.run.resume or training.resume_from_checkpoint,
                                                          training.output_dir, launch.engine,
                                                          bool(training.save_only_model))  # fmt: skip
    resume.check_output_dir(training.output_dir, launch.owner, resuming=launch.resume is not None)
    checkpoints.replace_finished_run(training.output_dir, resuming=launch.resume is not None)


def resumable(launch: Launch) -> None:
    """A checkpoint this launch can continue: its engine, processes, batch and step (training/resume.py)."""
    if not launch.resume:
        return
    training = launch.args.training
    changed = resume.check_resumable(launch.resume, Requested.from_env().engine, training.world_size,
                                          global_batch_size(training), training.gradient_accumulation_steps,
                                          launch.owner, checkpoints.step_shape(training))  # fmt: skip
    launch.note = f"{launch.note} ({changed})" if changed else launch.note


def same_experiment(launch: Launch) -> None:
    """`--resume auto` continues only the experiment its folder holds (training/resume.py). Once the data is read:
    a setting that is wrong in itself (bad data, a model setting, one with its own fix) is named first; a
    checkpoint named (`--resume PATH`) is continued on purpose."""
    if launch.resume and launch.args.run.resume == "auto":
        resume.check_same_experiment(launch.resume, experiment.settings(launch.args))


def steps_left(launch: Launch) -> None:
    """A resume with steps left to train, known once the data is (training/resume.py)."""
    if launch.resume:
        from .training.run_plan import planned_steps

        resume.check_steps_left(launch.resume, planned_steps(launch.args.training, launch.rows))


def profile_window(launch: Launch) -> None:
    """--profile's steps within the steps this launch trains, known once the data is (training/profiling.py)."""
    if launch.args.run.profile:
        from .training.checkpoint_damage import TRAINER_STATE
        from .training.profiling import check_profile_window
        from .training.run_plan import planned_steps

        state = json.loads((Path(launch.resume) / TRAINER_STATE).read_text()) if launch.resume else {}
        check_profile_window(launch.args.run.profile, planned_steps(launch.args.training, launch.rows),
                             state.get("global_step", 0))  # fmt: skip


def label_mix(launch: Launch) -> None:
    """kto's training rows hold both labels, desirable and undesirable (data/labelled.py)."""
    from .settings.tasks import task

    if task(launch.args.data.task).labelled and launch.train is not None:
        from .data.labelled import check_label_mix

        check_label_mix(launch.train["label"])


def hub_push(launch: Launch) -> None:
    """--push_to_hub refused now, not after the training, where it cannot work."""
    if launch.args.training.push_to_hub:
        from .results.push import check_push

        check_push(launch.args.training.hub_model_id)


def eval_tasks(launch: Launch) -> None:
    """--eval_after_training's tasks, as `toolkit eval` checks them."""
    args = launch.args
    if args.run.eval_after_training:
        from .results.eval_checks import check_eval_tasks

        check_eval_tasks(args.data.task, args.run.eval_tasks, args.data.eval_split is not None or
                         args.data.eval_fraction > 0)  # fmt: skip


def parallel_plans(launch: Launch) -> None:
    """The mesh's axes against the model: tensor and expert parallel plans, the sequence split, pipeline stages."""
    args, config, mesh, world = launch.args, launch.config, launch_mesh(), launch.args.training.world_size
    lora = args.model.lora_settings()
    check_tensor_parallel(config, mesh, world, lora["target_modules"] if lora else None, args.data.task)
    check_expert_parallel(config, mesh, world, args.model.use_lora)
    check_sequence_split(config, mesh, args, on_gpu=torch.cuda.is_available(), world_size=world)
    check_pipeline(config, mesh, args.data.task, world_size=world, load_in_4bit=args.model.load_in_4bit,
                   schedule=pipeline_schedule(), micro_batches=args.training.gradient_accumulation_steps,
                   fp16=args.training.fp16)  # fmt: skip


def image_parts(launch: Launch) -> None:
    """Which parts of an image-text model train (--train_parts), where the whole model trains (models/vision.py)."""
    from .settings.tasks import task

    if task(launch.args.data.task).images and not launch.args.model.use_lora:
        from .models.vision import check_parts

        check_parts(launch.args.model.train_parts)


def continuous_sampler(launch: Launch) -> None:
    """grpo, rloo --sampler continuous: TRL casts the model itself to the run's 16-bit dtype before it samples
    (GRPOTrainer's continuous-batching path), so weights that load in fp32 under --bf16 would train on in bf16."""
    from .settings.tasks import task

    args = launch.args
    if (
        not task(args.data.task).samples_online
        or args.policy.sampler != "continuous"
        or not (args.training.bf16 or args.training.fp16)
    ):
        return
    wanted = torch.bfloat16 if args.training.bf16 else torch.float16
    loaded = checkpoint_dtype(args.model.dtype, launch.config)
    if loaded != wanted:
        name = str(wanted).removeprefix("torch.")
        raise ConfigError(f"--sampler continuous: TRL casts the model to {name} before it samples, and its weights "
                          f"load as {str(loaded).removeprefix('torch.')}: it would train on in {name}. Pass --dtype "
                          f"{name} (the optimizer keeps fp32 masters) or --sampler generate.")  # fmt: skip


Check = Callable[[Launch], None]
LAUNCH: tuple[Check, ...] = (
    lambda launch: check_run_output(launch.args.training.output_dir),  # outputs.py: where it writes, first
    lambda launch: check_device_name(launch.args.run.gpu_type, launch.args.run.hourly_usd),  # metrics/cost.py
    lambda launch: check_launcher_axes(launch.args.training.world_size),  # distributed/strategy.py
    lambda launch: check_mesh_engine(launch_mesh(), launch.engine, int(os.environ.get("FSDP_VERSION") or 1)),
    lambda launch: check_split_task(launch_mesh(), launch.args.data.task),  # models/parallel.py
    qlora_engine,  # distributed/strategy.py
    fp8_engine,  # distributed/strategy.py
    flex_attention_device,  # models/attention.py
    lambda launch: check_processes(launch.args.training.world_size),  # distributed/strategy.py: the process group
    lambda launch: check_shared(launch.args.training.output_dir),  # distributed/shared_folder.py: every node's
    resume_point,  # training/resume.py
    lambda launch: check_agreed(launch.resume, launch.args.training.output_dir),  # distributed/shared_folder.py
    resumable,  # training/resume.py
    lambda launch: check_batch_finder(launch.args, launch.engine),  # training/batch_finder.py
    hub_push,  # results/push.py
    eval_tasks,  # results/eval_checks.py
)
MODEL: tuple[Check, ...] = (
    lambda launch: check_model_settings(launch.config, launch.args.model, launch.args.data.task),  # models/model_checks
    lambda launch: check_teacher(launch.config, launch.args.model, launch.args.data.task),  # models/model_checks
    lambda launch: check_sequence_length(launch.config, launch.args.data.max_seq_length),  # models/model_checks
    lambda launch: check_experts_kernel(launch.config, launch.args, device_memory()),  # models/model_checks
    parallel_plans,  # models/parallel.py, models/pipeline.py
    image_parts,  # models/vision.py
    continuous_sampler,  # settings/policy.py's sampler, TRL's cast
)


DATA: tuple[Check, ...] = (
    same_experiment,  # training/resume.py: before the steps left, whose fix would continue another experiment
    steps_left,  # training/resume.py
    profile_window,  # training/profiling.py
    label_mix,  # data/labelled.py
)


def run_checks(checks: tuple[Check, ...], launch: Launch) -> Launch:
    """Each check in order; the first refusal raises."""
    for check in checks:
        check(launch)
    return launch
