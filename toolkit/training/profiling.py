"""Trainer part (callback): where a few steps' time goes, with `torch.profiler` (`--profile 5-8`: optimizer steps 5
to 8, counted from 1). Off by default, and then nothing is made: no profiler, no hook, no timed phase.

Each rank writes under OUTPUT/profile/:
  rank{r}.trace.json       the steps' trace (CPU and, on a GPU, CUDA activity, with shapes and memory, and the
                           step's phases as named ranges): it opens in Perfetto (ui.perfetto.dev), chrome://tracing
                           and TensorBoard's profiler plugin
  rank{r}.top.json         the operators by self time, the most first, with their calls
  rank{r}.split.json       the step's split: data wait, sampling (RL), environment (RL in an environment: its
                           calls, apart from sampling), forward, backward, optimizer, other, and the
                           communication in flight (which overlaps them)
  rank{r}.memory.pickle    on a GPU, the CUDA allocator's history over the steps: it opens in PyTorch's memory viewer
                           (pytorch.org/memory_viz)
Rank 0's top operators and split go into the run's summary (run_summary.json, W&B) as `profile_top_ops` and
`profile_split`; `toolkit report` shows the split beside the run's figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..errors import ConfigError, warn

PROFILE_DIR = "profile"
TOP_OPERATORS = 15  # kept in the summary: enough to see where the time goes, few enough to read
# What the process group records of a collective in flight: gloo's work on its own threads (CPU), NCCL's kernels
# (GPU; not "nccl:*", the CPU-side record of the same call)
COLLECTIVES = {False: lambda key: key.startswith("gloo:"),
               True: lambda key: key.startswith("nccl") and not key.startswith("nccl:")}  # fmt: skip


def profiled_steps(setting: str) -> tuple[int, int]:
    """`5-8` (or `5`): the first and last optimizer step to record, counted from 1."""
    first, _, last = setting.partition("-")
    return int(first), int(last or first)


def check_profile_window(setting: str, steps: int, resumed_at: int = 0) -> None:
    """A DATA check, once the run's steps are known: a window that opens after the run's last step, or before the
    step a resume starts from, would record nothing and say nothing (one line); one that closes after the last
    step records up to it (a warning)."""
    first, last = profiled_steps(setting)
    window = f"--profile {setting}"
    if first > steps or first <= resumed_at:
        where = (
            f"this run ends at step {steps}"
            if first > steps
            else f"this run resumes after step {resumed_at}, and the window opens only as its first step starts"
        )
        start = max(resumed_at + 1, steps - 3)
        raise ConfigError(f"{window}: {where}, so nothing would be recorded: pass a window within steps "
                          f"{resumed_at + 1}-{steps} (--profile {start}-{steps}, say), or raise "
                          "--max_steps.")  # fmt: skip
    if last > steps:
        warn(f"{window}: this run ends at step {steps}, so steps {first}-{steps} are recorded; --profile "
             f"{first}-{steps} says so.")  # fmt: skip


class StepProfiler(TrainerCallback):
    """Records from the first step's data fetch to the last step's end. The trainer marks the phases (`phase`):
    each is timed on the wall clock, the device synchronized at its edges while recording (a GPU's work is
    asynchronous: otherwise a phase would be its launches), and named in the trace."""

    def __init__(self, steps: tuple[int, int], output_dir: str):
        self.first, self.last = steps
        self.folder = Path(output_dir) / PROFILE_DIR
        self.profile = None
        self.top: list[dict] = []
        self.split: dict[str, dict] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.started, self.steps, self.optimizer = 0.0, 0, None

    def starting_step(self, step: int) -> None:
        """Called as optimizer step `step` (from 1) fetches its batches: the window opens there."""
        if step == self.first and self.profile is None and not self.steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profile.__enter__()
            self.started = time.perf_counter()

    def phase(self, name: str):
        """A context timing one phase of the step while recording; nothing otherwise."""
        return self._timed(name) if self.profile is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self, name: str):
        synchronize()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"toolkit: {name}"):
                yield
        finally:
            synchronize()
            self.seconds[name] += time.perf_counter() - start

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.profile is not None:
            self.optimizer = self.phase("optimizer")
            self.optimizer.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            optimizer, self.optimizer = self.optimizer, None
            optimizer.__exit__(None, None, None)

    def on_step_end(self, args, state, control, **kwargs):
        if self.profile is not None:
            self.steps += 1
            if state.global_step >= self.last:
                self.finish()

    def on_train_end(self, args, state, control, **kwargs):
        if self.profile is not None:  # the run ended inside the window: what was recorded
            self.finish()

    def finish(self) -> None:
        """Stop recording; write this rank's trace, top operators, split and (GPU) memory history."""
        synchronize()
        window = time.perf_counter() - self.started
        profile, self.profile = self.profile, None
        profile.__exit__(None, None, None)
        rank = int(os.environ.get("RANK", 0))
        self.folder.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.folder / f"rank{rank}.trace.json"))
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        events = profile.key_averages()
        self.top = top_operators(events, on_gpu)
        self.split = step_split(self.seconds, window, communication(events, on_gpu), max(self.steps, 1))
        (self.folder / f"rank{rank}.top.json").write_text(json.dumps(self.top, indent=1) + "\n")
        (self.folder / f"rank{rank}.split.json").write_text(json.dumps(self.split, indent=1) + "\n")
        if rank == 0:  # under the progress bar, where a person looks: where the files are, what took the time
            most = ", ".join(f"{t['name']} {100 * t['share']:.0f}%" for t in self.top[:3])
            print(
                f"\nprofile       steps {self.first}-{self.last} in {self.folder}/rank*.trace.json (Perfetto, "
                f"chrome://tracing); a step: {split_line(self.split)}; self time: {most}",
                flush=True,
            )


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_split(seconds: dict[str, float], window: float, in_flight: float, steps: int) -> dict[str, dict]:
    """The recorded window per optimizer step: milliseconds and share of each phase. `backward` is the micro-batch's
    step less its forward and sampling (the Trainer's training_step runs them in one call), `forward and backward`
    under pipeline stages (the schedule interleaves them); `other` the rest of the window (logging, checkpoints and
    evaluations in it, callbacks); `communication` the collectives in flight, which overlap the phases."""
    step = seconds.get("micro-batch", 0.0)
    forward, sampling = seconds.get("forward", 0.0), seconds.get("sampling", 0.0)
    environment = seconds.get("environment", 0.0)  # an environment's calls, within sampling (training/episodes.py)
    parts = {"data wait": seconds.get("data wait", 0.0), "sampling": sampling - environment,
             "environment": environment, "forward": forward,
             "forward and backward" if step and not forward else "backward": max(step - forward - sampling, 0.0),
             "optimizer": seconds.get("optimizer", 0.0)}  # fmt: skip
    parts = {name: value for name, value in parts.items() if value or name not in ("sampling", "environment")}
    parts["other"] = max(window - sum(parts.values()), 0.0)
    parts["communication"] = in_flight
    return {name: {"ms": 1e3 * value / steps, "share": value / window if window else 0.0}
            for name, value in parts.items()}  # fmt: skip


def split_line(split: dict[str, dict]) -> str:
    return ", ".join(f"{name} {100 * part['share']:.0f}%" for name, part in split.items())


def communication(events, on_gpu: bool) -> float:
    """Seconds the collectives were in flight (their own threads' or kernels' time)."""
    is_collective, key = COLLECTIVES[on_gpu], "self_device_time_total" if on_gpu else "cpu_time_total"
    return sum(getattr(e, key) for e in events if is_collective(e.key)) / 1e6


def top_operators(events, on_gpu: bool) -> list[dict]:
    """The operators by self time (the device's on a GPU, the CPU's otherwise), the most first: name, calls, self
    milliseconds and their share of the recorded self time."""
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = [e for e in events if getattr(e, key, 0) > 0 and not e.key.startswith("toolkit: ")]  # not the phases
    total = sum(getattr(e, key) for e in events) or 1
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TOP_OPERATORS]
    return [{"name": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total}
            for e in ranked]  # fmt: skip
