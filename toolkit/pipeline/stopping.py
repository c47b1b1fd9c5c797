"""Stopping a run early without losing or corrupting what it trained.

Preemption: on SIGTERM (a spot instance's notice, `kill`, the launcher shutting down) or SIGUSR1 (SLURM's
warning before the time limit), every rank finishes its optimizer step, a checkpoint is written, and the
process exits with PREEMPTED (75, EX_TEMPFAIL: "try again") so a scheduler can requeue it; `--resume auto` then
continues from that checkpoint. The handler only sets a flag: a second signal during the save changes nothing,
and the checkpoint is published whole or not at all (checkpoints.py).

Divergence: a non-finite loss stops the run at once, without a checkpoint of the weights that produced it,
keeping the earlier ones, and exits with DIVERGED (3) and a message naming the step and the likely causes.

Budget: when the next step would take the run's cost past --budget_usd, every rank stops after this step, a
checkpoint is written, and the process exits with BUDGET_SPENT (4); raising the budget and `--resume auto`
continue the run, its cost so far carried over.

Ranks see a signal, a NaN or the budget at different times, so at each step end they agree with one all-reduce
of three CPU integers over a gloo group: host-side only, no device sync.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import TrainerCallback

PREEMPTED = 75
DIVERGED = 3
BUDGET_SPENT = 4
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Training stopped on a signal after writing a checkpoint; the process should exit with PREEMPTED."""


class Diverged(Exception):
    """The loss became NaN or infinite; the process should exit with DIVERGED."""


class BudgetSpent(Exception):
    """Training stopped, with a checkpoint, before passing --budget_usd; the process exits with BUDGET_SPENT."""


class SafeStop(TrainerCallback):
    def __init__(self, over_budget: Callable[[object], bool] = lambda state: False) -> None:
        self.received: int = 0  # the signal number, 0 for none
        self.nonfinite_at: int = 0  # the step whose loss was not finite (set by RecipeTrainer), 0 for none
        self.over_budget = over_budget  # called with the TrainerState at each step end
        self.preempted_at: int | None = None
        self.diverged_at: int | None = None
        self.budget_at: int | None = None
        self.group = None
        self.previous: dict[int, object] = {}

    def handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in SIGNALS:  # kept until uninstall(): a signal during the final save must not cut it short
            self.previous[sig] = signal.signal(sig, self.handle)
        if dist.is_available() and dist.is_initialized():
            # A CPU group for the flags: on GPUs the default group is NCCL, whose collectives wait on the device.
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def agreed(self, over_budget: bool) -> tuple[int, int, bool]:
        """The flags of every rank, combined (the tensor lives on the host: reading it waits on no device)."""
        if self.group is None:
            return self.received, self.nonfinite_at, over_budget
        flags = torch.tensor([self.received, self.nonfinite_at, int(over_budget)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return int(flags[0]), int(flags[1]), bool(flags[2])

    def on_step_end(self, args, state, control, **kwargs):
        signum, nonfinite_at, over_budget = self.agreed(self.over_budget(state))
        if nonfinite_at and self.diverged_at is None:
            self.diverged_at = nonfinite_at
            control.should_save = False  # never a checkpoint of the weights that produced it
            control.should_training_stop = True
        elif signum and self.preempted_at is None:
            self.preempted_at = state.global_step
            self.received = signum
            control.should_save = True  # whatever save_strategy says
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"received {signal.Signals(signum).name}: step {state.global_step} finished, saving a "
                      "checkpoint, then exiting", file=sys.stderr, flush=True)  # fmt: skip
        elif over_budget and self.budget_at is None and state.global_step < state.max_steps:
            self.budget_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
