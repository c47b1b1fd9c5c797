"""Trainer part: SFT's loss scored by TRL's fused log-prob head (trl.trainer.utils.add_fused_lm_head), the one
its DPOTrainer uses. The head projects the hidden states onto the vocabulary tile by tile (4,096 tokens x 32,768
entries), keeps running log-sum-exp statistics and recomputes each tile in backward: the full logits, and their
fp32 gradients, never exist. The loss is the model's own (the sum over labelled tokens divided by the Trainer's
`num_items_in_batch`), so the Trainer's token normalisation across accumulation and processes is unchanged.
ZeRO-3 and FSDP2 gather the head's weight once per call on every rank (TRL's `maybe_gather_lm_head_ctx`,
`DTensor.full_tensor`), so ranks with different token counts still make the same collectives.
Training steps only: evaluation keeps the logits its metrics read.

A mixture of experts: TRL's fused forward computes the load-balancing loss from its backbone's router logits and
returns that loss alone (`aux_loss`), over every token, padding included where a packed batch reaches the model
without its attention mask. Its output gets the router logits beside it (`keep_router_logits`), as the family's own
forward returns them, so that BalancedLoss balances the real tokens (load_balance.py) under either head."""

from __future__ import annotations

import functools
import types

import torch

from ..models.balance import balance_settings


class FusedLoss:
    def __init__(self, *args, fused_loss: bool = False, **kwargs):
        self.fused_loss = fused_loss
        if fused_loss:  # before any wrapping (DDP, FSDP, DeepSpeed): the patched forward is the module's own
            from trl.trainer.utils import add_fused_lm_head

            model, training = kwargs["model"], kwargs["args"]
            model = model.get_base_model() if hasattr(model, "get_base_model") else model
            add_fused_lm_head(model)
            if balance_settings(model.config) is not None:
                keep_router_logits(model)
            if training.use_liger_kernel:  # Liger's own fused cross-entropy would replace that forward: its other
                # kernels (RMSNorm, SwiGLU, RoPE) still apply, as under TRL's DPOTrainer
                config = training.liger_kernel_config or {}
                training.liger_kernel_config = {**config, "fused_linear_cross_entropy": False}
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.fused_loss and model.training and not return_outputs:
            inputs = {**inputs, "fused_lm_head": True}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def keep_router_logits(model: torch.nn.Module) -> None:
    """`model`'s fused forward (TRL's, already added) returns its backbone's router logits too (module docstring):
    a hook on the backbone catches them while a fused forward runs; any other forward is the one TRL kept."""
    fused, caught = model.forward, []

    def catch(module, args, output):
        if caught:  # inside a fused forward only: no router logits are held past it
            caught[-1] = getattr(output, "router_logits", None)

    model.base_model.register_forward_hook(catch)  # the backbone TRL's forward calls (its base_model)

    @functools.wraps(type(model).forward)  # the model's own signature, as TRL keeps it: generate reads it
    def forward(self, *args, fused_lm_head=False, **kwargs):
        if not fused_lm_head:
            return fused(*args, **kwargs)
        caught.append(None)
        try:
            outputs = fused(*args, fused_lm_head=True, **kwargs)
        finally:
            router_logits = caught.pop()
        if router_logits is not None:
            outputs["router_logits"] = router_logits
        return outputs

    model.forward = types.MethodType(forward, model)
