"""Trainer part (callback): where a few steps' time goes, with `torch.profiler` (`--profile 5-8`: optimizer steps 5
to 8, counted from 1). Off by default, and then nothing is made: no profiler, no hook.

Each rank writes under OUTPUT/profile/:
  rank{r}.trace.json       the steps' trace (CPU and, on a GPU, CUDA activity, with shapes and memory): it opens in
                           Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin
  rank{r}.top.json         the operators by self time, the most first, with their calls
  rank{r}.memory.pickle    on a GPU, the CUDA allocator's history over the steps: it opens in PyTorch's memory viewer
                           (pytorch.org/memory_viz)
Rank 0's top operators go into the run's summary (run_summary.json, W&B) as `profile_top_ops`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import TrainerCallback

PROFILE_DIR = "profile"
TOP_OPERATORS = 15  # kept in the summary: enough to see where the time goes, few enough to read


def profiled_steps(setting: str) -> tuple[int, int]:
    """`5-8` (or `5`): the first and last optimizer step to record, counted from 1."""
    first, _, last = setting.partition("-")
    return int(first), int(last or first)


class StepProfiler(TrainerCallback):
    def __init__(self, steps: tuple[int, int], output_dir: str):
        self.first, self.last = steps
        self.folder = Path(output_dir) / PROFILE_DIR
        self.profile = None
        self.top: list[dict] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.first and self.profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profile.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profile is not None and state.global_step >= self.last:
            self.finish()

    def on_train_end(self, args, state, control, **kwargs):
        if self.profile is not None:  # the run ended inside the window: what was recorded
            self.finish()

    def finish(self) -> None:
        """Stop recording; write this rank's trace, top operators and (GPU) memory history."""
        profile, self.profile = self.profile, None
        profile.__exit__(None, None, None)
        rank = int(os.environ.get("RANK", 0))
        self.folder.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.folder / f"rank{rank}.trace.json"))
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.top = top_operators(profile, on_gpu)
        (self.folder / f"rank{rank}.top.json").write_text(json.dumps(self.top, indent=1) + "\n")
        if rank == 0:  # under the progress bar, where a person looks: where the files are, what took the time
            most = ", ".join(f"{t['name']} {100 * t['share']:.0f}%" for t in self.top[:3])
            print(
                f"\nprofile       steps {self.first}-{self.last} in {self.folder}/rank*.trace.json (Perfetto, "
                f"chrome://tracing); self time: {most}",
                flush=True,
            )


def top_operators(profile, on_gpu: bool) -> list[dict]:
    """The operators by self time (the device's on a GPU, the CPU's otherwise), the most first: name, calls, self
    milliseconds and their share of the recorded self time."""
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = [e for e in profile.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events) or 1
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TOP_OPERATORS]
    return [{"name": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total}
            for e in ranked]  # fmt: skip
