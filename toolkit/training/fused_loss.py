"""Trainer part: SFT's loss scored by TRL's fused log-prob head (trl.trainer.utils.add_fused_lm_head), the one
its DPOTrainer uses. The head projects the hidden states onto the vocabulary tile by tile (4,096 tokens x 32,768
entries), keeps running log-sum-exp statistics and recomputes each tile in backward: the full logits, and their
fp32 gradients, never exist. The loss is the model's own (the sum over labelled tokens divided by the Trainer's
`num_items_in_batch`), so the Trainer's token normalisation across accumulation and processes is unchanged.
ZeRO-3 and FSDP2 gather the head's weight once per call on every rank (TRL's `maybe_gather_lm_head_ctx`,
`DTensor.full_tensor`), so ranks with different token counts still make the same collectives.
Training steps only: evaluation keeps the logits its metrics read."""

from __future__ import annotations


class FusedLoss:
    def __init__(self, *args, fused_loss: bool = False, **kwargs):
        self.fused_loss = fused_loss
        if fused_loss:  # before any wrapping (DDP, FSDP, DeepSpeed): the patched forward is the module's own
            from trl.trainer.utils import add_fused_lm_head

            model, training = kwargs["model"], kwargs["args"]
            add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
            if training.use_liger_kernel:  # Liger's own fused cross-entropy would replace that forward: its other
                # kernels (RMSNorm, SwiGLU, RoPE) still apply, as under TRL's DPOTrainer
                config = training.liger_kernel_config or {}
                training.liger_kernel_config = {**config, "fused_linear_cross_entropy": False}
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.fused_loss and model.training and not return_outputs:
            inputs = {**inputs, "fused_lm_head": True}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
