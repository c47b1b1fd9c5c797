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
"""

from __future__ import annotations

import json
import re
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerState

from .cost import CostModel

GIB = 2**30
SPENT_FILE = "toolkit_cost.json"  # in every checkpoint: what the run had cost when it was written


def peak_host_bytes() -> int:
    """This process's peak resident set so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class HostMemoryPeak:
    """Peak host RAM of this process above a starting point, sampled every few milliseconds by a thread, split
    into anonymous memory (what the process allocated: tensors, copies) and file-backed pages (a memory-mapped
    checkpoint: page cache, shared between ranks that map the same file and reclaimable by the kernel). RSS lumps
    the two together and counts shared pages in every rank; PSS (proportional set size) splits each shared page
    between the processes mapping it, so PSS summed over ranks is the physical memory they use together.
    Linux only (/proc/self/smaps_rollup); elsewhere the peaks stay None. `series` keeps (unix time, anon, file)
    at every change of a MiB or more, so peaks summed over ranks at the same moment can be computed afterwards."""

    FIELDS = ("Pss_Anon", "Pss_File")

    def __init__(self, interval_s: float = 0.005):
        self.peaks: dict[str, int] | None = None
        self.series: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._base = self._read()
        if self._base is None:
            return
        self.peaks = dict.fromkeys(self.FIELDS, 0)
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True)
        self._thread.start()

    @classmethod
    def _read(cls) -> dict[str, int] | None:
        try:
            text = Path("/proc/self/smaps_rollup").read_text()
        except OSError:
            return None
        found = dict(re.findall(r"^(\w+):\s+(\d+) kB", text, flags=re.MULTILINE))
        return {field: int(found.get(field, 0)) * 1024 for field in cls.FIELDS}

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._update()

    def _update(self) -> None:
        now = self._read()
        if now is None:
            return
        added = [now[field] - self._base[field] for field in self.FIELDS]
        for field, value in zip(self.FIELDS, added, strict=True):
            self.peaks[field] = max(self.peaks[field], value)
        if not self.series or max(abs(a - b) for a, b in zip(added, self.series[-1][1:], strict=True)) >= 2**20:
            self.series.append((time.time(), *added))

    def current(self) -> dict[str, int] | None:
        """The peaks so far above the start, in bytes: {"anon": ..., "file": ...}."""
        if self.peaks is None:
            return None
        self._update()
        return {"anon": self.peaks["Pss_Anon"], "file": self.peaks["Pss_File"]}

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling; the peaks above the start, and the series."""
        if self.peaks is None:
            return None
        self._stop.set()
        self._thread.join()
        return {**self.current(), "series": self.series}


def peak_over_ranks(series: list[list[tuple[float, int, int]]], field: int) -> int:
    """The most that several processes held at one moment, from their HostMemoryPeak series (field 1: anonymous,
    2: file-backed); each process holds its last sample until the next."""
    events = sorted((point[0], rank, point[field]) for rank, points in enumerate(series) for point in points)
    held = [0] * len(series)
    most = 0
    for _, rank, value in events:
        held[rank] = value
        most = max(most, sum(held))
    return most


def peak_memory_bytes() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else peak_host_bytes()


def memory_fraction() -> float:
    """How full the device is: reserved / total on a GPU, the host's RAM in use on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / torch.cuda.get_device_properties(0).total_memory
    import psutil

    return psutil.virtual_memory().percent / 100


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
