"""Trainer part: what a run tells: each log line with the tracker's, the routers' and the load-balancing loss's
figures and health judged, appended to OUTPUT/run_log.jsonl; the budget asked at each step; the header's task lines;
the run's config as W&B and the summary keep it; the summary at its end (printed, OUTPUT/run_summary.json, W&B)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..metrics.memory import memory_fraction
from ..metrics.samples import RUN_LOG
from ..metrics.wandb_run import finish_run, launch_environment, redacted_command
from ..outputs import SUMMARY
from ..settings.arguments import global_batch_size
from .rank_reports import held_bytes
from .stopping import Stopped


class Reporting:
    """The run's log lines, summary and config."""

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
        if self.profiler is not None and self.profiler.top:  # this rank's; rank 0's is the one written
            summary.update(profile_top_ops=self.profiler.top, profile_split=self.profiler.split)
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
