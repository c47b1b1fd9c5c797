"""`RecipeTrainer`: the `transformers.Trainer` every recipe runs on, composed of the toolkit's parts.

Each part is a small mixin with one job, in the module of its concern, and cooperates through `super()`:
  RankReports           rows trained on, weight digests, bytes held per rank      metrics/rank_reports.py
  Tracked               live tokens/s, MFU, memory, cost; health; run summary    metrics/tracking.py
  GenerationSamples     answers to held-out prompts at each evaluation           metrics/samples.py
  FiniteLossCheck       a NaN/Inf loss marks its step for SafeStop               pipeline/stopping.py
  PackedInputs          packed batches reach the model without bookkeeping keys  pipeline/packing.py
  LengthGroupedSampling global length-grouped batches, seeded per epoch          pipeline/length_grouping.py
  StagedCheckpoints     checkpoints published whole, consolidated final save     pipeline/checkpoints.py
  FusedLoss             SFT's loss on TRL's fused head (RecipeTrainer only)      pipeline/fused_loss.py
`ToolkitTrainerMixin` stacks them and sets up what they share: the refusal of a degraded strategy, the run's
plan (pipeline/run_plan.py), the tracker, health warnings, the SafeStop callback and W&B. It goes in front of
any Trainer subclass: `class RecipeTrainer(ToolkitTrainerMixin, FusedLoss, Trainer)`, or TRL's trainers, which override
the same methods with `super()` calls. The order matters where parts read the same batch: RankReports and
Tracked read the packed-batch keys that PackedInputs then removes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import Trainer

from ..distributed.strategy import check_strategy
from ..metrics.health import Health
from ..metrics.rank_reports import LoadRecord, RankReports
from ..metrics.samples import GenerationSamples, Prompt
from ..metrics.tracking import RunTracker, Tracked
from ..metrics.wandb_run import launch_environment, run_callback
from ..planner.estimate import assumed_mfu, not_fitting_warning
from .arguments import Arguments, global_batch_size, scale_learning_rate
from .checkpoints import StagedCheckpoints
from .fused_loss import FusedLoss
from .length_grouping import LengthGroupedSampling
from .models import ParameterCounts
from .packing import PackedInputs
from .run_plan import RunPlan
from .stopping import FiniteLossCheck, SafeStop, Stopped
from .tasks import task


class ToolkitTrainerMixin(RankReports, Tracked, GenerationSamples, FiniteLossCheck, PackedInputs,
                          LengthGroupedSampling, StagedCheckpoints):  # fmt: skip
    def __init__(self, *args, arguments: Arguments, param_counts: ParameterCounts, load: LoadRecord | None = None,
                 prompts: list[Prompt] | None = None, data_note: str = "", **kwargs):  # fmt: skip
        # Before the Trainer copies the learning rate into DeepSpeed's "auto" values.
        self.base_learning_rate = scale_learning_rate(kwargs["args"], arguments.run.lr_reference_batch_size)
        super().__init__(*args, **kwargs)
        check_strategy(self.accelerator)  # before a single step is paid for
        if not task(arguments.data.task).token_normalised_loss:
            self.model_accepts_loss_kwargs = False  # see tasks.Task
        self.recipe, self.param_counts = arguments, param_counts
        self.sample_prompts, self.data_note = prompts or [], data_note
        self.plan = RunPlan.of(self, arguments)  # refuses a plan over --budget_usd
        self.tracker = RunTracker(self.plan.cost, self.accelerator.num_processes, self.plan.flops_per_token,
                                  self.plan.peak_flops)  # fmt: skip
        self.health = Health(assumed_mfu(self.plan.layout), self.is_world_process_zero())
        self.safe_stop = SafeStop(over_budget=self.over_budget)  # signals, a non-finite loss, the budget
        self.add_callback(self.safe_stop)
        if arguments.run.record_rank_reports:
            self.record_rank_reports(load)
        if "wandb" in self.args.report_to:
            tags = [arguments.recipe_name, self.plan.strategy["distributed_type"],
                    f"world-{self.accelerator.num_processes}", self.plan.cost.device]  # fmt: skip
            self.add_callback(run_callback(arguments.run, arguments.recipe_name, tags, self.run_config(),
                                           self.is_world_process_zero()))  # fmt: skip

    # The plan's parts most often read from outside.
    cost = property(lambda self: self.plan.cost, doc="The run's CostModel (device, price, billed units).")
    memory_plan = property(lambda self: self.plan.memory, doc="The planner's Memory for one device of this run.")
    strategy = property(lambda self: self.plan.strategy, doc="The strategy in effect, as the header prints it.")

    def train(self, *args, **kwargs):
        if self.is_world_process_zero():
            print(self.plan.header(self.args, self.param_counts, self.base_learning_rate, self.data_note), flush=True)
            available = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
            warning = not_fitting_warning(self.plan.memory.device_total, available)
            if warning:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        return super().train(*args, **kwargs)

    def over_budget(self, state) -> bool:
        """At each step end, on every rank: would the next step take the run past --budget_usd?"""
        if self.plan.budget is None:
            return False
        stop, warning = self.plan.budget.check(self.tracker.usd(), self.tracker.step_usd(state))
        if warning:
            self.health.warn("budget", warning)
        return stop

    def raise_if_stopped(self) -> None:
        """After train(): a run that stopped early writes its summary, closes W&B, and raises its `Stopped`."""
        from ..metrics.wandb_run import finish_run

        stop: Stopped | None = self.safe_stop.outcome(self)
        if stop is not None:
            self.end_of_run(stop.status, {})
            finish_run()
            raise stop

    def run_config(self) -> dict[str, Any]:
        """Everything that defines the run, as logged to W&B and OUTPUT/run_summary.json."""
        return {
            "toolkit": self.recipe.resolved(),
            "strategy": self.plan.strategy,
            "launch": launch_environment(),
            "parameters": {"total": self.param_counts.total, "trainable": self.param_counts.trainable},
            "global_batch_size": global_batch_size(self.args),
            **self.plan.summary(),
        }


class RecipeTrainer(ToolkitTrainerMixin, FusedLoss, Trainer):
    """The toolkit's parts on `transformers.Trainer`, and SFT's fused loss (TRL's DPOTrainer brings its own)."""
