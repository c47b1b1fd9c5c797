"""The recipe runner: a recipe goes through the rooms in order, each entered once, then trains, evaluates, saves.

    settings   parse            the recipe, its overrides and flags, each checked             settings/
    launch     checked_launch   checks.py's LAUNCH: the processes asked for, the resume point    checks.py
    model      checked_blueprint  config, checks.py's MODEL, tokenizer, packing, attention      models/
    data       prepare_data     read, checked, tokenized, packed (cached)                     data/
    plan       plan_workload    the workload; the activations measured before weights load    planner/
    rewards    reward_parts     grpo's/rloo's rewards, each called once on the first prompts  training/rl.py
    model      load_for_training  the weights, LoRA                                           models/
    trainer    build_trainer    RecipeTrainer (or DPO's) with the toolkit's parts             training/
    run        fit              train, evaluate, save the consolidated (and merged) model     training/

Cheap checks run first (arguments, process group, Hub reachability, the model's config), so a bad launch fails in
seconds, before any data is tokenized or weights are loaded: their order is one list, in checks.py.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import set_seed

from .checks import DATA, LAUNCH, MODEL, Launch, run_checks
from .data.preparation import PreparedData, prepare_data
from .distributed import liveness, op_builds, patches
from .distributed.launch import (
    Requested,
    is_local_main_process,
    receives_weights_from_rank0,
    tell_deepspeed_the_local_processes,
    weights_arrive_upcast,
)
from .distributed.strategy import (
    resolve_config_paths,
)
from .errors import PREEMPTED, ConfigError, ToolkitError, command, report, say_preempted
from .metrics.samples import side_by_side
from .metrics.wandb_run import finish_run, redact_argv
from .models.attention import pad_multiple
from .models.loading import Blueprint, LoadedModel, blueprint, checkpoint_dtype, load_config, load_for_training
from .models.lora import save_merged
from .models.parallel import accelerator_parallelism
from .models.tiny import tiny_layer
from .planner.compiled import planned_activations
from .planner.estimate import workload_for
from .planner.workload import Workload
from .project import is_recipe, load_recipe, recipe_name, recipe_names
from .results.card import write_card
from .settings.arguments import Arguments
from .settings.compile import choose_compile, set_compile
from .settings.mesh import launch_mesh, model_parallel_size, pipeline_stages, split_multiple
from .settings.parser import parse
from .settings.tasks import task
from .training import checkpoints
from .training.batch_finder import find_micro_batch
from .training.evaluation import metrics_for
from .training.stopping import Stopped
from .training.trainer import RecipeTrainer


@dataclass
class RunResult:
    trainer: RecipeTrainer
    metrics: dict[str, float]


def train(recipe: dict[str, Any], argv: list[str] | None = None, name: str | None = None) -> RunResult:
    """Run a recipe; returns the trainer and the final metrics. Raises a ToolkitError on bad input, and a
    Stopped when training stopped early (preempted, diverged, out of budget; its checkpoints intact)."""
    prepare_process()
    args = parse(recipe, name or Path(sys.argv[0]).stem, argv, tiny_defaults=tiny_layer, here=True)
    resume, resume_note = checked_launch(args)
    liveness.start()  # a node lost in silence ends the run, named (distributed/liveness.py)
    model_plan = checked_blueprint(args)
    resolve_compile(args)
    data = prepare_data(args, model_plan.tokenizer, model_plan.packing, padding_multiple(args), model_plan.processor)
    run_checks(DATA, Launch(args, resume=resume, rows=len(data.train), train=data.train))  # known once the data is
    rewards = reward_parts(args, data, model_plan.tokenizer)  # checked first: the plan reads a reward model's config
    work = plan_workload(args, model_plan)
    mixed = args.training.bf16 or args.training.fp16
    loaded = load_for_training(args, model_plan, data.label_names, on_meta=receives_weights_from_rank0(),
                               upcast_placeholders=weights_arrive_upcast(mixed))  # fmt: skip
    if args.batch_rows:  # --per_device_train_batch_size auto: probed on the loaded model, before the trainer
        find_micro_batch(args, loaded.model, data.train, data.collator, work)
    trainer = build_trainer(args, loaded, data, work, rewards)
    if resume_note and trainer.is_world_process_zero():
        print(resume_note, flush=True)
    return RunResult(trainer, fit(trainer, args, data, resume))


def prepare_process() -> None:
    """Before anything builds accelerate's state: DeepSpeed's config found from any folder, the processes on this
    node told to DeepSpeed as its own launcher tells them, its ops built in (or
    loaded from) this environment's folder, build locks left by a killed build cleared (before DeepSpeed builds its
    first op), the patches this launch needs installed."""
    resolve_config_paths()
    tell_deepspeed_the_local_processes()
    op_builds.use_environment_folder()
    if is_local_main_process():
        op_builds.clear_stale_locks()
    patches.apply()


def checked_launch(args: Arguments) -> tuple[str | None, str]:
    """The launch's checks (checks.py's LAUNCH, in order), then what they let it settle: the config's FP8, the one
    push of the finished model, the seed. Returns the checkpoint to resume from, and a line saying so."""
    redact_argv(sys.argv)  # parsed: no credential needs to stay where loggers read the command line
    launch = run_checks(LAUNCH, Launch(args))
    training = args.training
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp8":  # the config's; the recipe's bf16 would override it
        training.mixed_precision = "fp8"
        if launch.engine != "FSDP":  # torchao's float8 all-gather wrapper is FSDP2's; elsewhere it only swaps each
            # float8 layer's Parameter for a new one, which an optimizer made before accelerate converts never sees
            os.environ["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] = "false"
    if training.push_to_hub:
        private = True if training.hub_private_repo is None else bool(training.hub_private_repo)
        args.hub_push = (training.hub_model_id, private, training.hub_revision)
        training.push_to_hub = False  # one push, of the finished model: the Trainer's would push every save
    set_seed(training.seed)
    return launch.resume, launch.note


def checked_blueprint(args: Arguments) -> Blueprint:
    """The model's config, checked against the settings (checks.py's MODEL, in order), then its blueprint."""
    config = load_config(args.model)
    run_checks(MODEL, Launch(args, config=config))
    return blueprint(args, config)


def padding_multiple(args: Arguments, on_gpu: bool | None = None) -> int | None:
    """What every batch's width is a multiple of: the attention kernel's and the sequence split's needs together.
    Under DeepSpeed's Ulysses on a CPU every row is max_seq_length: its loader all-gathers the ranks' batches,
    which NCCL does at any sizes and gloo only at equal ones ("ProcessGroupGloo::allgather: invalid tensor size").
    Under pipeline stages every row is max_seq_length: a schedule's stages exchange the shapes of its first step."""
    split = split_multiple()
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if (split and launch_mesh().get("sp", 1) > 1 and not on_gpu) or pipeline_stages() > 1:
        split = args.data.max_seq_length  # a multiple of sp (models/parallel.py checks it)
    needs = [m for m in (pad_multiple(args.model.attn_implementation), split) if m]
    return math.lcm(*needs) if needs else None


