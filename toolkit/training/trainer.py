"""`RecipeTrainer`: the `transformers.Trainer` every recipe runs on, and the one place the toolkit changes it.

`ToolkitTrainerMixin` goes in front of any Trainer subclass (transformers.Trainer; TRL's DPOTrainer, GRPOTrainer
and SFTTrainer, which override the same methods with `super()` calls). It creates every part in `__init__`, each with
its own state, and it alone overrides the Trainer's methods, each override handing over to the parts in a fixed
order. Where the Trainer's events suffice, a part is a `TrainerCallback` the Trainer calls itself. The overrides
are grouped by concern, a mixin each, composed here in front of the Trainer:

  mixin          its overrides                                                                   where
  (this class)   __init__ (the parts), train, training_step, compute_loss, evaluate,             trainer.py
                 prediction_step
  Saving         checkpoints, resume and the export: the optimizer's shards, stages, staging     saving.py
  Loaders        loaders and samplers: a pipeline's replicas, the data wait, length grouping     loaders.py
  OptimizerStep  the optimizer with master weights, the gradient norm and its clipping           optimizer_step.py
  Reporting      log lines, the budget, the run's config, the summary at its end                reporting.py

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
  StepProfiler         a trace and the top operators of some steps (--profile)  profiling.py (callback)
  LogitsByName         the logits evaluation's metrics read, by name (Recipe-   evaluation.py
                       Trainer only)
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
import sys

import torch
from transformers import Trainer
from transformers.integrations import WandbCallback
from transformers.trainer_callback import ProgressCallback

from ..data.packing import examples_in, model_inputs, tokens_in
from ..distributed.strategy import check_strategy, set_fsdp_wrap_class
from ..errors import ToolkitError
from ..metrics.health import Health
from ..metrics.memory import device_memory
from ..metrics.routing import RouterStats, real_tokens
from ..metrics.samples import Prompt
from ..metrics.tracking import RunTracker
from ..metrics.wandb_run import run_callback
from ..models.counts import LoadRecord, ParameterCounts
from ..planner.estimate import assumed_mfu, not_fitting_warning
from ..settings.arguments import Arguments, scale_learning_rate
from ..settings.mesh import launch_mesh, model_parallel_size, pipeline_stages
from ..settings.tasks import task
from .checkpoints import StagedCheckpoints, start_afresh
from .evaluation import LogitsByName
from .fused_loss import FusedLoss
from .generation_samples import GenerationSamples
from .load_balance import BalancedLoss, LoadBalance
from .loaders import Loaders
from .optimizer_step import OptimizerStep
from .order import LengthGroupedOrder
from .pipeline import Pipeline
from .precision import keep_master_weights
from .profiling import StepProfiler, profiled_steps
from .rank_reports import RankReports
from .reporting import Reporting
from .run_plan import RunPlan
from .saving import Saving
from .stopping import SafeStop


def real(inputs) -> torch.Tensor | None:
    """A batch's real tokens, which the routers' statistics count (its padding is routed too)."""
    return inputs.get("attention_mask") if isinstance(inputs, dict) else None


class ToolkitTrainerMixin(Saving, Loaders, OptimizerStep, Reporting):
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
        self.profiler = None  # --profile: where those steps' time goes (profiling.py); off, nothing is made
        if arguments.run.profile:
            self.profiler = StepProfiler(profiled_steps(arguments.run.profile), self.args.output_dir)
        self.samples = None
        if prompts:
            synced = self.accelerator.num_processes > 1 and (self.plan.layout.shard_params or bool(self.pipeline))
            self.samples = GenerationSamples(self, prompts, arguments.run.generation_max_new_tokens, synced,
                                             self.pipeline)  # fmt: skip
        for part in (self.tracker, self.safe_stop, self.order, self.rank_reports, self.samples, self.profiler):
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
            with self.phase("micro-batch"):
                loss = self.pipeline_step(model, batch)
        else:
            with (reports.saving() if reports is not None else contextlib.nullcontext(), real_tokens(real(inputs)),
                  self.phase("micro-batch")):  # fmt: skip
                loss = super().training_step(model, batch, num_items_in_batch)
        self.safe_stop.note_loss(loss, self.state.global_step + 1)
        return loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        """The forward and its loss (the subclasses' own), a phase of a profiled training step."""
        with self.phase("forward") if model.training else contextlib.nullcontext():
            return super().compute_loss(model, inputs, *args, **kwargs)

    def phase(self, name: str):
        """A phase of the step, timed and named in the trace while --profile records (profiling.py); else nothing."""
        return self.profiler.phase(name) if self.profiler is not None else contextlib.nullcontext()

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

    def evaluate(self, *args, **kwargs):
        with self.tracker.paused():
            return super().evaluate(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.pipeline is not None:
            return self.pipeline.eval_step(self._prepare_inputs(self.model_inputs(inputs)), prediction_loss_only)
        # RecipeTrainer's predictions are the model's logits, by name (evaluation.py's LogitsByName); TRL's
        # trainers read theirs by name too
        return super().prediction_step(model, self.model_inputs(inputs), prediction_loss_only, ignore_keys)

    # ---------------------------------------------------------------------------------------- checkpoints

    # ------------------------------------------------------------------------------------- what it asks

    # --------------------------------------------------------------------------------------- its end


class RecipeTrainer(ToolkitTrainerMixin, LogitsByName, FusedLoss, BalancedLoss, Trainer):
    """The toolkit's parts on `transformers.Trainer`, the logits its metrics read taken by name, SFT's fused loss
    (TRL's DPOTrainer brings its own) and a mixture of experts' load-balancing term at its share."""
