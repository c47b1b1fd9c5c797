"""`RecipeTrainer`: the `transformers.Trainer` every recipe runs on.

On top of the Trainer it: refuses a launch whose strategy silently degraded or whose planned cost exceeds the
budget, prints a run header with the memory and cost plan, adds live throughput, MFU, memory and cost to every
log line (and OUTPUT/run_log.jsonl), warns on poor health, stops cleanly at the budget, logs the resolved config
and an end-of-run summary to W&B and OUTPUT/run_summary.json, and, on request, writes per-rank reports (rows
trained on, weight digest) for checking distributed runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import rotate_checkpoints

from . import checkpoints, planner
from .arguments import Arguments, ConfigError
from .cost import Budget, CostModel, peak_tflops
from .health import Health
from .length_grouping import LENGTH, GlobalLengthGroupedSampler
from .models import ParameterCounts, local_tensor, nbytes
from .packing import SEQUENCES
from .stopping import SafeStop
from .strategy import check_strategy, describe, num_machines
from .tracking import SPENT_FILE, HostMemoryPeak, RunTracker, TimedIterator, memory_fraction
from .wandb_run import WandbRunConfig, configure_env, launch_environment


def global_batch_size(training) -> int:
    """Samples per optimizer step over the whole job."""
    return training.per_device_train_batch_size * training.gradient_accumulation_steps * training.world_size


def scaled_learning_rate(base_lr: float, global_batch: int, reference_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): lr grows with the batch."""
    return base_lr * global_batch / reference_batch


def sequences_of(inputs: dict[str, torch.Tensor], packed: bool) -> list[list[int]]:
    """The token ids of each example in a batch: rows without their padding, and packed rows split into their
    conversations where position_ids restart."""
    mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).tolist()
    out = []
    for r, ids in enumerate(inputs["input_ids"].tolist()):
        real = [i for i, keep in enumerate(mask[r]) if keep]
        if not packed:
            out.append([ids[i] for i in real])
            continue
        positions = inputs["position_ids"][r].tolist()
        starts = [i for i in real if positions[i] == 0] + [len(real)]
        out += [ids[a:b] for a, b in zip(starts, starts[1:], strict=False)]
    return out


class OverBudget(ValueError):
    """The run's planned cost is above --budget_usd: refused before training."""


