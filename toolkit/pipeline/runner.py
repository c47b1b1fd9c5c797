"""The recipe runner: arguments -> checks -> tokenizer -> data -> model -> RecipeTrainer -> train, evaluate, save.

Cheap checks run first (arguments, process group, Hub reachability), so a bad launch fails in seconds,
before any weights are loaded.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import set_seed

from ..distributed import op_builds, patches
from ..distributed.launch import Requested, is_local_main_process
from ..distributed.strategy import check_4bit_engine, check_processes, resolve_config_paths, set_fsdp_wrap_class
from ..errors import ConfigError, ToolkitError, command, report
from ..metrics.cost import check_device_name
from ..metrics.evaluation import metrics_for
from ..metrics.memory import HostMemoryPeak
from ..metrics.rank_reports import LoadRecord
from ..metrics.samples import held_out_prompts, side_by_side
from ..metrics.wandb_run import finish_run, redact_argv
from ..planner.activations import measured_activations
from ..planner.estimate import workload_for
from ..project import is_recipe, load_recipe, recipe_names
from . import checkpoints, tiny
from .arguments import Arguments, global_batch_size
from .data import load_data, prepare
from .models import (
    FLEX_ON_CPU,
    ParameterCounts,
    add_lora,
    allocate_placeholders,
    check_model_settings,
    check_sequence_length,
    checkpoint_dtype,
    choose_attention,
    load_config,
    load_model,
    load_tokenizer,
    save_merged,
)
from .packing import use_packing
from .parser import parse
from .stopping import Stopped
from .tasks import task
from .trainer import RecipeTrainer


def tiny_layer(values: dict[str, Any]) -> dict[str, Any]:
    task(values["task"])  # an unknown task is named as such, before tiny mode builds anything for it
    return tiny.tiny_training_defaults(values["task"], values["model_name_or_path"])


@dataclass
class RunResult:
    trainer: RecipeTrainer
    metrics: dict[str, float]


def prepared(args: Arguments):
    """The model's config, its tokenizer, the raw and the prepared data, whether packing: a run's steps up to
    the weights, shared with `python -m toolkit prepare`. Checks the model's settings before any data loads."""
    config = load_config(args.model)
    check_model_settings(config, args.model, args.data.task)
    check_sequence_length(config, args.data.max_seq_length)
    packing = use_packing(args.data.task, args.data.packing, config)
    # --attn_implementation auto becomes the kernel it picks, here where packing is known
    m = args.model
    m.attn_implementation, m.attention_note = choose_attention(config, m.attn_implementation, args.data.task,
                                                               packing, on_gpu=torch.cuda.is_available())  # fmt: skip
    tokenizer = load_tokenizer(args.model)
    raw, read = load_data(args.data)
    data = prepare(raw, tokenizer, args.data, args.training.main_process_first, packing)
    data.note = "; ".join(filter(None, [read, data.note]))
    return config, tokenizer, raw, data, packing


