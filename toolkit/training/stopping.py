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
of three CPU integers over a gloo group: host-side only, no device sync. After training, `SafeStop.outcome` turns
what stopped the run into its exception (`Stopped`, with the exit code); the recipe runner prints and exits.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .checkpoints import complete_checkpoints

PREEMPTED = 75
DIVERGED = 3
BUDGET_SPENT = 4
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Stopped(Exception):
    """Training stopped early, its checkpoints intact. `status` goes into the run summary; the message, if any,
    is printed by rank 0 as `label: message`; the process exits with `exit_code`."""

    status = "stopped"
    exit_code = 1
    label: str | None = None


class Preempted(Stopped):
    """Training stopped on a signal after writing a checkpoint."""

    status, exit_code = "preempted", PREEMPTED


class Diverged(Stopped):
    """The loss became NaN or infinite."""

    status, exit_code, label = "diverged", DIVERGED, "error"


class BudgetSpent(Stopped):
    """Training stopped, with a checkpoint, before passing --budget_usd."""

    status, exit_code, label = "budget", BUDGET_SPENT, "stopped"


class SafeStop(TrainerCallback):
    def __init__(self, over_budget: Callable[[object], bool] = lambda state: False) -> None:
        self.received: int = 0  # the signal number, 0 for none
        self.nonfinite_at: int = 0  # the step whose loss was not finite (note_loss), 0 for none
        self.over_budget = over_budget  # called with the TrainerState at each step end
        self.preempted_at: int | None = None
        self.diverged_at: int | None = None
        self.budget_at: int | None = None
        self.group = None
        self.previous: dict[int, object] = {}

    def handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def note_loss(self, loss: torch.Tensor, step: int) -> None:
        """A micro-batch's loss: a non-finite one marks `step` (the optimizer step it belongs to). One host read per
        micro-batch, the one the Trainer's own NaN filter would make; that filter is off (settings/parser.py's
        defaults), since it hides a NaN loss behind the running mean and trains on."""
        if not self.nonfinite_at and not torch.isfinite(loss).item():
            self.nonfinite_at = step

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
        if state.global_step >= state.max_steps:
            # The last step always logs: the Trainer's final train_loss adds the loss since the last log as rank 0
            # alone saw it (2.539 for a 2-process FSDP run whose ranks averaged 2.675), a log averages all ranks.
            control.should_log = True
        return control

    def outcome(self, trainer) -> Stopped | None:
        """After `trainer.train()`: what stopped the run, as its exception, or None for a run that completed."""
        args = trainer.args
        if self.diverged_at is not None:
            kept = [c for c in complete_checkpoints(args.output_dir) if int(c.name.split("-")[1]) < self.diverged_at]
            trainer.health.warn("nonfinite", f"loss not finite at step {self.diverged_at}: run stopped")
            return Diverged(
                f"the loss is not finite at step {self.diverged_at} (learning rate {args.learning_rate:.3g}); "
                f"training stopped without saving over the earlier checkpoints (newest: "
                f"{kept[-1] if kept else 'none'}). Likely causes: a learning rate too high (lower --learning_rate, "
                "add --warmup_steps), fp16 overflow (use --bf16 true instead of --fp16), or a batch without a "
                "single label token."
            )
        if self.preempted_at is not None:
            if trainer.is_world_process_zero():
                print(f"preempted at step {self.preempted_at}: {args.output_dir}/checkpoint-{self.preempted_at} "
                      "written; continue with --resume auto", flush=True)  # fmt: skip
            return Preempted(self.preempted_at)
        if self.budget_at is not None:
            return BudgetSpent(
                f"budget reached: ${trainer.tracker.usd():.4g} spent of --budget_usd "
                f"{trainer.recipe.run.budget_usd:g} (the next step would pass it); stopped after step "
                f"{self.budget_at} of {trainer.state.max_steps} with {args.output_dir}/checkpoint-{self.budget_at} "
                "written. To finish, raise --budget_usd and add --resume auto: the cost so far is carried over."
            )
        return None

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
