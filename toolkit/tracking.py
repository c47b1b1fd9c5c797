"""Live throughput and cost, added to every training log line (console, log_history, W&B alike).

tokens/s counts non-padding tokens only: the Trainer's own `num_input_tokens_seen` in "non_padding" mode sums
each micro-batch's attention mask, gathered over ranks, so it is right under gradient accumulation and across
processes. We add the pace over the last logging interval (the Trainer's `train_tokens_per_second` is the
average since the start) and the cost so far.
"""

from __future__ import annotations

import time

from transformers import TrainerState

from .cost import CostModel


class RunTracker:
    def __init__(self, cost: CostModel, num_processes: int):
        self.cost = cost
        self.num_processes = num_processes
        self.started: float | None = None
        self._last_time = 0.0
        self._last_tokens = 0

    def start(self, state: TrainerState) -> None:
        self.started = self._last_time = time.perf_counter()
        self._last_tokens = state.num_input_tokens_seen

    @property
    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started

    def metrics(self, state: TrainerState, training: bool) -> dict[str, float]:
        """Metrics for one log line; `training` is False for evaluation logs, which get no throughput."""
        if self.started is None:
            return {}
        now = time.perf_counter()
        out: dict[str, float] = {f"{self.cost.unit.lower()}_hours": self.cost.unit_hours(self.elapsed)}
        usd = self.cost.usd(self.elapsed)
        if usd is not None:
            out["cost_usd"] = usd
        if training and now > self._last_time:
            tokens = state.num_input_tokens_seen - self._last_tokens
            rate = tokens / (now - self._last_time)
            out["tokens_per_second"] = rate
            out["tokens_per_second_per_device"] = rate / self.num_processes
            self._last_time, self._last_tokens = now, state.num_input_tokens_seen
        return out