def resolve_compile(args: Arguments) -> None:
    """--torch_compile auto, once the strategy and the attention kernel are known (settings/compile.py)."""
    training = args.training
    on, args.compile_note = choose_compile(
        args.torch_compile, fp8=getattr(training, "mixed_precision", None) == "fp8", on_gpu=torch.cuda.is_available(),
        processes=training.world_size, replicated=Requested.from_env().engine == "replicated" and
        model_parallel_size() == 1, lora=args.model.use_lora, attention=args.model.attn_implementation,
        liger=bool(training.use_liger_kernel))  # fmt: skip
    set_compile(training, on)


def plan_workload(args: Arguments, model_plan: Blueprint) -> Workload:
    """The run's workload, its activation fit measured (into the cache) before the weights load, not within the
    loading footprint the rank reports record."""
    work = workload_for(args, checkpoint_dtype(args.model.dtype, model_plan.config), on_gpu=torch.cuda.is_available())
    planned_activations(
        model_plan.config,
        args.data.task,
        work.precision,
        work.flash_attention,
        work.fused_head,
        args.model.lora_settings(),
        args.training.bf16 or args.training.fp16,
        bool(args.training.torch_compile),
        getattr(args.training, "mixed_precision", None) == "fp8",
    )
    return work


def reward_parts(args: Arguments, data: PreparedData, tokenizer) -> dict[str, Any]:
    """grpo's and rloo's rewards, each called once on the first prompts before any weights load (training/rl.py)."""
    if not task(args.data.task).samples_online:
        return {}
    from .training.rl import online_parts

    return online_parts(args, data.train, tokenizer)


