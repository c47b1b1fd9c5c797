"""The figures of a log line and of the run's summary, from a RunTracker's counts and clocks (tracking.py's module
docstring says what each is): tokens and samples a second, step time, MFU, the data wait, GRPO's sampling share,
peak memory, the cost so far and projected.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerState

from .memory import GIB, peak_memory_bytes


def mfu(flops_per_token: float, tokens_per_second: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the job's dense peak FLOP/s."""
    return flops_per_token * tokens_per_second / (devices * peak_flops)


class RunFigures:
    """A RunTracker's figures (self: the tracker)."""

    def metrics(self, state: TrainerState, training: bool) -> dict[str, float]:
        """Metrics for one log line; `training` is False for evaluation logs, which get no throughput."""
        if self.training_started is None:
            return {}
        self.reduce_tokens(state)
        elapsed = self.elapsed  # one clock reading: hours and dollars agree exactly
        out: dict[str, float] = {f"{self.cost.unit.lower()}_hours": self.unit_hours(elapsed),
                                 "num_input_tokens_seen": state.num_input_tokens_seen}  # fmt: skip
        usd = self.usd(elapsed)
        if usd is not None:
            out["cost_usd"] = usd
            if state.num_input_tokens_seen:
                out["usd_per_million_tokens"] = usd / state.num_input_tokens_seen * 1e6
            if state.max_steps > 0:
                out["cost_projected_usd"] = usd + self.step_usd(state) * (state.max_steps - state.global_step)
        now, last = self._now(state), self._mark
        seconds = now["time"] - last["time"] - (now["paused"] - last["paused"])
        if training and seconds > 0 and now["step"] > last["step"]:
            tokens, samples = now["tokens"] - last["tokens"], now["samples"] - last["samples"]
            phases = now["sampling"] - last["sampling"], now["sampled"] - last["sampled"]  # GRPO's sampling
            out.update(self.throughput(tokens, samples, seconds, now["step"] - last["step"], *phases))
            out["data_wait_share"] = (now["data"] - last["data"]) / seconds
            out["peak_memory_gib"] = peak_memory_bytes() / GIB
            self._mark = now
        return out

    def throughput(self, tokens: int, samples: int, seconds: float, steps: int, sampling: float = 0.0,
                   sampled: int = 0) -> dict[str, float]:  # fmt: skip
        """Rates over `seconds` of steps; with `sampling` seconds of them spent sampling completions (GRPO), its
        share, this rank's sampled tokens a second, and the training part's own tokens/s and MFU (the FLOPs
        counted are training's)."""
        out = {
            "tokens_per_second": tokens / seconds,
            "tokens_per_second_per_device": tokens / seconds / self.num_processes,
            "samples_per_second": samples / seconds,
            "step_seconds": seconds / steps,
        }
        training = seconds - sampling
        if sampling > 0 and training > 0:
            out.update(sampling_share=sampling / seconds, training_tokens_per_second=tokens / training,
                       sampling_tokens_per_second_per_device=sampled / sampling)  # fmt: skip
        if self.peak_flops and samples and training > 0:
            out["mfu"] = mfu(self.flops_per_token(tokens / samples), tokens / training, self.num_processes,
                             self.peak_flops)  # fmt: skip
        return out

    def summary(self, state: TrainerState) -> dict[str, Any]:
        """The whole segment's figures (mean MFU over all its tokens), plus the run's cost including resumes."""
        self.reduce_tokens(state)
        steps, tokens = state.global_step - self._start_step, state.num_input_tokens_seen - self._start_tokens
        end = self.training_ended or time.perf_counter()
        seconds = end - (self.training_started or end) - self.paused_seconds
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
            rates = self.throughput(tokens, self.samples, seconds, steps, self.sampling_seconds, self.sampled_tokens)
            out["tokens_per_second"] = rates["tokens_per_second"]
            out["mean_mfu"] = rates.get("mfu")
            if self.sampling_seconds:
                out.update({key: rates.get(key) for key in ("sampling_share", "training_tokens_per_second",
                                                            "sampling_tokens_per_second_per_device")},
                           sampling_seconds=self.sampling_seconds)  # fmt: skip
        return out