class LoadFootprint(TrainerCallback):
    """Peak host RAM that loading the model took, up to training: read when the Trainer has wrapped, placed and
    (FSDP, ZeRO-3) sharded it, before the first step allocates optimizer state."""

    def __init__(self, trainer: RecipeTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer.load_memory is not None:
            self.trainer.load_host = self.trainer.load_memory.stop()


class GradientBytes(TrainerCallback):
    """The most gradient bytes this rank held at an optimizer step (for rank reports: it walks every parameter).
    Under DeepSpeed the gradients live in the engine's own partitioned buffers, not in `.grad`: None there."""

    def __init__(self) -> None:
        self.most: int | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        held = [nbytes(local_tensor(p.grad)) for p in model.parameters() if p.grad is not None]
        if held:
            self.most = max(self.most or 0, sum(held))


class RecipeTrainer(Trainer):
    def __init__(
        self,
        *args,
        arguments: Arguments,
        param_counts: ParameterCounts,
        loaded_param_bytes: int | None = None,
        load_memory: HostMemoryPeak | None = None,
        loaded_host: dict[str, int] | None = None,
        **kwargs,
    ):
        training = kwargs["args"]
        self.base_learning_rate = training.learning_rate
        if arguments.run.lr_reference_batch_size:  # before the Trainer copies lr into DeepSpeed's "auto" values
            training.learning_rate = scaled_learning_rate(
                self.base_learning_rate, global_batch_size(training), arguments.run.lr_reference_batch_size
            )
            if not training.warmup_steps:  # a large scaled lr needs a gradual start
                training.warmup_steps = 0.05
        super().__init__(*args, **kwargs)
        check_strategy(self.accelerator)  # before a single step is paid for
        if arguments.data.task == "classification":
            # Classification heads take **kwargs but ignore num_items_in_batch and return a per-example mean.
            # Left on, the Trainer treats that mean as token-normalised: it multiplies loss and gradients by
            # the number of processes and skips the division by gradient-accumulation steps.
            self.model_accepts_loss_kwargs = False
        self.recipe = arguments
        self.param_counts = param_counts
        self.loaded_param_bytes = loaded_param_bytes
        self.load_memory = load_memory  # sampling host RAM since loading began, until the first step
        self.loaded_host = loaded_host  # peak host RAM that from_pretrained took (anonymous, file-backed)
        self.load_host: dict[str, int] | None = None  # the same through placing and sharding, up to the first step
        self._length_sampler: GlobalLengthGroupedSampler | None = None
        self.strategy = describe(self.accelerator)
        run = arguments.run
        self.cost = CostModel.for_job(
            self.accelerator.num_processes,
            num_machines(self.accelerator.num_processes),
            device=run.gpu_type,
            hourly_usd=run.hourly_usd,
            pricing=run.pricing,
            overhead=run.cost_overhead,
        )
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        meta = planner.meta_model(base.config, arguments.data.task, planner.lora_settings(arguments.model))
        self.shape = planner.Shape.of(meta, base.config)
        self.layout = planner.Layout.from_accelerator(self.accelerator)
        peak = run.peak_tflops or peak_tflops(self.cost.device, self.precision())
        self.tracker = RunTracker(self.cost, self.accelerator.num_processes,
                                  lambda seq: planner.training_flops_per_token(self.shape, seq),
                                  peak * 1e12 if peak else None)  # fmt: skip
        self.health = Health(planner.assumed_mfu(self.layout), self.is_world_process_zero())
        self.memory_plan = self.plan_memory()
        self.cost_plan = self.plan_cost()
        self.budget = self.check_budget()
        self._staging = False
        # preemption signals, a non-finite loss and the budget (stopping.py)
        self.safe_stop = SafeStop(over_budget=self.over_budget)
        self.add_callback(self.safe_stop)
        self._rows_seen: list[str] | None = [] if run.record_rank_reports else None
        self._gradient_bytes = GradientBytes()
        if run.record_rank_reports:
            self.add_callback(self._gradient_bytes)
            self.add_callback(LoadFootprint(self))
        if "wandb" in self.args.report_to:
            tags = [
                arguments.recipe_name,
                self.strategy["distributed_type"],
                f"world-{self.accelerator.num_processes}",
                self.cost.device,
            ]
            tags += [t.strip() for t in (run.wandb_tags or "").split(",") if t.strip()]
            notice = configure_env(run.wandb_project, run.wandb_group or arguments.recipe_name, tags)
            if notice and self.is_world_process_zero():
                print(notice)
            self.add_callback(WandbRunConfig(self.run_config()))

    def precision(self) -> str:
        """The arithmetic the matmuls run in, for the datasheet peak: fp32, bf16 or fp16."""
        dtype = next(self.model.parameters()).dtype
        if self.args.fp16 or dtype == torch.float16:
            return "fp16"
        return "bf16" if self.args.bf16 or dtype == torch.bfloat16 else "fp32"

    def plan_memory(self) -> planner.Memory:
        """What toolkit.planner predicts each device of this run holds (the same formulas as `toolkit plan`)."""
        dtype = next(self.model.parameters()).dtype
        per_node = self.accelerator.num_processes // self.strategy["num_machines"]
        work = planner.workload_for(self.recipe, dtype, on_gpu=torch.cuda.is_available())
        return planner.plan_memory(self.shape, self.layout, work, per_node, self.strategy["num_machines"])

    def planned_steps(self) -> int:
        """Optimizer steps the Trainer will take (as it counts them: last micro-batches kept)."""
        if self.args.max_steps > 0:
            return self.args.max_steps
        batches = math.ceil(len(self.train_dataset) / (self.args.per_device_train_batch_size * self.args.world_size))
        return math.ceil(math.ceil(batches / self.args.gradient_accumulation_steps) * self.args.num_train_epochs)

    def plan_cost(self) -> dict[str, float] | None:
        """The whole run's cost before it starts, the planner's way: planned tokens x FLOPs per token / (the
        strategy's assumed MFU x devices x peak). None without a datasheet peak (CPU: pass --peak_tflops)."""
        if not self.tracker.peak_flops or self.cost.usd_per_unit_hour is None:
            return None
        lengths = [len(row) for row in self.train_dataset["input_ids"]]
        mean_length = sum(lengths) / len(lengths)
        steps = self.planned_steps()
        tokens = steps * global_batch_size(self.args) * mean_length
        mfu = planner.assumed_mfu(self.layout)
        seconds = (
            tokens
            * self.tracker.flops_per_token(mean_length)
            / (mfu * self.accelerator.num_processes * self.tracker.peak_flops)
        )
        usd = self.cost.usd(seconds)
        return {"steps": steps, "tokens": tokens, "mfu": mfu, "seconds": seconds, "usd": usd, "step_usd": usd / steps}

    def check_budget(self) -> Budget | None:
        """--budget_usd: refused at once when one step, or (unless --force_budget) the whole plan, costs more."""
        run, plan = self.recipe.run, self.cost_plan
        if run.budget_usd is None:
            return None
        if self.cost.usd_per_unit_hour is None:
            raise ConfigError(f"--budget_usd needs a price: '{self.cost.device}' is not in the price table "
                              "(toolkit/hardware.yaml); pass --hourly_usd.")  # fmt: skip
        if plan and plan["step_usd"] > run.budget_usd:
            raise OverBudget(f"--budget_usd {run.budget_usd:g} is below the cost of one optimizer step "
                             f"(${plan['step_usd']:.3g} planned on {self.cost.device}): raise the budget, or lower "
                             "the batch size.")  # fmt: skip
        if plan and plan["usd"] > run.budget_usd and not run.force_budget:
            raise OverBudget(
                f"the planned cost of this run, ${plan['usd']:.3g} for {plan['steps']} steps at an assumed "
                f"{100 * plan['mfu']:.0f}% MFU on {self.cost.device}, is above --budget_usd {run.budget_usd:g}: raise "
                "the budget, lower --max_steps or --num_train_epochs, or pass --force_budget true to train until the "
                "budget is spent (it stops with a checkpoint)."
            )
        return Budget(run.budget_usd)

    def over_budget(self, state) -> bool:
        """At each step end, on every rank: would the next step take the run past --budget_usd?"""
        if self.budget is None:
            return False
        stop, warning = self.budget.check(self.tracker.usd(), self.tracker.step_usd(state))
        if warning:
            self.health.warn("budget", warning)
        return stop

    def run_config(self) -> dict[str, Any]:
        return {
            "toolkit": self.recipe.resolved(),
            "strategy": self.strategy,
            "launch": launch_environment(),
            "parameters": {"total": self.param_counts.total, "trainable": self.param_counts.trainable},
            "global_batch_size": global_batch_size(self.args),
            "memory_plan": {
                "device": self.memory_plan.device,
                "host_per_node": self.memory_plan.host_per_node,
                "device_total": self.memory_plan.device_total,
            },  # fmt: skip
            "cost_plan": self.cost_plan,
            "pricing": {
                "device": self.cost.device,
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "usd_per_unit_hour": self.cost.usd_per_unit_hour,
                "unit": self.cost.unit,
                "units": self.cost.units,
                "pricing": self.cost.pricing,
                "overhead": self.cost.overhead,
                "peak_tflops_per_device": self.tracker.peak_flops / 1e12 if self.tracker.peak_flops else None,
                "budget_usd": self.recipe.run.budget_usd,
            },
        }

    def header(self) -> str:
        a, s, p = self.args, self.strategy, self.param_counts
        lr = f"{a.learning_rate:.3g}"
        if self.recipe.run.lr_reference_batch_size:
            lr += f" (scaled from {self.base_learning_rate:.3g} at batch {self.recipe.run.lr_reference_batch_size})"
        tiny = "  [tiny, random init]" if self.recipe.run.tiny else ""
        lines = [
            f"recipe        {self.recipe.recipe_name}",
            f"model         {self.recipe.model.model_name_or_path}{tiny}",
            f"parameters    {p.total:,} total, {p.trainable:,} trainable ({100 * p.trainable / max(p.total, 1):.2f}%)",
            f"strategy      {s['distributed_type']}, {s['num_processes']} process(es) on {s['num_machines']} "
            f"machine(s), {s['device']}, backend {s['backend']}",
            f"sharding      {s['sharding']}",
            f"precision     {s['mixed_precision']}, weights {self.recipe.model.dtype}",
            f"batch         {a.per_device_train_batch_size} per device x {a.gradient_accumulation_steps} accumulation "
            f"x {s['num_processes']} processes = {global_batch_size(self.args)} global",
            f"learning rate {lr}",
            f"memory plan   {planner.human_bytes(self.memory_plan.device_total)} per device predicted: "
            + ", ".join(f"{k} {planner.human_bytes(v)}" for k, v in self.memory_plan.device.items() if v),
            f"pricing       {self.cost.device}: "
            + (
                f"${self.cost.usd_per_unit_hour}/{self.cost.unit}-hour x {self.cost.units} ({self.cost.pricing}"
                + (f", overhead x{self.cost.overhead:g}" if self.cost.overhead != 1 else "")
                + ")"
                if self.cost.usd_per_unit_hour is not None
                else "unknown (pass --hourly_usd)"
            )
            + (f", budget ${self.recipe.run.budget_usd:g}" if self.recipe.run.budget_usd else ""),
            "cost plan     "
            + (
                f"${self.cost_plan['usd']:.3g} for {self.cost_plan['steps']} steps "
                f"({self.cost_plan['seconds'] / 3600:.3g} h at an assumed {100 * self.cost_plan['mfu']:.0f}% MFU of "
                f"{self.tracker.peak_flops / 1e12:g} TFLOPS per device)"
                if self.cost_plan
                else f"no estimate: no datasheet peak for {self.cost.device} (pass --peak_tflops for MFU and a plan)"
            ),
        ]
        rule = "-" * 78
        return "\n".join([rule, *lines, rule])

    def train(self, *args, **kwargs):
        if self.is_world_process_zero():
            print(self.header(), flush=True)
            available = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
            warning = planner.not_fitting_warning(self.memory_plan.device_total, available)
            if warning:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.tracker.resume_from(kwargs.get("resume_from_checkpoint"))
        self.tracker.start(self.state)
        output = super().train(*args, **kwargs)
        self.tracker.end_training()
        if self._rows_seen is not None:
            self.write_rank_report()
        return output

    def owner(self) -> dict[str, str]:
        """What a checkpoint of this run records about it (checkpoints.check_output_dir compares it)."""
        return {
            "recipe": self.recipe.recipe_name,
            "model": self.recipe.model.model_name_or_path,
            "engine": checkpoints.engine_of(self.accelerator.distributed_type.value),
            "world_size": self.accelerator.num_processes,
            "global_batch_size": global_batch_size(self.args),
        }

    def _get_output_dir(self, trial) -> str:
        if self._staging:  # while a checkpoint is written: into the staging folder (see checkpoints.py)
            return str(checkpoints.staging_dir(self.args.output_dir))
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written by every rank into OUTPUT/.staging, then published whole by rank 0."""
        staged = checkpoints.staging_dir(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        if self.args.should_save and staged.exists():
            shutil.rmtree(staged)  # left by a save that was killed half-way
        self.accelerator.wait_for_everyone()
        self._staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = False
        self.accelerator.wait_for_everyone()  # every rank's shards are on disk
        if self.args.should_save:
            (staged / SPENT_FILE).write_text(json.dumps(self.tracker.spent()))  # resumed runs add to it
            checkpoints.publish(staged, self.args.output_dir, self.owner())
            # By step, among complete checkpoints only: the newest complete one is never deleted.
            rotate_checkpoints(self.args.output_dir, save_total_limit=self.args.save_total_limit, use_mtime=False)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The final save is always a consolidated Hugging Face folder; checkpoints keep their sharded format."""
        plugin = self.accelerator.state.fsdp_plugin if self.is_fsdp_enabled else None
        if plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type) and not _internal_call:
            # The Trainer writes no weights at all here; gather the shards into one state dict on rank 0.
            self._save(output_dir, state_dict=self.accelerator.get_state_dict(self.model))
            return
        super().save_model(output_dir, _internal_call)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training = "loss" in logs
        logs.update(self.tracker.metrics(self.state, training))
        if training:
            self.health.check(logs, memory_fraction())
        super().log(logs, start_time)
        if self.args.should_save:  # the run's own log, read by `toolkit report`
            with open(Path(self.args.output_dir) / "run_log.jsonl", "a") as f:
                f.write(json.dumps(self.state.log_history[-1]) + "\n")

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset  # with its length column: the one passed here has had it removed
        if self.args.train_sampling_strategy == "group_by_length" and LENGTH in getattr(dataset, "column_names", ()):
            self._length_sampler = GlobalLengthGroupedSampler(
                dataset[LENGTH], global_batch_size(self.args), self.args.data_seed or self.args.seed
            )
            return self._length_sampler
        return super()._get_train_sampler(train_dataset)

    def _run_epoch(self, *args, epoch, **kwargs):
        # A resumed epoch's loader is wrapped by accelerate's skip_first_batches, through which the Trainer's
        # set_epoch no longer reaches the sampler: set it here, before the epoch's order is drawn.
        if self._length_sampler is not None:
            self._length_sampler.set_epoch(epoch)
        return super()._run_epoch(*args, epoch=epoch, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return super().get_batch_samples(TimedIterator(epoch_iterator, self.tracker), num_batches, device)

    def end_of_run(self, status: str, metrics: dict[str, float]) -> dict[str, Any]:
        """Printed, written to OUTPUT/run_summary.json and to the W&B run's summary (rank 0)."""
        summary = self.tracker.summary(self.state)
        s = self.strategy
        summary.update(
            status=status,
            recipe=self.recipe.recipe_name,
            strategy=f"{s['distributed_type']}, {s['sharding']}",
            processes=s["num_processes"],
            device=self.cost.device,
            pricing=self.cost.pricing,
            **{k: v for k, v in metrics.items() if k == "train_loss" or k.startswith("eval_")},
        )
        if not self.is_world_process_zero():
            return summary
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            summary["wandb_run_id"] = wandb.run.id
        mfu = f"{100 * summary['mean_mfu']:.2f}%" if summary.get("mean_mfu") is not None else "n/a (no peak)"
        losses = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in summary.items() if k.endswith("_loss"))
        print(
            f"run summary   {status} after {time.strftime('%H:%M:%S', time.gmtime(summary['wall_seconds']))}, "
            f"{summary['steps']} steps, {summary['tokens']:,} tokens ({summary.get('tokens_per_second', 0):,.0f}/s), "
            f"MFU {mfu}, peak memory {summary['peak_memory_gib']:.2f} GiB" + (f", {losses}" if losses else ""),
            flush=True,
        )
        print(self.cost.summary(self.tracker.elapsed, self.tracker.spent_before), flush=True)
        path = Path(self.args.output_dir) / "run_summary.json"
        path.write_text(json.dumps({"summary": summary, "config": self.run_config()}, indent=1, default=str))
        if wandb is not None and wandb.run is not None:
            wandb.run.summary.update({f"summary/{k}": v for k, v in summary.items()})
        return summary

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Examples in the micro-batch: conversations when packed (counted by the collator, on the host), else rows.
        packed = SEQUENCES in inputs
        self.tracker.count_batch(inputs.pop(SEQUENCES) if packed else len(inputs["input_ids"]))
        if self._rows_seen is not None:  # costs a device sync: only when asked for
            self._rows_seen += [hashlib.sha1(json.dumps(row).encode()).hexdigest()
                                for row in sequences_of(inputs, packed)]  # fmt: skip
        if packed:  # the mask is for the Trainer's token count, after this step; the model must not see it
            mask = inputs.pop("attention_mask")
            loss = super().training_step(model, inputs, num_items_in_batch)
            inputs["attention_mask"] = mask
            return self.check_finite(loss)
        return self.check_finite(super().training_step(model, inputs, num_items_in_batch))

    def check_finite(self, loss: torch.Tensor) -> torch.Tensor:
        # One host sync per micro-batch, the one the Trainer's own NaN filter would make (turned off in
        # toolkit_defaults: it hides a NaN loss behind the running mean).
        if not self.safe_stop.nonfinite_at and not torch.isfinite(loss).item():
            self.safe_stop.nonfinite_at = self.state.global_step + 1
        return loss

    def prediction_step(self, model, inputs, *args, **kwargs):
        if inputs.pop(SEQUENCES, None) is not None:  # packed: see training_step
            inputs.pop("attention_mask", None)
        return super().prediction_step(model, inputs, *args, **kwargs)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state this rank really holds (its shard, under ZeRO-3 or FSDP)."""
        params = sum(nbytes(p) for p in self.model_wrapped.parameters())
        optimizer = self.optimizer
        while hasattr(optimizer, "optimizer"):  # accelerate's wrapper, then DeepSpeed's, then torch's
            optimizer = optimizer.optimizer
        state = sum(
            nbytes(t)
            for per_param in optimizer.state.values()
            for t in per_param.values()
            if torch.is_tensor(t) and t.dim() > 0  # not the scalar step counters
        )
        return {"param_bytes": params, "optimizer_state_bytes": state}

    def write_rank_report(self) -> None:
        """Rows this rank trained on and a digest of the weights it holds, for verifying a distributed run."""
        digest = hashlib.sha256()
        for name, param in sorted(self.model.named_parameters()):  # this rank's shard where sharded
            digest.update(name.encode())
            digest.update(local_tensor(param).detach().float().cpu().numpy().tobytes())
        report = {
            "process_index": self.accelerator.process_index,
            "strategy": self.strategy,
            "rows": self._rows_seen,
            "weights_sha256": digest.hexdigest(),
            "tokens_seen": self.state.num_input_tokens_seen,
            **self.held_bytes(),
            "gradient_bytes": self._gradient_bytes.most,
            "loaded_param_bytes": self.loaded_param_bytes,  # held right after from_pretrained, before sharding
            "loaded_host": self.loaded_host,  # peak host RAM (PSS) added by from_pretrained: anon and file-backed
            "load_host": self.load_host,  # the same through placing and sharding, up to the first step
            "memory_plan": {"device": self.memory_plan.device, "host_per_node": self.memory_plan.host_per_node},
            "losses": [e["loss"] for e in self.state.log_history if "loss" in e],
            "learning_rates": [e["learning_rate"] for e in self.state.log_history if "loss" in e],
        }
        folder = Path(self.args.output_dir) / "rank_reports"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self.accelerator.process_index}.json").write_text(json.dumps(report))
