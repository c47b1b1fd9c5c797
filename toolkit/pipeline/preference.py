"""Preference tuning (task dpo): TRL's DPOTrainer with the toolkit's parts in front, as for SFT.

The data is pairs in UltraFeedback-binarized's layout: `chosen` and `rejected`, each a whole conversation (the
shared prompt turns, then the answer), or text with a `prompt` column. TRL takes the shared prompt off, applies
the chat template and tokenizes; the toolkit checks every pair first, as it checks SFT rows.

The reference model is a frozen copy of the starting weights, loaded on every rank and sharded like the policy
(TRL: ZeRO-3 partitions it, FSDP shards it, DDP keeps it whole); with LoRA there is no copy of the model: the
reference is the base with the adapter off (TRL's frozen "ref" adapter, a copy of the untrained one).
Imported only by preference runs: TRL takes a second to import.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from transformers import TrainingArguments
from trl import DPOConfig, DPOTrainer

from .arguments import PreferenceArguments
from .conversations import conversation_problem
from .formats import is_text
from .models import load_model
from .trainer import ToolkitTrainerMixin

COLUMNS = ["chosen", "rejected"]


def pair_problem(chosen: Any, rejected: Any) -> str | None:
    """What makes a preference pair unusable, or None: both conversations ending on an assistant answer, or both
    non-empty text."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        for name, messages in (("chosen", chosen), ("rejected", rejected)):
            problem = conversation_problem(messages)
            if problem:
                return f"its {name} conversation: {problem}"
            if messages[-1]["role"] != "assistant":
                return f"its {name} conversation ends on a {messages[-1]['role']} message, not the answer"
        return None
    if is_text(chosen) and is_text(rejected):
        return None
    return "chosen and rejected must both be conversations (lists of messages) or both text, not empty"


def kept_columns(split) -> list[str]:
    """chosen and rejected, and a prompt of the same kind (text with text): UltraFeedback's text prompt beside its
    conversations is left out, TRL takes the prompt from the conversations' shared turns."""
    prompt = split.features.get("prompt")
    conversational = not isinstance(split[0]["chosen"], str) if len(split) else True
    text_prompt = getattr(prompt, "dtype", None) == "string"
    return COLUMNS + (["prompt"] if prompt is not None and text_prompt != conversational else [])


def dpo_config(training: TrainingArguments, preference: PreferenceArguments, max_length: int,
               trust_remote_code: bool):  # fmt: skip
    """TRL's DPOConfig from the run's TrainingArguments (every field as resolved) and the preference settings."""
    values = {f.name: getattr(training, f.name) for f in fields(TrainingArguments) if f.init}
    return DPOConfig(**values, beta=preference.beta, loss_type=preference.losses(), max_length=max_length,
                     trust_remote_code=trust_remote_code)  # fmt: skip


def reference_model(args, tokenizer):
    """The frozen reference for a full fine-tune; None with LoRA (TRL then scores with the adapter off)."""
    if args.model.use_lora:
        return None
    model = load_model(args.model, args.data.task, tokenizer, None, every_rank_reads=True)
    model.requires_grad_(False)
    return model.eval()


class RecipeDPOTrainer(ToolkitTrainerMixin, DPOTrainer):
    """The toolkit's parts on TRL's `DPOTrainer`."""
