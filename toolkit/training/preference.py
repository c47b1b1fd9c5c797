"""Preference tuning (task dpo): TRL's DPOTrainer with the toolkit's parts in front, as for SFT.

The data is pairs in UltraFeedback-binarized's layout, each checked by the data room first (data/preference.py);
TRL takes the shared prompt off, applies the chat template and tokenizes.

The reference model is a frozen copy of the starting weights, loaded on every rank and sharded like the policy
(TRL: ZeRO-3 partitions it, FSDP shards it, DDP keeps it whole); with LoRA there is no copy of the model: the
reference is the base with the adapter off (TRL's frozen "ref" adapter, a copy of the untrained one).
Imported only by preference runs: TRL takes a second to import.
"""

from __future__ import annotations

from trl import DPOTrainer

from ..models.loading import load_model
from .trainer import ToolkitTrainerMixin


def reference_model(args, tokenizer):
    """The frozen reference for a full fine-tune; None with LoRA (TRL then scores with the adapter off)."""
    if args.model.use_lora:
        return None
    # read whole on every rank: TRL shards it itself, without FSDP's broadcast from rank 0
    model = load_model(args.model, args.data.task, tokenizer, None)
    model.requires_grad_(False)
    return model.eval()


class RecipeDPOTrainer(ToolkitTrainerMixin, DPOTrainer):
    """The toolkit's parts on TRL's `DPOTrainer`."""