def build_trainer(args: Arguments, loaded: LoadedModel, data: PreparedData, work: Workload,
                  rewards: dict[str, Any]) -> RecipeTrainer:  # fmt: skip
    """The task's trainer with the toolkit's parts: RecipeTrainer, or TRL's DPOTrainer or KTOTrainer (its own
    collator and metrics, and a frozen reference model), GRPOTrainer or RLOOTrainer (the rewards; they sample their
    own batches) or RewardTrainer (its own collator and metrics)."""
    if (parallelism := accelerator_parallelism(launch_mesh())) is not None:
        args.training.parallelism_config = parallelism
    if task(args.data.task).pairs and (multiple := pad_multiple(args.model.attn_implementation)):
        args.training.pad_to_multiple_of = multiple  # TRL's collator of pairs pads to it
    if args.data.task == "dpo":
        from .training.preference import RecipeDPOTrainer, reference_model

        trainer_class, task_parts = RecipeDPOTrainer, {"ref_model": reference_model(args, loaded.tokenizer)}
    elif args.data.task == "kto":
        from .training.kto import RecipeKTOTrainer
        from .training.preference import reference_model

        trainer_class, task_parts = RecipeKTOTrainer, {"ref_model": reference_model(args, loaded.tokenizer)}
    elif task(args.data.task).teacher:
        from .training.distill import RecipeDistillationTrainer, teacher_model

        teacher = teacher_model(args, loaded.tokenizer)
        trainer_class, task_parts = RecipeDistillationTrainer, {**rewards, "teacher_model": teacher}
    elif task(args.data.task).samples_online:
        from .training.rl import trainer_class as online_trainer

        trainer_class, task_parts = online_trainer(args.data.task), rewards
    elif args.data.task == "reward":
        from .training.reward import RecipeRewardTrainer

        trainer_class, task_parts = RecipeRewardTrainer, {}
    else:
        compute_metrics, preprocess_logits = metrics_for(args.data.task, data.packed)
        trainer_class, task_parts = RecipeTrainer, dict(data_collator=data.collator, compute_metrics=compute_metrics,
                                                        preprocess_logits_for_metrics=preprocess_logits,
                                                        fused_loss=work.fused_head)  # fmt: skip
    return trainer_class(model=loaded.model, args=args.training, train_dataset=data.train, eval_dataset=data.eval,
                         processing_class=loaded.processor or loaded.tokenizer, **task_parts, arguments=args,
                         param_counts=loaded.counts, load=loaded.load, prompts=data.prompts, data_note=data.note,
                         data_summary=data.summary())  # fmt: skip


def fit(trainer: RecipeTrainer, args: Arguments, data: PreparedData, resume: str | None) -> dict[str, float]:
    """Train (or raise the `Stopped` that ended it early), evaluate, save the consolidated model (and the merged LoRA
    one), write the summary, close the W&B run."""
    try:
        result = trainer.train(resume_from_checkpoint=resume)
        trainer.raise_if_stopped()
        training = args.training
        metrics = dict(result.metrics)
        if data.eval is not None and task(args.data.task).evaluates_at_end:
            evaluation = trainer.evaluate()
            metrics.update(evaluation)
            if trainer.is_world_process_zero() and "eval_accuracy" in evaluation:
                print(f"eval accuracy {evaluation['eval_accuracy']:.4f} on {len(data.eval)} held-out examples")
        merged = args.model.use_lora and args.model.merge_lora
        with checkpoints.replacing_export(training.output_dir, trainer.is_world_process_zero(), merged):
            trainer.save_model(training.output_dir)
        if trainer.is_world_process_zero():
            if data.prompts:
                print(side_by_side(training.output_dir))
            print(f"saved to {training.output_dir}")
            if merged:
                print(f"merged model saved to {save_merged(training.output_dir, args.data.task, args.model.dtype)}")
        trainer.end_of_run("completed", metrics)
        finish_run()
        if trainer.is_world_process_zero():
            write_card(training.output_dir)  # README.md: the run's model card, its figures from the files above
    finally:
        trainer.safe_stop.uninstall()
    return metrics


