"""Live throughput, MFU, memory and cost on every training log line (console, log_history, W&B alike), and the
end-of-run summary.

Every rank computes the same figures; rank 0's are logged. Over each logging interval:
  tokens_per_second   non-padding tokens of all ranks / wall seconds. The Trainer's own `num_input_tokens_seen`
                      ("non_padding" mode) sums each micro-batch's attention mask gathered over ranks, so it is
                      right under gradient accumulation and across processes.
  samples_per_second  rows of this rank's micro-batches x processes (accelerate gives every rank equal batches)
  step_seconds        wall seconds / optimizer steps
  mfu                 model FLOPs per token x tokens/s / (devices x dense peak FLOP/s of one device), where
                      FLOPs per token = 6 N_trainable + 4 N_frozen + 12 L H T at T = tokens per row
                      (planner.training_flops_per_token; PaLM appendix B). Only with a known peak.
  data_wait_share     share of the wall time spent waiting for the next batch
  peak_memory_gib     GPU: torch.cuda.max_memory_allocated; CPU: the process's peak resident set
  cost_usd            unit-hours so far x price x overhead (cost.CostModel), plus what the earlier segments of a
                      resumed run spent (stored in each checkpoint); also the projected total at this pace and
                      dollars per million tokens.
Nothing here waits on the device: the token count is the Trainer's own gather, the rest is host clocks.
The trainer (training/trainer.py) feeds a RunTracker and writes the end-of-run summary from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerState

from .cost import CostModel
from .memory import GIB, peak_memory_bytes

SPENT_FILE = "toolkit_cost.json"  # in every checkpoint: what the run had cost when it was written


def mfu(flops_per_token: float, tokens_per_second: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the job's dense peak FLOP/s."""
    return flops_per_token * tokens_per_second / (devices * peak_flops)


class RunTracker:
    def __init__(self, cost: CostModel, num_processes: int, flops_per_token: Callable[[float], float],
                 peak_flops: float | None):  # fmt: skip
        self.cost = cost
        self.num_processes = num_processes
        self.flops_per_token = flops_per_token  # of the mean row length
        self.peak_flops = peak_flops  # per device, FLOP/s; None: no MFU
        self.started: float | None = None
        self.training_ended: float | None = None  # throughput counts training only; cost runs on to the end
        self.spent_before = {"usd": 0.0, "unit_hours": 0.0}  # earlier segments of a resumed run
        self.samples = 0  # rows trained on in this segment, all ranks
        self.data_seconds = 0.0
        self._mark: dict[str, float] = {}

    # ------------------------------------------------------------------ feeding it
    def resume_from(self, checkpoint: str | None) -> None:
        path = Path(checkpoint or "") / SPENT_FILE
        if checkpoint and path.is_file():
            self.spent_before = json.loads(path.read_text())

    def start(self, state: TrainerState) -> None:
        self.started = time.perf_counter()
        self._start_step, self._start_tokens = state.global_step, state.num_input_tokens_seen
        self._mark = self._now(state)

    def end_training(self) -> None:
        self.training_ended = time.perf_counter()

    def count_batch(self, rows: int) -> None:
        self.samples += rows * self.num_processes

    def count_data_wait(self, seconds: float) -> None:
        self.data_seconds += seconds

    def _now(self, state: TrainerState) -> dict[str, float]:
        return {"time": time.perf_counter(), "tokens": state.num_input_tokens_seen, "samples": self.samples,
                "step": state.global_step, "data": self.data_seconds}  # fmt: skip

    # ------------------------------------------------------------------ cost
    @property
    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started

    def unit_hours(self, elapsed: float | None = None) -> float:
        return self.spent_before["unit_hours"] + self.cost.unit_hours(self.elapsed if elapsed is None else elapsed)

    def usd(self, elapsed: float | None = None) -> float | None:
        usd = self.cost.usd(self.elapsed if elapsed is None else elapsed)
        return None if usd is None else self.spent_before["usd"] + usd

    def step_usd(self, state: TrainerState) -> float:
        """Mean cost of one optimizer step in this segment (0 before the first)."""
        steps = state.global_step - self._start_step if self.started is not None else 0
        return (self.cost.usd(self.elapsed) or 0.0) / steps if steps else 0.0

    def spent(self) -> dict[str, float | None]:
        elapsed = self.elapsed
        return {"usd": self.usd(elapsed), "unit_hours": self.unit_hours(elapsed)}

    # ------------------------------------------------------------------ log lines
    def metrics(self, state: TrainerState, training: bool) -> dict[str, float]:
        """Metrics for one log line; `training` is False for evaluation logs, which get no throughput."""
        if self.started is None:
            return {}
        elapsed = self.elapsed  # one clock reading: hours and dollars agree exactly
        out: dict[str, float] = {f"{self.cost.unit.lower()}_hours": self.unit_hours(elapsed)}
        usd = self.usd(elapsed)
        if usd is not None:
            out["cost_usd"] = usd
            if state.num_input_tokens_seen:
                out["usd_per_million_tokens"] = usd / state.num_input_tokens_seen * 1e6
            if state.max_steps > 0:
                out["cost_projected_usd"] = usd + self.step_usd(state) * (state.max_steps - state.global_step)
        now, last = self._now(state), self._mark
        seconds = now["time"] - last["time"]
        if training and seconds > 0 and now["step"] > last["step"]:
            tokens, samples = now["tokens"] - last["tokens"], now["samples"] - last["samples"]
            out.update(self.throughput(tokens, samples, seconds, now["step"] - last["step"]))
            out["data_wait_share"] = (now["data"] - last["data"]) / seconds
            out["peak_memory_gib"] = peak_memory_bytes() / GIB
            self._mark = now
        return out

    def throughput(self, tokens: int, samples: int, seconds: float, steps: int) -> dict[str, float]:
        out = {
            "tokens_per_second": tokens / seconds,
            "tokens_per_second_per_device": tokens / seconds / self.num_processes,
            "samples_per_second": samples / seconds,
            "step_seconds": seconds / steps,
        }
        if self.peak_flops and samples:
            out["mfu"] = mfu(self.flops_per_token(tokens / samples), tokens / seconds, self.num_processes,
                             self.peak_flops)  # fmt: skip
        return out

    # ------------------------------------------------------------------ end of run
    def summary(self, state: TrainerState) -> dict[str, Any]:
        """The whole segment's figures (mean MFU over all its tokens), plus the run's cost including resumes."""
        steps, tokens = state.global_step - self._start_step, state.num_input_tokens_seen - self._start_tokens
        seconds = (self.training_ended or time.perf_counter()) - self.started
        elapsed = self.elapsed
        out: dict[str, Any] = {
            "wall_seconds": elapsed,
            "training_seconds": seconds,
            "steps": state.global_step,
            "tokens": state.num_input_tokens_seen,
            "unit": self.cost.unit,
            "unit_hours": self.unit_hours(elapsed),
            "cost_usd": self.usd(elapsed),
            "peak_memory_gib": peak_memory_bytes() / GIB,
        }
        if seconds > 0 and steps > 0:
            rates = self.throughput(tokens, self.samples, seconds, steps)
            out["tokens_per_second"] = rates["tokens_per_second"]
            out["mean_mfu"] = rates.get("mfu")
        return out


class TimedIterator:
    """Wraps the Trainer's epoch iterator: the time spent in `next` is the wait for data."""

    def __init__(self, iterator, tracker: RunTracker):
        self.iterator, self.tracker = iterator, tracker

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.tracker.count_data_wait(time.perf_counter() - start)