@command
def prepare_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit prepare RECIPE [flags]`: tokenize (and pack) a recipe's data ahead of a launch, on any
    machine; the launch, with the same recipe and flags, then finds it in the cache and tokenizes nothing."""
    if not argv or argv[0].startswith("-"):
        raise ConfigError(f"python -m toolkit prepare RECIPE [flags]: name a recipe ({', '.join(recipe_names())}).")
    if not is_recipe(argv[0]):
        raise ConfigError(f"No recipe '{argv[0]}' in recipes/. Known: {', '.join(recipe_names())}.")
    args = parse(load_recipe(argv[0]), argv[0], argv[1:], tiny_defaults=tiny_layer)
    _, _, _, data, packing = prepared(args)
    rows = f"{len(data.train):,} training rows" + (f", {len(data.eval):,} held out" if data.eval is not None else "")
    print(f"{argv[0]}: {rows}{' (packed)' if packing else ''} from {data.note}")
    return 0


def train(recipe: dict[str, Any], argv: list[str] | None = None, name: str | None = None) -> RunResult:
    """Run a recipe; returns the trainer and the final metrics. Raises a ToolkitError on bad input, and a
    Stopped when training stopped early (preempted, diverged, out of budget; its checkpoints intact)."""
    name = name or Path(sys.argv[0]).stem
    resolve_config_paths()
    if is_local_main_process():
        op_builds.clear_stale_locks()  # before DeepSpeed builds its first op (shm comm, at process-group set-up)
    patches.apply()  # before the Trainer builds its accelerator (distributed/patches)
    args = parse(recipe, name, argv, tiny_defaults=tiny_layer)
    redact_argv(sys.argv)  # parsed: no credential needs to stay where loggers read the command line
    check_device_name(args.run.gpu_type, args.run.hourly_usd)
    if args.model.load_in_4bit:
        check_4bit_engine(Requested.from_env().engine)
    if args.model.attn_implementation == "flex_attention" and not torch.cuda.is_available():
        raise ConfigError(FLEX_ON_CPU)
    training = args.training
    resume, resume_note = checkpoints.resume_point(args.run.resume or training.resume_from_checkpoint,
                                                   training.output_dir)  # fmt: skip
    owner = {"recipe": args.recipe_name, "model": args.model.model_name_or_path}
    checkpoints.check_output_dir(training.output_dir, owner, resuming=resume is not None)
    check_processes(training.world_size)  # creating the process group happens on first access of the device
    if resume:
        note = checkpoints.check_resumable(resume, Requested.from_env().engine, training.world_size,
                                           global_batch_size(training),
                                           training.gradient_accumulation_steps)  # fmt: skip
        resume_note = f"{resume_note} ({note})" if note else resume_note
    set_seed(training.seed)

    config, tokenizer, raw, data, packing = prepared(args)
    prompts = []  # --generation_samples: held-out conversations cut before their last answer
    if args.run.generation_samples:
        if args.data.messages_column not in raw["eval"].column_names:
            raise ConfigError("generation_samples answers held-out conversations: this data set has none (it is "
                              "prompt/completion or text): drop generation_samples.")  # fmt: skip
        prompts = held_out_prompts(raw["eval"].select(range(min(len(raw["eval"]), 8 * args.run.generation_samples)))
                                   [args.data.messages_column], args.run.generation_samples)  # fmt: skip
    # The activation fit the run's plan uses, measured (into the cache) before the weights load, not within the
    # loading footprint the rank reports record.
    work = workload_for(args, checkpoint_dtype(args.model.dtype, config), on_gpu=torch.cuda.is_available())
    measured_activations(config, args.data.task, work.precision, work.flash_attention, work.fused_head)
    load = LoadRecord(memory=HostMemoryPeak() if args.run.record_rank_reports else None)  # until the first step
    model = load_model(args.model, args.data.task, tokenizer, data.label_names)
    load.param_bytes = ParameterCounts.of(model).held_bytes  # 0 on ranks > 0 under RAM-efficient FSDP loading
    load.host = load.memory.current() if load.memory else None  # what from_pretrained alone took
    if args.model.use_lora:
        set_seed(training.seed)  # LoRA's A matrices are random: same start for any process count
        model = add_lora(model, args.model, args.data.task)
    if packing:  # flash attention's varlen path needs the micro-batch as one flattened row (packing.py)
        data.collator.flatten = "flash" in str(model.config._attn_implementation)
    # no-op unless this rank loaded on the meta device (RAM-efficient FSDP loading)
    allocate_placeholders(model, mixed_precision=training.bf16 or training.fp16)
    set_fsdp_wrap_class(model)
    counts = ParameterCounts.of(model)

    if args.data.task == "dpo":  # TRL's DPOTrainer: its own collator and metrics, and a reference model
        from .preference import RecipeDPOTrainer, reference_model

        trainer_class, task_parts = RecipeDPOTrainer, {"ref_model": reference_model(args, tokenizer)}
    else:
        compute_metrics, preprocess_logits = metrics_for(args.data.task)
        trainer_class, task_parts = RecipeTrainer, dict(data_collator=data.collator, compute_metrics=compute_metrics,
                                                        preprocess_logits_for_metrics=preprocess_logits,
                                                        fused_loss=work.fused_head)  # fmt: skip
    trainer = trainer_class(
        model=model,
        args=training,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        **task_parts,
        arguments=args,
        param_counts=counts,
        load=load,
        prompts=prompts,
        data_note=data.note,
    )
    if resume_note and trainer.is_world_process_zero():
        print(resume_note, flush=True)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
        trainer.raise_if_stopped()
        metrics = finish(trainer, args, data, result)
    finally:
        trainer.safe_stop.uninstall()
    return RunResult(trainer, metrics)


def finish(trainer: RecipeTrainer, args, data, result) -> dict[str, float]:
    """After training: evaluate, save the consolidated model (and the merged LoRA one), close the W&B run."""
    training = args.training
    metrics = dict(result.metrics)
    if data.eval is not None:
        evaluation = trainer.evaluate()
        metrics.update(evaluation)
        if trainer.is_world_process_zero() and "eval_accuracy" in evaluation:
            print(f"eval accuracy {evaluation['eval_accuracy']:.4f} on {len(data.eval)} held-out examples")
    trainer.save_model(training.output_dir)
    if trainer.is_world_process_zero():
        if trainer.sample_prompts:
            print(side_by_side(training.output_dir))
        print(f"saved to {training.output_dir}")
        if args.model.use_lora and args.model.merge_lora:
            print(f"merged model saved to {save_merged(training.output_dir, args.data.task, args.model.dtype)}")
    trainer.end_of_run("completed", metrics)
    finish_run()
    return metrics


def run(recipe: dict[str, Any], argv: list[str] | None = None, name: str | None = None) -> None:
    """Entry point of a recipe script: one line for bad input or an early stop, its exit code, a clean
    distributed exit."""
    code, distributed = 0, False
    try:
        train(recipe, argv, name)
    except ToolkitError as error:
        code = report(error)
    except Stopped as stop:
        code = report(stop, stop.label) if stop.label else stop.exit_code
    else:
        if dist.is_available() and dist.is_initialized():
            # Rank 0 may still be saving: a rank that tears the group down early can abort its process
            # ("terminate called without an active exception"), failing a run that had succeeded.
            dist.barrier()
    finally:
        if dist.is_available() and dist.is_initialized():
            distributed = True
            dist.destroy_process_group()  # every rank leaves the group cleanly, whatever happened
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
