"""Preference pairs (task dpo) as the data room reads them: UltraFeedback-binarized's layout, `chosen` and
`rejected`, each a whole conversation (the shared prompt turns, then the answer), or text with a `prompt` column.
Each pair is checked here as SFT rows are; TRL's DPOTrainer then takes the shared prompt off, applies the chat
template and tokenizes (training/preference.py)."""

from __future__ import annotations

from typing import Any

from .conversations import conversation_problem
from .formats import is_text

PAIR_COLUMNS = ["chosen", "rejected"]


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
    return PAIR_COLUMNS + (["prompt"] if prompt is not None and text_prompt != conversational else [])
