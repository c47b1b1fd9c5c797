"""fp32 master weights for 16-bit trainable weights: the standard of mixed-precision training (Micikevicius et al.
2018, "Mixed Precision Training"): compute in bf16/fp16, keep and update the weights in fp32. An AdamW update at a
fine-tuning learning rate (2e-5) is below bf16's resolution for most weights (8 bits of mantissa: a weight of 0.02
moves in steps of 1.2e-4), so 16-bit weights updated in place lose most updates (measured on SmolLM2-135M:
docs/recipes.md). accelerate's FSDP upcasts trainable 16-bit weights at preparation under mixed precision, and
DeepSpeed keeps fp32 masters in its optimizer; a single-process or DDP run has no one to keep them: the trainer
does, on the device (after the Trainer placed the model, before the optimizer exists), under --bf16/--fp16.
"""

from __future__ import annotations

import torch

from ..errors import warn

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def keep_master_weights(trainer, setting: bool | None) -> str:
    """Upcast trainable 16-bit weights to fp32 where no engine does (`setting`: --fp32_master_weights, None for
    the default); returns what is in effect, for the run header."""
    from accelerate.utils import DistributedType

    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    sixteen = [p for p in trainable if p.dtype in SIXTEEN_BIT]
    if not sixteen:
        return ""
    kind = trainer.accelerator.distributed_type
    mixed = trainer.args.bf16 or trainer.args.fp16
    if kind == DistributedType.DEEPSPEED:
        return "fp32 master weights in DeepSpeed's optimizer"
    if kind == DistributedType.FSDP and mixed:
        return "fp32 master weights (accelerate upcasts them at preparation)"
    if kind != DistributedType.FSDP and mixed and setting is not False:
        for p in sixteen:
            p.data = p.data.float()
        return f"fp32 master weights, {'bf16' if trainer.args.bf16 else 'fp16'} compute (autocast)"
    warn(f"{sum(p.numel() for p in sixteen):,} trainable weights train in {sixteen[0].dtype} without fp32 master "
         "weights: updates below its resolution are lost (most of them at a fine-tuning learning rate). Pass --bf16 "
         "true to keep fp32 masters and compute in bf16.")  # fmt: skip
    return "no master weights: 16-bit updates"
