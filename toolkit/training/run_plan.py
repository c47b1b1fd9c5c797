"""A run's own plan, made when its trainer is set up: the memory each device will hold, what the whole run will
cost, the budget check, and the header printed before the first step.

The figures come from the same formulas as `python -m toolkit plan` (planner/), applied to the strategy
accelerate really set up (planner/layout.py reads it) and the data really loaded, not to a config file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..data.image_rows import images_per_row
from ..data.length_grouping import sample_lengths
from ..distributed.strategy import describe
from ..errors import ConfigError, ToolkitError
from ..metrics.cost import Budget, CostModel, dollars, memory_tbs, peak_tflops
from ..models.loading import checkpoint_dtype
from ..models.meta import meta_model
from ..planner.compiled import planned_activations
from ..planner.estimate import (
    assumed_mfu,
    images_caveat,
    teacher_flops_per_token,
    training_flops_per_token,
    workload_for,
)
from ..planner.layout import Layout
from ..planner.memory import Memory, plan_memory
from ..planner.sampling import grpo_step_time
from ..planner.shape import Shape
from ..planner.vision import measured_image_cost
from ..planner.workload import Workload
from ..settings.arguments import Arguments, global_batch_size
from ..settings.mesh import data_parallel_replicas
from ..settings.tasks import task
from .header import RunHeader


class OverBudget(ToolkitError, ValueError):
    """The run's planned cost is above --budget_usd: refused before training."""


def precision_of(model: torch.nn.Module, training) -> str:
    """The arithmetic the matmuls run in, for the datasheet peak: fp32, bf16 or fp16."""
    dtype = next(model.parameters()).dtype
    if training.fp16 or dtype == torch.float16:
        return "fp16"
    return "bf16" if training.bf16 or dtype == torch.bfloat16 else "fp32"


def measured_shape(arguments: Arguments, config, work: Workload) -> tuple[Shape, str]:
    """The run's model as its plans see it (RunPlan's, the batch finder's): its shape, the activations measured as
    the run will run them (precision, compile, FP8, the experts' kernel), or the formula's with the reason."""
    task_name, lora, training = arguments.data.task, arguments.model.lora_settings(), arguments.training
    shape = Shape.of(meta_model(config, task_name, lora, arguments.model.train_parts), config)
    experts = getattr(config, "_experts_implementation", None) if shape.routing else None  # its kernel's
    fit, why = planned_activations(config, task_name, work.precision, work.flash_attention, work.fused_head, lora,
                                   bool(training.bf16 or training.fp16), bool(training.torch_compile),
                                   getattr(training, "mixed_precision", None) == "fp8", experts)  # fmt: skip
    return replace(shape, activations=fit), why  # None: the formula


def planned_steps(training, train_rows: int) -> int:
    """Optimizer steps the Trainer will take (as it counts them: last micro-batches kept)."""
    if training.max_steps > 0:
        return training.max_steps
    replicas = data_parallel_replicas(training.world_size)  # the ranks of a tensor-parallel group share rows
    samples = train_rows * getattr(training, "num_generations", 1)  # GRPO's samples: each prompt's completions
    batches = math.ceil(samples / (training.per_device_train_batch_size * replicas))
    return math.ceil(math.ceil(batches / training.gradient_accumulation_steps) * training.num_train_epochs)


