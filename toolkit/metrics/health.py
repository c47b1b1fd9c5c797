"""Health warnings from the scaling checklist: one line each, once per run, on stderr and as a W&B alert.

  mfu        below half of what the planner assumes for this kind of strategy (planner.ASSUMED_MFU)
  memory     the device more than 95% full (a GPU's reserved memory; the host's RAM on CPU)
  data       waiting for batches takes more than a fifth of the step
  nonfinite  the loss is NaN or infinite (the run stops: stopping.py)
  router     a mixture of experts' router has collapsed: in one layer half its experts or more got no token in
             the interval, or one expert took far more than its fair share k/E of the tokens: HOT_EXPERT times
             it, or half the way from it to every token where E/k leaves no room for that (metrics/routing.py)
The first logging interval is not judged for speed: it includes start-up (first batches, kernel selection).
"""

from __future__ import annotations

import sys

MEMORY_LIMIT = 0.95
DATA_WAIT_LIMIT = 0.2
MFU_FRACTION = 0.5
COLLAPSED = 0.5  # the share of one layer's experts left idle
HOT_EXPERT = 4.0  # the busiest expert's tokens over its fair share (Qwen3-MoE's 8 of 128: 25% of the tokens)


class Health:
    def __init__(self, expected_mfu: float | None, is_main: bool):
        self.expected_mfu = expected_mfu
        self.is_main = is_main
        self.raised: dict[str, str] = {}
        self._intervals = 0

    def check(self, metrics: dict[str, float], memory_fraction: float) -> None:
        """Judge one training log line's metrics."""
        self._intervals += 1
        if memory_fraction > MEMORY_LIMIT:
            self.warn("memory", f"memory {100 * memory_fraction:.0f}% full (above {100 * MEMORY_LIMIT:.0f}%): an "
                      "OOM is near; lower the micro-batch, turn on gradient checkpointing, or shard more "
                      "(python -m toolkit plan)")  # fmt: skip
        idle = metrics.get("experts_idle_share", 0.0)
        if idle >= COLLAPSED:
            self.warn("router", f"router collapse: {100 * idle:.0f}% of one layer's experts got no token in the last "
                      "logging interval: turn on the load-balancing loss (--router_aux_loss_coef 0.001, say), "
                      "or lower the learning rate")  # fmt: skip
        share, imbalance = metrics.get("router_busiest_share"), metrics.get("router_imbalance")
        if share and imbalance:
            fair = share / imbalance  # k / E: the busiest layer's share over its imbalance (metrics/routing.py)
            if share >= min(HOT_EXPERT * fair, (1 + fair) / 2):
                self.warn("router", f"router imbalance: layer {metrics['router_busiest_layer']}'s busiest expert took "
                          f"{100 * share:.0f}% of its tokens in the last logging interval, {imbalance:.1f}x its fair "
                          f"share of {100 * fair:.0f}%: turn on the load-balancing loss or raise it "
                          "(--router_aux_loss_coef 0.001, say), or lower the learning rate")  # fmt: skip
        if self._intervals < 2:
            return
        share = metrics.get("data_wait_share", 0.0)
        if share > DATA_WAIT_LIMIT:
            self.warn("data", f"{100 * share:.0f}% of the step is spent waiting for data (above "
                      f"{100 * DATA_WAIT_LIMIT:.0f}%): raise --dataloader_num_workers, pre-tokenize, "
                      "or pack")  # fmt: skip
        mfu = metrics.get("mfu")
        if mfu is not None and self.expected_mfu and mfu < MFU_FRACTION * self.expected_mfu:
            self.warn("mfu", f"MFU {100 * mfu:.1f}%, below half of the {100 * self.expected_mfu:.0f}% expected "
                      "for this strategy: check the data wait, a larger micro-batch, bf16, fused/flash "
                      "kernels")  # fmt: skip

    def warn(self, kind: str, message: str) -> None:
        if kind in self.raised:
            return
        self.raised[kind] = message
        if not self.is_main:
            return
        print(f"warning: {message}", file=sys.stderr, flush=True)
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            wandb.alert(title=f"toolkit health: {kind}", text=message, level=wandb.AlertLevel.WARN,
                        wait_duration=0)  # fmt: skip
