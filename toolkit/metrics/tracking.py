"""Live throughput, MFU, memory and cost on every training log line (console, log_history, W&B alike), and the
end-of-run summary.

Every rank computes the same figures; rank 0's are logged. Over each logging interval:
  tokens_per_second   non-padding tokens of all ranks / training seconds. Each rank adds up its micro-batches'
                      attention masks on its device, unread; the sum over ranks is taken once per log line and
                      checkpoint (one all-reduce), so it is exact under gradient accumulation and across processes.
  samples_per_second  rows of this rank's micro-batches x processes (accelerate gives every rank equal batches)
  step_seconds        training seconds / optimizer steps
  mfu                 model FLOPs per token x tokens/s / (devices x dense peak FLOP/s of one device), where
                      FLOPs per token = 6 N_trainable + 4 N_frozen + 12 L H T at T = tokens per row, N the
                      parameters a token passes through (an MoE's shared and k of E routed experts)
                      (planner.training_flops_per_token; PaLM appendix B). Only with a known peak.
  data_wait_share     share of the training time spent waiting for the next batch
  sampling_*          GRPO: the share of the time spent sampling completions, the completion tokens rank 0 sampled a
                      second, and training_tokens_per_second, the step's tokens over the rest of the time
  peak_memory_gib     GPU: torch.cuda.max_memory_allocated; CPU: the process's peak resident set
  cost_usd            unit-hours so far x price x overhead (cost.CostModel), plus what the earlier segments of a
                      resumed run spent (stored in each checkpoint); also the projected total at this pace and
                      dollars per million tokens.
Training seconds are wall seconds from the Trainer's start of training (`on_train_begin`, on the state it resumes
from), evaluations left out (`paused`); the bill runs from the call to `train` to the end, evaluations included.
Nothing here waits on the device between log lines: the token count stays on the device, the rest is host clocks.
The trainer (training/trainer.py) feeds a RunTracker and writes the end-of-run summary from it; the figures are
computed in figures.py.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerState

from .cost import CostModel
from .figures import RunFigures

SPENT_FILE = "toolkit_cost.json"  # in every checkpoint: what the run had cost when it was written


class RunTracker(RunFigures, TrainerCallback):
    def __init__(self, cost: CostModel, num_processes: int, flops_per_token: Callable[[float], float],
                 peak_flops: float | None, model_parallel: int = 1, sliced: int = 1):  # fmt: skip
        self.cost = cost
        self.num_processes = num_processes  # devices: throughput per device and MFU divide by all of them
        self.model_parallel = model_parallel  # ranks that train on one batch together (tp x cp x sp): counted once
        self.sliced = sliced  # of those, ranks handed a slice of each row, not the row (sp: DeepSpeed's loader)
        self.flops_per_token = flops_per_token  # of the mean row length
        self.peak_flops = peak_flops  # per device, FLOP/s; None: no MFU
        self.started: float | None = None  # the bill's start: the call to train()
        self.training_started: float | None = None  # on_train_begin: throughput counts from here
        self.training_ended: float | None = None  # throughput counts training only; cost runs on to the end
        self.spent_before = {"usd": 0.0, "unit_hours": 0.0}  # earlier segments of a resumed run
        self.samples = 0  # rows trained on in this segment, all ranks
        self.data_seconds = 0.0
        self.paused_seconds = 0.0  # evaluations during training
        self.sampling_seconds = 0.0  # GRPO's sampling of completions: part of the step, not of its training
        self.sampled_tokens = 0  # the completions' tokens this rank sampled
        self._unread_tokens: torch.Tensor | None = None  # this rank's since the last reduction, on its device
        self._tokens = 0  # every rank's in this segment, as of the last reduction
        self._mark: dict[str, float] = {}
        self._start_step = self._start_tokens = 0

    # ------------------------------------------------------------------ feeding it
    def resume_from(self, checkpoint: str | None) -> None:
        path = Path(checkpoint or "") / SPENT_FILE
        if checkpoint and path.is_file():
            self.spent_before = json.loads(path.read_text())

    def start(self) -> None:
        """The bill starts: train() was called (preparing the model and optimizer is paid for too)."""
        self.started = time.perf_counter()

    def on_train_begin(self, args, state: TrainerState, control, **kwargs):
        # The Trainer has loaded a resumed run's state by now: its step and tokens are where this segment starts.
        self.training_started = time.perf_counter()
        self._start_step, self._start_tokens = state.global_step, state.num_input_tokens_seen
        self._mark = self._now(state)

    def on_train_end(self, args, state: TrainerState, control, **kwargs):
        self.reduce_tokens(state)
        self.training_ended = time.perf_counter()

    def count_batch(self, rows: int, tokens: torch.Tensor | int) -> None:
        """A micro-batch of `rows` examples and `tokens` real tokens (a device tensor: added there, not read)."""
        self.samples += rows * (self.num_processes // self.model_parallel)
        self._unread_tokens = tokens if self._unread_tokens is None else self._unread_tokens + tokens

    def reduce_tokens(self, state: TrainerState) -> None:
        """Every rank's tokens so far into `state.num_input_tokens_seen` (which checkpoints keep): one all-reduce
        and one read of the device, on every rank at the same points (each log line, each checkpoint, the end).
        The state's count is set, not added to: the Trainer's own count (`include_num_input_tokens_seen`, off by
        the toolkit's defaults) cannot count a token twice."""
        unread, self._unread_tokens = self._unread_tokens, None
        if self.num_processes > 1 and dist.is_available() and dist.is_initialized():
            total = torch.as_tensor(0 if unread is None else unread, dtype=torch.int64)
            if unread is None or not torch.is_tensor(unread):  # nothing on a device yet: the group's own device
                total = total.to(_group_device())
            dist.all_reduce(total)
            unread = total
        if unread is not None:  # the ranks of a tensor or context parallel group counted the same rows
            self._tokens += int(unread) // (self.model_parallel // self.sliced)
        if self.training_started is not None:
            state.num_input_tokens_seen = self._start_tokens + self._tokens

    def count_data_wait(self, seconds: float) -> None:
        self.data_seconds += seconds

    @contextlib.contextmanager
    def paused(self):
        """An evaluation during training: its seconds are not training seconds (the bill runs on)."""
        if self.training_started is None or self.training_ended is not None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def sampling(self):
        """Completions sampled during a step (GRPO): counted apart, so tokens/s and MFU of the training part can
        be told from the whole step's. The caller adds the tokens it sampled (`count_sampled`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sampling_seconds += time.perf_counter() - start

    def count_sampled(self, tokens: int) -> None:
        self.sampled_tokens += tokens

    def _now(self, state: TrainerState) -> dict[str, float]:
        return {"time": time.perf_counter(), "tokens": state.num_input_tokens_seen, "samples": self.samples,
                "step": state.global_step, "data": self.data_seconds, "paused": self.paused_seconds,
                "sampling": self.sampling_seconds, "sampled": self.sampled_tokens}  # fmt: skip

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
        """Mean cost of one optimizer step in this segment, what its set-up and evaluations cost included (0 before
        the first step)."""
        steps = state.global_step - self._start_step if self.training_started is not None else 0
        return (self.cost.usd(self.elapsed) or 0.0) / steps if steps else 0.0

    def spent(self) -> dict[str, float | None]:
        elapsed = self.elapsed
        return {"usd": self.usd(elapsed), "unit_hours": self.unit_hours(elapsed)}

    # ------------------------------------------------------------------ log lines

    # ------------------------------------------------------------------ end of run


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


def _group_device() -> torch.device:
    """The device the default process group's collectives take tensors on (NCCL: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