def after_training(args: Arguments) -> None:
    """What follows a finished run, on its first process once the others have left (they would wait on it at a
    barrier): the evaluation against the base model (--eval_after_training), the card again with its table, the
    push (--push_to_hub). The training is saved before either starts: a failure here loses nothing."""
    output = args.training.output_dir
    if args.run.eval_after_training:
        from .results.evaluation import evaluate_run, table

        print(table(evaluate_run(output, args.run.eval_tasks, args.run.eval_limit)), flush=True)
        write_card(output)
    if args.hub_push is not None:
        from .results.push import push

        repo, private, revision = args.hub_push
        print(f"pushed {output} to {repo}: {push(output, repo, private, revision)}", flush=True)


@command
def prepare_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit prepare RECIPE [flags]`: tokenize (and pack) a recipe's data ahead of a launch, on any
    machine; the launch, with the same recipe and flags, then finds it in the cache and tokenizes nothing."""
    if not argv or argv[0].startswith("-"):
        raise ConfigError(f"python -m toolkit prepare RECIPE [flags]: name a recipe ({', '.join(recipe_names())}).")
    argv = [recipe_name(argv[0]), *argv[1:]]  # recipes/llama3_fft.py, as a launch names it
    if not is_recipe(argv[0]):
        raise ConfigError(f"No recipe '{argv[0]}' in recipes/. Known: {', '.join(recipe_names())}.")
    args = parse(load_recipe(argv[0]), argv[0], argv[1:], tiny_defaults=tiny_layer)
    model_plan = checked_blueprint(args)
    data = prepare_data(args, model_plan.tokenizer, model_plan.packing, processor=model_plan.processor)
    rows = f"{len(data.train):,} training rows" + (f", {len(data.eval):,} held out" if data.eval is not None else "")
    print(f"{argv[0]}: {rows}{' (packed)' if model_plan.packing else ''} from {data.note}")
    return 0


def after_run(args: Arguments) -> int:
    """after_training, its refusals one line and an exit code (the run's own files stay as they are)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        after_training(args)
    except ToolkitError as error:
        return report(error)
    return 0


def run(recipe: dict[str, Any], argv: list[str] | None = None, name: str | None = None) -> None:
    """Entry point of a recipe script: one line for bad input or an early stop, its exit code, a clean
    distributed exit."""
    code, distributed, finished = 0, False, None
    # A group set up before the recipe ran is its host's (a Ray Train worker's), which tears it down and keeps its
    # process: the run then returns (or raises SystemExit) instead of leaving the group and the process.
    hosted = dist.is_available() and dist.is_initialized()
    try:
        finished = train(recipe, argv, name)
    except ToolkitError as error:
        code = report(error)
    except Stopped as stop:
        code = report(stop, stop.label) if stop.label else stop.exit_code
        if code == PREEMPTED:
            say_preempted()
    else:
        if dist.is_available() and dist.is_initialized():
            # Rank 0 may still be saving: a rank that tears the group down early can abort its process
            # ("terminate called without an active exception"), failing a run that had succeeded.
            dist.barrier()
    finally:
        liveness.stop()
        if dist.is_available() and dist.is_initialized() and not hosted:
            distributed = True
            dist.destroy_process_group()  # every rank leaves the group cleanly, whatever happened
    if finished is not None and finished.trainer.is_world_process_zero():
        arguments = finished.trainer.recipe
        del finished  # the trainer, its model and optimizer: the evaluation loads models of its own
        code = code or after_run(arguments)
    if distributed:
        # Everything is written and the group is gone: leave without the interpreter's teardown. A rank has been
        # seen to abort after a run that had succeeded ("terminate called without an active exception", gloo,
        # once in about 70 launches on a busy 2-core machine), and the launcher then fails the whole job.
        finish_run()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
