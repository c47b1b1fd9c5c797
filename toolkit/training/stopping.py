"""Stopping a run early without losing or corrupting what it trained.

Preemption: on SIGTERM (a spot instance's notice, `kill`, the launcher shutting down) or SIGUSR1 (SLURM's
warning before the time limit), every rank finishes its optimizer step, a checkpoint is written, and the
process exits with PREEMPTED (75, EX_TEMPFAIL: "try again") so a scheduler can requeue it; `--resume auto` then
continues from that checkpoint. The handler only sets a flag: a second signal during the save changes nothing,
and the checkpoint is published whole or not at all (checkpoints.py).

Divergence: a non-finite loss stops the run, without a checkpoint of the weights that produced it, keeping the
earlier ones, and exits with DIVERGED (3) and a message naming the step and the likely causes. Each micro-batch's
loss is checked on the device, unread; the first bad step is read at the end of a step that logs, evaluates,
saves or stops (as the Trainer reads its loss only to log it), so no checkpoint or evaluation ever sees the weights
a non-finite loss produced, and no other step waits on the device.

No rewards (GRPO): a step whose every reward returned None for every completion trains on nothing (TRL gives each
such completion no advantage): the first of a stretch of them is one warning line; NO_REWARD_STEPS of them in a
row stop the run as a non-finite loss does: no checkpoint of the step it stops at, the earlier ones kept, exit
DIVERGED (3).

Budget: when the next step would take the run's cost past --budget_usd, every rank stops after this step, a
checkpoint is written, and the process exits with BUDGET_SPENT (4); raising the budget and `--resume auto`
continue the run, its cost so far carried over.

Ranks see a signal, a NaN or the budget at different times, so at each step end they agree with an all-reduce of
CPU integers over a gloo group (a second one, for the loss, at the steps that read it): host-side only. After
training, `SafeStop.outcome` turns what stopped the run into its exception (`Stopped`, with the exit code); the
recipe runner prints and exits.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..distributed.launch import release_deepspeed_shm
from ..errors import BUDGET_SPENT, DIVERGED, PREEMPTED, PREEMPTION_SIGNALS, warn
from ..metrics.cost import dollars
from .checkpoints import complete_checkpoints

SIGNALS = PREEMPTION_SIGNALS
# GRPO steps in a row whose every reward was None before the run stops: one or two can be a batch no reward had an
# opinion on; three in a row is a reward that judges nothing, and every step more is paid for and learns nothing.
NO_REWARD_STEPS = 3


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


class NoRewards(Stopped):
    """GRPO: every reward returned None for every completion, NO_REWARD_STEPS steps in a row."""

    status, exit_code, label = "no_rewards", DIVERGED, "error"


class BudgetSpent(Stopped):
    """Training stopped, with a checkpoint, before passing --budget_usd."""

    status, exit_code, label = "budget", BUDGET_SPENT, "stopped"


class SafeStop(TrainerCallback):
    def __init__(self, over_budget: Callable[[object], bool] = lambda state: False) -> None:
        self.received: int = 0  # the signal number, 0 for none
        self.nonfinite_at: int = 0  # the step whose loss was not finite (read_losses), 0 for none
        self._first_bad: torch.Tensor | None = None  # the same, on the device, unread (note_loss)
        self.over_budget = over_budget  # called with the TrainerState at each step end
        self.preempted_at: int | None = None
        self.diverged_at: int | None = None
        self.budget_at: int | None = None
        self.unjudged: int = 0  # GRPO: steps in a row whose every reward was None (note_rewards)
        self.unjudged_at: int | None = None  # the step that made them NO_REWARD_STEPS
        self.group = None
        self.previous: dict[int, object] = {}

    def handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def note_loss(self, loss: torch.Tensor, step: int) -> None:
        """A micro-batch's loss: a non-finite one marks `step` (the optimizer step it belongs to), on the loss's
        device, unread. (The Trainer's own NaN filter, which reads every loss, is off: settings/parser.py's
        defaults, since it hides a NaN loss behind the running mean and trains on.)"""
        bad_step = torch.where(torch.isfinite(loss.detach()), 0, step)
        first = self._first_bad
        self._first_bad = bad_step if first is None else torch.where(first > 0, first, bad_step)

    def read_losses(self) -> int:
        """The first step whose loss was not finite on this rank, 0 for none: one read of the device."""
        if not self.nonfinite_at and self._first_bad is not None:
            self.nonfinite_at = int(self._first_bad)
        return self.nonfinite_at

    def note_rewards(self, judged: bool, step: int, completions: int) -> None:
        """GRPO, at each step's sampling: whether any reward judged any of its completions. TRL's rewards are
        gathered over the ranks, so every rank counts the same steps and stops at the same one."""
        if judged:
            self.unjudged = 0
            return
        self.unjudged += 1
        if self.unjudged == 1:  # once a stretch, not once a step
            warn(f"step {step}: every reward returned None for all {completions} completions, so it trains on "
                 f"nothing (no advantages); {NO_REWARD_STEPS} such steps in a row stop the run.")  # fmt: skip
        if self.unjudged >= NO_REWARD_STEPS and self.unjudged_at is None:
            self.unjudged_at = step

    def on_train_begin(self, args, state, control, **kwargs):
        # Kept until uninstall(): a signal during the final save must not cut it short. Python takes handlers only
        # on the main thread; a Ray Train worker runs the recipe on another, and Ray restarts it (clusters/).
        for sig in SIGNALS if threading.current_thread() is threading.main_thread() else ():
            self.previous[sig] = signal.signal(sig, self.handle)
        if dist.is_available() and dist.is_initialized():
            # A CPU group for the flags: on GPUs the default group is NCCL, whose collectives wait on the device.
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        release_deepspeed_shm()  # the engine exists now; the process group's housekeeping at the start is here

    def diverged(self, control, read: bool = False) -> bool:
        """Before the weights are logged, evaluated, saved or kept (`read`): did a loss turn non-finite on any rank?
        If so, the run stops without a checkpoint or an evaluation of them. Every rank asks at the same steps."""
        if not (read or control.should_log or control.should_save or control.should_evaluate):
            return False
        (nonfinite_at,) = self.agreed(self.read_losses())
        if nonfinite_at and self.diverged_at is None:
            self.diverged_at = nonfinite_at
            control.should_save = control.should_evaluate = False  # never the weights that produced it
            control.should_training_stop = True
        return bool(nonfinite_at)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.diverged(control)  # an epoch's end may log, evaluate or save on its own

    def agreed(self, *flags: int) -> list[int]:
        """Each flag's largest value over the ranks (the tensor lives on the host: reading it waits on no device)."""
        if self.group is None:
            return list(flags)
        values = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values.tolist()

    def on_step_end(self, args, state, control, **kwargs):
        signum, over_budget = self.agreed(self.received, int(self.over_budget(state)))
        last = state.global_step >= state.max_steps
        if self.diverged(control, read=bool(signum or over_budget or last)):
            return control
        if self.unjudged_at is not None:  # a step that learned nothing: no checkpoint of it
            control.should_save = control.should_evaluate = False
            control.should_training_stop = True
            return control
        if signum and self.preempted_at is None:
            self.preempted_at = state.global_step
            self.received = signum
            control.should_save = True  # whatever save_strategy says
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"received {signal.Signals(signum).name}: step {state.global_step} finished, saving a "
                      "checkpoint, then exiting", file=sys.stderr, flush=True)  # fmt: skip
        elif over_budget and self.budget_at is None and not last:
            self.budget_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        if last:
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
        if self.unjudged_at is not None:
            first = self.unjudged_at - NO_REWARD_STEPS + 1
            kept = complete_checkpoints(args.output_dir)  # the newest is what --resume auto continues from
            trainer.health.warn("no_rewards", f"no reward judged any completion at steps {first}-{self.unjudged_at}: "
                                "run stopped")  # fmt: skip
            return NoRewards(
                f"every reward returned None for every completion at steps {first}-{self.unjudged_at}: there is "
                f"nothing to learn from, so training stopped (newest checkpoint: {kept[-1] if kept else 'none'}). "
                "Make the rewards return a number for the completions they can judge (None only for those they "
                "cannot), then --resume auto."
            )
        if self.preempted_at is not None:
            if trainer.is_world_process_zero():
                print(f"preempted at step {self.preempted_at}: {args.output_dir}/checkpoint-{self.preempted_at} "
                      "written; continue with --resume auto", flush=True)  # fmt: skip
            return Preempted(self.preempted_at)
        if self.budget_at is not None:
            return BudgetSpent(
                f"budget reached: {dollars(trainer.tracker.usd(), 4)} spent of --budget_usd "
                f"{trainer.recipe.run.budget_usd:g} (the next step would pass it); stopped after step "
                f"{self.budget_at} of {trainer.state.max_steps} with {args.output_dir}/checkpoint-{self.budget_at} "
                "written. To finish, raise --budget_usd and add --resume auto: the cost so far is carried over."
            )
        return None

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
