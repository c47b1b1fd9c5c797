"""`RecipeTrainer`: the `transformers.Trainer` every recipe runs on, and the one place the toolkit changes it.

`ToolkitTrainerMixin` goes in front of any Trainer subclass (transformers.Trainer; TRL's DPOTrainer, GRPOTrainer
and SFTTrainer, which override the same methods with `super()` calls). It creates every part in `__init__`, each with
its own state, and it alone overrides the Trainer's methods, each override handing over to the parts in a fixed
order. Where the Trainer's events suffice, a part is a `TrainerCallback` the Trainer calls itself.

  part                 its job                                                  where
  RunPlan              memory and cost plan, budget check, the header           run_plan.py
  RunTracker           tokens/s, MFU, memory, cost on every log line; summary   metrics/tracking.py
  Health               one warning per kind: MFU, memory, data wait, NaN        metrics/health.py
  SafeStop             signals, a non-finite loss, the budget: stop with exit  stopping.py (callback)
  MasterWeights        fp32 masters of bf16 weights in the optimizer step      precision.py (single/DDP/TP/PP)
  Pipeline             the stages' schedule, data, clipping and saves (pp)      pipeline.py
  StagedCheckpoints    checkpoints published whole, a consolidated final save   checkpoints.py
  LengthGroupedOrder   the training order, length-grouped per global batch      order.py (callback)
  GenerationSamples    answers to held-out prompts at each evaluation           generation_samples.py (callback)
  RankReports          rows, weights and bytes per rank (--record_rank_reports) rank_reports.py (callback)
  FusedLoss            SFT's loss on TRL's fused head (RecipeTrainer only)      fused_loss.py
  LoadBalance          a MoE's load-balancing term at its share, aux_loss      load_balance.py (BalancedLoss)

Per micro-batch, `training_step` (the package's only override of it), in this order:
  1. RankReports.record    the rows this rank trains on (only with --record_rank_reports: a device sync)
  2. RunTracker.count_batch  its examples (a packed row holds several) and real tokens, these added up on the
                           device, unread: summed over ranks once per log line and checkpoint
  3. model_inputs          the collator's bookkeeping, and a packed batch's mask, kept from the model
                           (data/packing.py; the mask beside it for a load-balancing loss); the batch itself
                           stays whole for the Trainer's token count
  4. the Trainer's step    forward, the loss (FusedLoss.compute_loss for SFT), backward; under pipeline stages
                           the micro-batch is kept until the window's last, then the schedule runs them all
  5. SafeStop.note_loss    a non-finite loss marks its optimizer step
Per optimizer step, the callbacks in the order added: SafeStop (every rank agrees on a signal, a non-finite loss or
a spent budget, and stops with a checkpoint), then RankReports (gradient bytes).
Per log line, `log`: the tracker's figures added, the routers' and the load-balancing loss's, health judged, the
line appended to OUTPUT/run_log.jsonl.
Per evaluation, `evaluate`: the tracker's training clock paused; the Trainer's, then GenerationSamples (on_evaluate).
Per checkpoint, `_save_checkpoint`: the token count brought up to date, then StagedCheckpoints writes it with the
cost so far (RunTracker) and publishes it.
Per run, `train`: the header and the plan's warning, the bill started; the tracker counts from on_train_begin, on
the state a resumed run continues from; RankReports writes its report at on_train_end; `end_of_run` the summary.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer
from transformers.integrations import WandbCallback
from transformers.trainer_callback import ProgressCallback

from ..data.length_grouping import PAIRED
from ..data.packing import examples_in, model_inputs, tokens_in
from ..distributed.strategy import check_strategy, set_fsdp_wrap_class
from ..errors import ToolkitError
from ..metrics.health import Health
from ..metrics.memory import device_memory, memory_fraction
from ..metrics.routing import RouterStats, real_tokens
from ..metrics.samples import RUN_LOG, Prompt
from ..metrics.tracking import SPENT_FILE, RunTracker, TimedIterator
from ..metrics.wandb_run import finish_run, launch_environment, redacted_command, run_callback
from ..models.counts import LoadRecord, ParameterCounts
from ..outputs import SUMMARY
from ..planner.estimate import assumed_mfu, not_fitting_warning
from ..settings.arguments import Arguments, global_batch_size, scale_learning_rate
from ..settings.mesh import launch_mesh, model_parallel_size, pipeline_stages
from ..settings.tasks import task
from . import sharded_state
from .checkpoints import StagedCheckpoints, plain_state_dict, staging_dir, start_afresh, untied
from .converted import load_converted, load_sharded
from .evaluation import first_output
from .fused_loss import FusedLoss
from .generation_samples import GenerationSamples
from .load_balance import BalancedLoss, LoadBalance
from .order import LengthGroupedOrder
from .pipeline import Pipeline
from .precision import keep_master_weights
from .rank_reports import RankReports, held_bytes
from .run_plan import RunPlan
from .stopping import SafeStop, Stopped


def real(inputs) -> torch.Tensor | None:
    """A batch's real tokens, which the routers' statistics count (its padding is routed too)."""
    return inputs.get("attention_mask") if isinstance(inputs, dict) else None


class ToolkitTrainerMixin:
    def __init__(self, *args, arguments: Arguments, param_counts: ParameterCounts, load: LoadRecord | None = None,
                 prompts: list[Prompt] | None = None, data_note: str = "", data_summary: dict | None = None,
                 **kwargs):  # fmt: skip
        # Before the Trainer copies the learning rate into DeepSpeed's "auto" values.
        self.base_learning_rate = scale_learning_rate(kwargs["args"], arguments.run.lr_reference_batch_size)
        set_fsdp_wrap_class(kwargs["model"])  # before the Trainer's accelerator reads the FSDP settings
        training, asked = kwargs["args"], kwargs["args"].save_only_model
        # transformers cannot save the optimizer of a model it sharded at load (TP, EP) and refuses save_only_model
        # false there: past that check the setting is the user's again, and `_save_optimizer_and_scheduler` writes
        # the optimizer's shards itself (sharded_state.py)
        self.sharded_state = getattr(kwargs["model"], "is_distributed_loading_by_transformers", False) and not asked
        training.save_only_model = asked or self.sharded_state
        super().__init__(*args, **kwargs)
        training.save_only_model = asked
        check_strategy(self.accelerator)  # before a single step is paid for
        self.balance = LoadBalance.of(self.model)  # before the pipeline's stages, which add its term
        self.pipeline = Pipeline(self) if pipeline_stages() > 1 else None
        if self.pipeline is not None:  # the stage, driven by its schedule: accelerate wraps nothing
            self.model_wrapped, self.gather_function = self.pipeline.module, self.pipeline.gather
        if not task(arguments.data.task).token_normalised_loss:
            self.model_accepts_loss_kwargs = False  # see settings/tasks.py's Task
        self.recipe, self.param_counts, self.data_note = arguments, param_counts, data_note
        self.data_summary = data_summary or {}
        # The model is on its device, no optimizer exists yet: where no engine keeps master weights, the toolkit.
        self.masters, self.master_weights = keep_master_weights(self, arguments.model.fp32_master_weights)
        # The parts, each with its own state; the callbacks are called in the order added.
        self.plan = RunPlan.of(self, arguments)  # refuses a plan over --budget_usd
        self.tracker = RunTracker(self.plan.cost, self.accelerator.num_processes, self.plan.flops_per_token,
                                  self.plan.peak_flops, model_parallel_size(), launch_mesh().get("sp", 1))  # fmt: skip
        self.health = Health(assumed_mfu(self.plan.layout, self.args.gradient_accumulation_steps),
                             self.is_world_process_zero())  # fmt: skip
        # A mixture of experts' router balance (metrics/routing.py) and load-balancing loss (load_balance.py)
        self.routing = RouterStats.of(self.model, *(self.pipeline.router_layers() if self.pipeline else ()))
        self.checkpoints = StagedCheckpoints(self)
        self.safe_stop = SafeStop(over_budget=self.over_budget)
        self.order = LengthGroupedOrder()
        self.rank_reports = RankReports(self, load) if arguments.run.record_rank_reports else None
        self.samples = None
        if prompts:
            synced = self.accelerator.num_processes > 1 and (self.plan.layout.shard_params or bool(self.pipeline))
            self.samples = GenerationSamples(self, prompts, arguments.run.generation_max_new_tokens, synced,
                                             self.pipeline)  # fmt: skip
        for part in (self.tracker, self.safe_stop, self.order, self.rank_reports, self.samples):
            if part is not None:
                self.add_callback(part)
        if "wandb" in self.args.report_to:
            tags = [arguments.recipe_name, self.plan.strategy["distributed_type"],
                    f"world-{self.accelerator.num_processes}", self.plan.cost.device]  # fmt: skip
            wandb_callback = self.pop_callback(WandbCallback)  # re-added after the callback that starts the run
            self.add_callback(run_callback(arguments.run, arguments.recipe_name, tags, self.run_config(),
                                           self.is_world_process_zero()))  # fmt: skip
            self.add_callback(wandb_callback)

    # The plan's parts most often read from outside.
    cost = property(lambda self: self.plan.cost, doc="The run's CostModel (device, price, billed units).")
    memory_plan = property(lambda self: self.plan.memory, doc="The planner's Memory for one device of this run.")
    strategy = property(lambda self: self.plan.strategy, doc="The strategy in effect, as the header prints it.")

    # ------------------------------------------------------------------------------------------ the run
    def train(self, *args, **kwargs):
        if self.is_world_process_zero():
            print(self.plan.header(self.args, self.param_counts, self.base_learning_rate, self.data_note,
                                   self.master_weights, self.task_lines()), flush=True)  # fmt: skip
            available = device_memory() if torch.cuda.is_available() else 0  # no warning on CPU
            warning = not_fitting_warning(self.plan.memory.device_total, available)
            if warning:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        if self.args.should_save and not kwargs.get("resume_from_checkpoint"):
            start_afresh(self.args.output_dir)  # every check has passed: an earlier run's log is replaced now
        self.tracker.resume_from(kwargs.get("resume_from_checkpoint"))
        self.tracker.start()
        try:
            return super().train(*args, **kwargs)
        except ToolkitError:  # a user's mistake met mid-run (a reward that raised): its line under the bar, not on it
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                    callback.training_bar.close()
            raise

    def training_step(self, model, inputs, num_items_in_batch=None):
        reports = self.rank_reports
        if not isinstance(inputs, list):  # GRPO's is a generation batch of prompts: it counts once sampled (rl.py)
            if reports is not None:
                reports.record(inputs)
            self.tracker.count_batch(examples_in(inputs, task(self.recipe.data.task).pairs), tokens_in(inputs))
        batch = self.model_inputs(inputs)
        if self.pipeline is not None:
            loss = self.pipeline_step(model, batch)
        else:
            with reports.saving() if reports is not None else contextlib.nullcontext(), real_tokens(real(inputs)):
                loss = super().training_step(model, batch, num_items_in_batch)
        self.safe_stop.note_loss(loss, self.state.global_step + 1)
        return loss

    def model_inputs(self, inputs: dict) -> dict:
        """What of a batch reaches the model (data/packing.py), and a packed batch's mask for the balance."""
        return self.balance.model_inputs(inputs) if self.balance is not None else model_inputs(inputs)

    def pipeline_step(self, model, inputs):
        """Under pipeline stages, what the Trainer's training_step does around its forward and backward (the model
        and optimizer in training mode: transformers checkpoints activations and applies dropout only then; the
        inputs on the device; its loss context), around the schedule's step."""
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        with self.compute_loss_context_manager():
            return self.pipeline.train_step(self._prepare_inputs(inputs), window_ends=self.accelerator.sync_gradients)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.masters is not None:  # the optimizer steps fp32 masters in the bf16 weights' place (precision.py)
            self.masters.attach(optimizer)
        return optimizer

    def _clip_grad_norm(self, model, max_norm: float | None = None):
        max_norm = self.args.max_grad_norm if max_norm is None else max_norm
        if self.masters is not None:
            self.masters.take_gradients()  # the norm of the fp32 gradients, and those clipped (precision.py)
        parameters = self.masters.masters if self.masters is not None else list(self.model.parameters())
        if self.pipeline is not None:  # the norm over every stage's gradients
            return self.pipeline.clip(parameters, max_norm)
        if self.masters is None:
            return super()._clip_grad_norm(model)
        return self.accelerator.clip_grad_norm_(parameters, max_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged norm without clipping (--max_grad_norm 0) is the one clipping would use: over every pipeline
        stage, of the fp32 master gradients."""
        if grad_norm is None and (self.pipeline is not None or self.masters is not None):
            grad_norm = self._clip_grad_norm(model, max_norm=float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def evaluate(self, *args, **kwargs):
        with self.tracker.paused():
            return super().evaluate(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.pipeline is not None:
            return self.pipeline.eval_step(self._prepare_inputs(self.model_inputs(inputs)), prediction_loss_only)
        loss, logits, labels = super().prediction_step(model, self.model_inputs(inputs), prediction_loss_only,
                                                       ignore_keys)  # fmt: skip
        return loss, first_output(logits), labels  # the metrics read the logits alone

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        return self.pipeline.shard(loader) if self.pipeline is not None else loader

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        return self.pipeline.shard(loader) if self.pipeline is not None else loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return super().get_batch_samples(TimedIterator(epoch_iterator, self.tracker), num_batches, device)

    def _get_train_sampler(self, train_dataset=None):
        return self.order.sampler_for(self.train_dataset, self.args) or super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        """transformers groups the held-out rows by length too, reading each row's `input_ids`: TRL's tokenized
        preference pairs have none (chosen_ids, rejected_ids), so theirs are read in order, as transformers reads
        them ungrouped (one process: in order; several: accelerate's split of that order)."""
        if PAIRED in getattr(eval_dataset, "column_names", ()):
            return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None
        return super()._get_eval_sampler(eval_dataset)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training = "loss" in logs
        logs.update(self.tracker.metrics(self.state, training))
        if training:  # every rank logs: the counts and losses are summed over them
            reduce = None
            if self.accelerator.num_processes > 1:
                reduce = lambda t: self.accelerator.reduce(t.to(self.accelerator.device), "sum").cpu()  # noqa: E731
            for part in (self.routing, self.balance):
                if part is not None:
                    logs.update(part.metrics(reduce))
        if training:
            self.health.check(logs, memory_fraction())
        super().log(logs, start_time)
        if self.args.should_save:  # the run's own log, read by `toolkit report`
            with open(Path(self.args.output_dir) / RUN_LOG, "a") as f:
                f.write(json.dumps(self.state.log_history[-1]) + "\n")

    # ---------------------------------------------------------------------------------------- checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharded_state:
            return sharded_state.save(self, output_dir)
        if self.pipeline is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.pipeline.save_optimizer(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.sharded_state:
            return sharded_state.load(self, checkpoint)
        if self.pipeline is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.pipeline.load_optimizer(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.pipeline is None:
            # `model or ...` would ask a compiled model for its truth: OptimizedModule.__len__ raises
            if not self._loaded_converted(resume_from_checkpoint, self.model if model is None else model):
                super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        self.pipeline.load_weights(resume_from_checkpoint)

    def _loaded_converted(self, checkpoint: str, model) -> bool:
        """Whether the weights of `checkpoint` were loaded here because transformers sharded the model at load or
        saved them under converted names (converted.py); FSDP's and DeepSpeed's own checkpoints use the model's
        names and keep their load."""
        engine = self.is_fsdp_enabled or self.is_deepspeed_enabled
        return not engine and (load_sharded(model, checkpoint) or load_converted(model, checkpoint))

    def _load_best_model(self) -> None:
        if self.pipeline is None:
            if not self._loaded_converted(self.state.best_model_checkpoint, self.model):
                super()._load_best_model()
            return
        self.pipeline.load_weights(self.state.best_model_checkpoint)

    def _get_output_dir(self, trial) -> str:
        if self.checkpoints.active:  # while a checkpoint is written: into the staging folder
            return str(staging_dir(self.args.output_dir))
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self.tracker.reduce_tokens(self.state)  # the count the checkpoint's trainer_state.json keeps
        self.checkpoints.save(functools.partial(super()._save_checkpoint, model, trial),
                              {SPENT_FILE: json.dumps(self.tracker.spent())})  # fmt: skip  # resumes add to it

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every save of the weights (checkpoints and the export): plain tensors, not FP8's weight wrappers; a
        gathered state dict (DeepSpeed's) without the second name of tied weights, which it holds as two tensors."""
        if state_dict is not None:
            state_dict = untied(self.model, state_dict)
        super()._save(output_dir, plain_state_dict(self.model, state_dict))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The final save is always a consolidated Hugging Face folder; checkpoints keep their sharded format.
        Pipeline stages write the stages' parts of one folder (checkpoints and the export alike)."""
        if self.pipeline is not None:
            self.pipeline.save(output_dir or self.args.output_dir)
            return
        gathered = None if _internal_call else self.checkpoints.gathered_state_dict()
        if gathered is not None:
            self._save(output_dir, state_dict=gathered)
            return
        super().save_model(output_dir, _internal_call)

    # ------------------------------------------------------------------------------------- what it asks
    def over_budget(self, state) -> bool:
        """At each step end, on every rank: would the next step take the run past --budget_usd?"""
        if self.plan.budget is None:
            return False
        stop, warning = self.plan.budget.check(self.tracker.usd(), self.tracker.step_usd(state))
        if warning:
            self.health.warn("budget", warning)
        return stop

    def task_lines(self) -> tuple[str, ...]:
        """The header's lines of the task's own (GRPO's sampling; which parts of an image-text model train), after
        the batch line."""
        return (f"trains        {note}",) if (note := self.recipe.model.parts_note) else ()

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state this rank really holds (its shard, under ZeRO-3 or FSDP)."""
        return held_bytes(self.model_wrapped, self.optimizer)

    def run_config(self) -> dict[str, Any]:
        """Everything that defines the run, as logged to W&B and OUTPUT/run_summary.json."""
        return {
            "toolkit": self.recipe.resolved(),
            "strategy": self.plan.strategy,
            "launch": launch_environment(),
            "parameters": {"total": self.param_counts.total, "trainable": self.param_counts.trainable},
            "global_batch_size": global_batch_size(self.args),
            "data": self.data_summary,
            "command": redacted_command(),
            **self.plan.summary(),
        }

    # --------------------------------------------------------------------------------------- its end
    def raise_if_stopped(self) -> None:
        """After train(): a run that stopped early writes its summary, closes W&B, and raises its `Stopped`."""
        stop: Stopped | None = self.safe_stop.outcome(self)
        if stop is not None:
            self.end_of_run(stop.status, {})
            finish_run()
            raise stop

    def end_of_run(self, status: str, metrics: dict[str, float]) -> dict[str, Any]:
        """Printed, written to OUTPUT/run_summary.json and to the W&B run's summary (rank 0)."""
        summary = self.tracker.summary(self.state)
        strategy, cost = self.plan.strategy, self.plan.cost
        summary.update(
            status=status,
            recipe=self.recipe.recipe_name,
            strategy=f"{strategy['distributed_type']}, {strategy['sharding']}",
            processes=strategy["num_processes"],
            device=cost.device,
            pricing=cost.pricing,
            **{k: v for k, v in metrics.items() if k == "train_loss" or k.startswith("eval_")},
        )
        if not self.is_world_process_zero():
            return summary
        wandb = sys.modules.get("wandb")
        if wandb is not None and (wandb.run is None or wandb.run.disabled):
            wandb = None  # WANDB_MODE=disabled: a stand-in run, with an id and entity that name nothing
        if wandb is not None:
            summary.update(wandb_run_id=wandb.run.id, wandb_entity=wandb.run.entity or None,
                           wandb_project=wandb.run.project, wandb_offline=bool(wandb.run.offline),
                           wandb_run_dir=str(Path(wandb.run.dir).parent))  # fmt: skip  # `wandb sync` takes it
        mfu = f"{100 * summary['mean_mfu']:.2f}%" if summary.get("mean_mfu") is not None else "n/a (no peak)"
        losses = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in summary.items() if k.endswith("_loss"))
        print(
            f"run summary   {status} after {time.strftime('%H:%M:%S', time.gmtime(summary['wall_seconds']))}, "
            f"{summary['steps']} steps, {summary['tokens']:,} tokens ({summary.get('tokens_per_second', 0):,.0f}/s), "
            f"MFU {mfu}, peak memory {summary['peak_memory_gib']:.2f} GiB"
            + (f", {losses}" if losses else "")
            + (
                f"; sampling {100 * share:.0f}% of the training time"
                if (share := summary.get("sampling_share"))
                else ""
            ),
            flush=True,
        )
        print(cost.summary(summary["wall_seconds"], self.tracker.spent_before), flush=True)  # the summary's own
        path = Path(self.args.output_dir) / SUMMARY
        path.write_text(json.dumps({"summary": summary, "config": self.run_config()}, indent=1, default=str))
        if wandb is not None:
            wandb.run.summary.update({f"summary/{k}": v for k, v in summary.items()})
        return summary


class RecipeTrainer(ToolkitTrainerMixin, FusedLoss, BalancedLoss, Trainer):
    """The toolkit's parts on `transformers.Trainer`, SFT's fused loss (TRL's DPOTrainer brings its own) and a
    mixture of experts' load-balancing term at its share."""
