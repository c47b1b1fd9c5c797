"""Preemption: on SIGTERM (a spot instance's notice, `kill`, the launcher shutting down) or SIGUSR1 (SLURM's
warning before the time limit), every rank finishes its optimizer step, a checkpoint is written, and the
process exits with PREEMPTED (75, EX_TEMPFAIL: "try again") so a scheduler can requeue it; `--resume auto`
then continues from that checkpoint.

The handler only sets a flag: a second signal during the save changes nothing, and the checkpoint itself is
published whole or not at all (checkpoints.py). Ranks receive the signal at slightly different times, so at each
step end they agree on it with one all-reduce of a CPU integer over a gloo group: host-side only, no device sync.
"""

from __future__ import annotations

import signal
import sys

import torch
import torch.distributed as dist
from transformers import TrainerCallback

PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Training stopped on a signal after writing a checkpoint; the process should exit with PREEMPTED."""


class Preemption(TrainerCallback):
    def __init__(self) -> None:
        self.received: int = 0  # the signal number, 0 for none
        self.stopped_at: int | None = None
        self.group = None
        self.previous: dict[int, object] = {}

    def handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in SIGNALS:  # kept until uninstall(): a signal during the final save must not cut it short
            self.previous[sig] = signal.signal(sig, self.handle)
        if dist.is_available() and dist.is_initialized():
            # A CPU group for the flag: on GPUs the default group is NCCL, whose collectives wait on the device.
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def agreed(self) -> int:
        if self.group is None:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.agreed()
        if signum and self.stopped_at is None:
            self.stopped_at = state.global_step
            self.received = signum
            control.should_save = True  # whatever save_strategy says
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"received {signal.Signals(signum).name}: step {state.global_step} finished, saving a "
                      "checkpoint, then exiting", file=sys.stderr, flush=True)  # fmt: skip
        return control

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
