"""A mixture of experts' load-balancing loss, taken apart into sums that add over layers.

transformers' MoE families (Mixtral's `load_balancing_loss_func`, which every family with a `router_aux_loss_coef`
pulls in, and TRL's fused head) compute Switch Transformer's loss over all the layers' router logits at once:

    aux = E * sum_i (T_i / R) * (P_i / R)

  T_i  the (token, slot) pairs the routers send to expert i (top-k: k slots a token), over every layer
  P_i  the routers' softmax probability of expert i, summed over the tokens of every layer (the only part with a
       gradient: the counts are a top-k, constant)
  R    the tokens, once per layer; padding (attention mask 0) left out of all three

A pipeline stage holds some of the layers: each adds its layers' sums to the running ones it was handed, and the
last stage computes the loss from the whole model's (training/pipeline.py). 2E + 1 numbers cross each stage
boundary, not the router logits (tokens x E per layer).
"""

from __future__ import annotations

import torch

from .parallel import routed_expert_count


def routing_sums(router_logits: tuple[torch.Tensor, ...] | None, experts: int, top_k: int,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """T, P and R (module docstring) of these layers' router logits (tokens x E each), as one float32 vector of
    2E + 1; zeros for no layers."""
    sums = torch.zeros(2 * experts + 1, dtype=torch.float32)
    for logits in router_logits or ():
        sums = sums.to(logits.device)
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        weight = torch.ones(probs.shape[0], device=probs.device)
        # a mask of other tokens (a sequence split's shard of them) is not this forward's: all its tokens count
        if attention_mask is not None and attention_mask.numel() == probs.shape[0]:
            weight = attention_mask.reshape(-1).to(probs.device, torch.float32)
        counts = torch.zeros(experts, device=probs.device).scatter_add_(0, chosen.reshape(-1),
                                                                          weight.repeat_interleave(top_k))  # fmt: skip
        sums = sums + torch.cat([counts, (probs * weight[:, None]).sum(dim=0), weight.sum()[None]])
    return sums


def balance_loss(sums: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss of the whole model's sums (routing_sums added over every layer)."""
    experts = (sums.numel() - 1) // 2
    counts, probs, tokens = sums[:experts].detach(), sums[experts:-1], sums[-1].detach()
    return experts * (counts * probs).sum() / tokens.clamp(min=1) ** 2


def balance_settings(config) -> tuple[float, int, int] | None:
    """(coefficient, experts, top-k) of a model whose forward computes the load-balancing loss (its config asks
    for router logits, at a positive coefficient); None otherwise."""
    text = config.get_text_config()
    coef = getattr(text, "router_aux_loss_coef", None)
    if not getattr(text, "output_router_logits", False) or not coef:
        return None
    return float(coef), routed_expert_count(text), text.num_experts_per_tok