@dataclass
class RunPlan(RunHeader):
    recipe: Arguments
    strategy: dict[str, Any]  # as describe() gives it
    layout: Layout
    cost: CostModel
    shape: Shape
    peak_flops: float | None  # per device, FLOP/s; None: no datasheet peak (CPU without --peak_tflops)
    memory: Memory
    cost_plan: dict[str, float] | None  # None without a peak or a price
    budget: Budget | None
    attention: str = ""  # the kernel the model runs (config._attn_implementation)
    experts: str = ""  # a mixture of experts' routing and expert kernel (config._experts_implementation)
    caveats: list[str] = field(default_factory=list)  # where the memory plan is not the model's own measurement
    work: Workload = field(default_factory=Workload)  # what the plan sized (distill's teacher among it)

    @classmethod
    def of(cls, trainer, arguments: Arguments) -> RunPlan:
        """Plan the run `trainer` (its accelerator set up) is about to train; refuses a plan over the budget."""
        accelerator, run = trainer.accelerator, arguments.run
        layout = Layout.from_accelerator(accelerator)
        strategy = describe(accelerator, layout)
        cost = CostModel.for_job(accelerator.num_processes, strategy["num_machines"], device=run.gpu_type,
                                 hourly_usd=run.hourly_usd, pricing=run.pricing,
                                 overhead=run.cost_overhead)  # fmt: skip
        model = trainer.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        task_name, lora = arguments.data.task, arguments.model.lora_settings()
        peak = run.peak_tflops or peak_tflops(cost.device, precision_of(model, trainer.args))
        # As the checkpoint loads (not as trained: master weights are fp32, FSDP's placeholders may be too)
        dtype = checkpoint_dtype(arguments.model.dtype, base.config)
        work = workload_for(arguments, dtype, on_gpu=torch.cuda.is_available())
        shape, why = measured_shape(arguments, base.config, work)
        fit, compiled = shape.activations, bool(trainer.args.torch_compile)
        image, image_note = None, ""
        if task(task_name).images:
            image, image_note = measured_image_cost(base.config, task_name, lora, arguments.model.train_parts,
                                                    work.precision, bool(trainer.args.bf16 or trainer.args.fp16),
                                                    images_per_row(trainer.train_dataset))  # fmt: skip
        shape = replace(shape, image=image)
        per_node = accelerator.num_processes // strategy["num_machines"]
        memory = plan_memory(shape, layout, work, per_node, strategy["num_machines"])
        plan = cls(arguments, strategy, layout, cost, shape, peak * 1e12 if peak else None, memory, None, None,
                   work=work)  # fmt: skip
        if task(arguments.data.task).samples_online:
            plan.cost_plan = plan.online_cost(trainer.args, work, len(trainer.train_dataset))
        else:
            plan.cost_plan = plan.plan_cost(trainer.args, sample_lengths(trainer.train_dataset))
        plan.budget = plan.check_budget()
        plan.attention = str(base.config._attn_implementation)
        if shape.routing:  # a mixture of experts: how it routes, and the expert kernel transformers dispatched
            plan.experts = f"{shape.routing}, kernel {base.config._experts_implementation}"
            if arguments.model.experts_implementation == "auto":
                plan.experts += " (auto: transformers' grouped_mm where it can run, else eager)"
            text = base.config.get_text_config()
            if getattr(text, "output_router_logits", False):
                plan.experts += f", load-balancing loss x {text.router_aux_loss_coef:g}"
        left_out = images_caveat(task_name, image, image_note)
        unmeasured = compiled and "compile's savings not measured" in why and why.split("; ")[-1]
        plan.caveats = [c for c in (None if fit else f"activations {why}, from the formula", shape.conservative,
                                    unmeasured or None,
                                    left_out and f"left out: {left_out}") if c]  # fmt: skip
        return plan

    def flops_per_token(self, seq_length: float) -> float:
        """The model's FLOPs per trained token: the task's passes over the policy, and distill's teacher forward."""
        passes = task(self.recipe.data.task).scoring_passes
        return training_flops_per_token(self.shape, seq_length, passes) + teacher_flops_per_token(self.work, seq_length)

    def plan_cost(self, training, lengths: list[int]) -> dict[str, float] | None:
        """The whole run's cost before it starts, the planner's way: planned tokens x FLOPs per token / (the
        strategy's assumed MFU x devices x peak). None without a datasheet peak (CPU: pass --peak_tflops)."""
        if not self.peak_flops or self.cost.usd_per_unit_hour is None:
            return None
        mean_length = sum(lengths) / len(lengths)
        steps = planned_steps(training, len(lengths))
        tokens = steps * global_batch_size(training) * mean_length
        mfu = assumed_mfu(self.layout, training.gradient_accumulation_steps)
        devices = self.strategy["num_processes"]
        seconds = tokens * self.flops_per_token(mean_length) / (mfu * devices * self.peak_flops)
        usd = self.cost.usd(seconds)
        return {"steps": steps, "tokens": tokens, "mfu": mfu, "seconds": seconds, "usd": usd, "step_usd": usd / steps}

    def online_cost(self, training, work: Workload, prompts: int) -> dict[str, float] | None:
        """GRPO's plan: each step's sampling at the decode roofline (a floor) and its training at the assumed MFU
        (planner/sampling.py). None without a datasheet peak and bandwidth (CPU: --peak_tflops, --memory_tbs)."""
        run = self.recipe.run
        bandwidth = run.memory_tbs or memory_tbs(self.cost.device)
        if not self.peak_flops or not bandwidth or self.cost.usd_per_unit_hour is None:
            return None
        completion = self.recipe.policy.max_completion_length
        mfu = assumed_mfu(self.layout, training.gradient_accumulation_steps)
        step = grpo_step_time(self.shape, work, self.recipe.data.max_seq_length - completion, completion,
                              bandwidth * 1e12, self.peak_flops, mfu, bool(self.recipe.policy.beta))  # fmt: skip
        steps = planned_steps(training, prompts)
        seconds = steps * step.total
        usd = self.cost.usd(seconds)
        return {"steps": steps, "mfu": mfu, "seconds": seconds, "usd": usd, "step_usd": usd / steps,
                "sampling_seconds": step.sampling, "training_seconds": step.training}  # fmt: skip

    def check_budget(self) -> Budget | None:
        """--budget_usd: refused at once when one step, or (unless --force_budget) the whole plan, costs more."""
        run, plan = self.recipe.run, self.cost_plan
        if run.budget_usd is None:
            return None
        if self.cost.usd_per_unit_hour is None:
            raise ConfigError(f"--budget_usd needs a price: '{self.cost.device}' is not in the price table "
                              "(toolkit/metrics/hardware.yaml); pass --hourly_usd.")  # fmt: skip
        if plan and plan["step_usd"] > run.budget_usd:
            raise OverBudget(f"--budget_usd {run.budget_usd:g} is below the cost of one optimizer step "
                             f"({dollars(plan['step_usd'])} planned on {self.cost.device}): raise the budget, or lower "
                             "the batch size.")  # fmt: skip
        if plan and plan["usd"] > run.budget_usd and not run.force_budget:
            raise OverBudget(
                f"the planned cost of this run, {dollars(plan['usd'])} for {plan['steps']} steps at an assumed "
                f"{100 * plan['mfu']:.0f}% MFU on {self.cost.device}, is above --budget_usd {run.budget_usd:g}: raise "
                "the budget, lower --max_steps or --num_train_epochs, or pass --force_budget true to train until the "
                "budget is spent (it stops with a checkpoint)."
            )
        return Budget(run.budget_usd)

    def summary(self) -> dict[str, Any]:
        """The plan as logged with the run's config (W&B, run_summary.json)."""
        cost = self.cost
        return {
            "memory_plan": {
                "device": self.memory.device,
                "host_per_node": self.memory.host_per_node,
                "device_total": self.memory.device_total,
            },
            "cost_plan": self.cost_plan,
            "pricing": {
                "device": cost.device,
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "usd_per_unit_hour": cost.usd_per_unit_hour,
                "unit": cost.unit,
                "units": cost.units,
                "pricing": cost.pricing,
                "overhead": cost.overhead,
                "peak_tflops_per_device": self.peak_flops / 1e12 if self.peak_flops else None,
                "budget_usd": self.recipe.run.budget_usd,
            },
        }
