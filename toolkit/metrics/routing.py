"""A mixture of experts' router health, per logging interval: how evenly the routers spread the tokens over the
experts. Read off each fused experts module's own input (transformers 5 passes every one the indices its tokens
were routed to: `top_k_index`), not off a family's router class:

  router_imbalance       the most-loaded expert's share of the routed tokens times the experts: 1 when each expert
                         gets its 1/E, E when one takes them all; the worst layer's
  router_imbalance_mean  the same, averaged over the layers
  experts_idle           experts no token reached in the interval, all layers together
  experts_idle_share     the largest share of one layer's experts that no token reached (health.py warns of a
                         collapsed router from half)
  router_load_entropy    the entropy of a layer's token shares over its experts, over log E: 1 when each expert
                         gets its 1/E, 0 when one takes them all; the least even layer's (the routers' own
                         distributions differ by family, softmax or sigmoid: the load they produce does not)
  tokens_dropped         routed (token, expert) pairs sent to no expert, all layers together: transformers marks
                         them with an index outside the experts where a capacity applies; 0 for dropless routing
  router_busiest_share   the share of a layer's tokens its busiest expert received (top-k: its fair share is k/E,
                         1 when every token went through it); the layer where it is largest, and that layer's
  router_busiest_layer   index (health.py warns of a router that sends far more than its fair share to one expert)

Counted on every rank and summed over them at each log (pipeline stages: each its own layers' rows). Tokens a
layer recomputes under activation checkpointing count twice, as all of that layer's do: the shares stand. Real
tokens only, where the forward runs inside `real_tokens(mask)`: a packed batch reaches the model without its
attention mask, so its padding is routed too (each rank pads to its own longest row, pipeline stages to
max_seq_length); under pipeline stages, a layer that activation checkpointing recomputes counts its padding again
(the recomputation runs outside the stage's forward), and the first step of a schedule is not counted (torch's
schedule infers its shapes with a forward of its own inside it).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

_REAL_TOKENS: ContextVar[torch.Tensor | None] = ContextVar("real_tokens", default=None)


@contextlib.contextmanager
def real_tokens(mask: torch.Tensor | None):
    """The forwards (and their recomputations) inside count only these tokens: a batch's attention mask."""
    token = _REAL_TOKENS.set(mask)
    try:
        yield
    finally:
        _REAL_TOKENS.reset(token)


def expert_count(module: torch.nn.Module) -> int | None:
    """The experts a fused experts module stacks in its 3-D weights (their full shape: ZeRO-3 keeps it in ds_shape,
    the parameter itself a partition; under expert parallelism a DTensor's shape, where transformers sets
    `num_experts` to this rank's share); None for any other module."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or count < 1:
        return None
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in module.parameters(recurse=False)]
    return next((shape[0] for shape in shapes if len(shape) == 3 and shape[0] % count == 0), None)


def fused_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is a fused experts module: 3-D weights stacking its experts."""
    return expert_count(module) is not None


class RouterStats:
    """Forward hooks on a model's fused experts modules, counting the tokens each expert receives."""

    def __init__(self, modules: list[torch.nn.Module | None], experts: int | None = None):
        # per layer: the pairs routed to each expert (by global ids), those routed to none, the tokens; a layer held
        # elsewhere (None: another pipeline stage's) keeps a row of zeros, which the sum over the ranks fills
        experts = experts or next(expert_count(m) for m in modules if m is not None)
        self.counts = [torch.zeros(experts + 2, dtype=torch.long) for _ in modules]
        self.hooks = [m.register_forward_pre_hook(self._counter(i), with_kwargs=True)
                      for i, m in enumerate(modules) if m is not None]  # fmt: skip

    @classmethod
    def of(cls, model: torch.nn.Module, layers: list[torch.nn.Module] | None = None,
           experts: int | None = None) -> RouterStats | None:  # fmt: skip
        """The stats of `model`'s fused experts (3-D weights stacking `num_experts`); None for a model without.
        With `layers` (a pipeline stage's view of every block of the whole model) and the model's `experts`, one
        row per block, held or not: every stage counts the same rows, so that their sum is the whole model's."""
        if layers is not None and experts:
            return cls([next((m for m in block.modules() if fused_experts(m)), None) for block in layers], experts)
        modules = [m for m in model.modules() if fused_experts(m)]
        return cls(modules) if modules else None

    def _counter(self, layer: int):
        def count(module, args, kwargs):
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if isinstance(index, torch.Tensor):
                experts = len(self.counts[layer]) - 2
                mask = _REAL_TOKENS.get()
                if mask is not None and index.dim() > 1 and mask.numel() == index.shape[0]:  # else another split's
                    index = index[mask.reshape(-1).to(index.device).bool()]
                tokens = index.shape[0] if index.dim() > 1 else index.numel()
                index = index.detach().reshape(-1).to(torch.long)
                index = torch.where((index < 0) | (index >= experts), experts, index)  # sent nowhere: after them
                self.counts[layer][: experts + 1] += torch.bincount(index, minlength=experts + 1).cpu()
                self.counts[layer][-1] += tokens

        return count

    def clear(self) -> None:
        """Forget what was counted since the last log (a pass that was not training's own)."""
        for c in self.counts:
            c.zero_()

    def metrics(self, reduce=None) -> dict[str, float]:
        """The interval's figures (module docstring), its counts summed by `reduce` (a tensor -> the sum over the
        ranks), then cleared."""
        counts = torch.stack(self.counts)
        if reduce is not None:
            counts = reduce(counts)
        self.clear()
        dropped, tokens, counts = int(counts[:, -2].sum()), counts[:, -1], counts[:, :-2]
        totals = counts.sum(dim=1)
        routed = totals > 0
        if not routed.any():
            return {}
        experts = counts.shape[1]
        busiest = counts.max(dim=1).values / tokens.clamp(min=1)  # a share of the tokens: at most 1
        hot = int(torch.where(routed, busiest, -1.0).argmax())
        imbalance = counts[routed].max(dim=1).values * experts / totals[routed]
        idle = (counts[routed] == 0).sum(dim=1)
        shares = counts[routed] / totals[routed, None]
        entropy = -(shares * shares.clamp_min(1e-30).log()).sum(dim=1) / torch.log(torch.tensor(float(experts)))
        return {"router_imbalance": float(imbalance.max()), "router_imbalance_mean": float(imbalance.mean()),
                "experts_idle": int(idle.sum()), "experts_idle_share": float(idle.max()) / experts,
                "router_load_entropy": float(entropy.min()), "tokens_dropped": dropped,
                "router_busiest_share": float(busiest[hot]), "router_busiest_layer": hot}  # fmt: skip

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
