"""Labelled completions (task kto) as the data room reads them: TRL's unpaired preference layout, a `prompt`, a
`completion` and a boolean `label` (desirable or not) per row, the prompt and completion both text or both
conversations (the prompt ending on the user's turn, the completion the assistant's). Each row is checked here;
TRL's KTOTrainer applies the chat template and tokenizes (training/kto.py)."""

from __future__ import annotations

from typing import Any

from .formats import is_text
from .prompts import prompt_problem

LABELLED_COLUMNS = ["prompt", "completion", "label"]


def labelled_problem(prompt: Any, completion: Any, label: Any) -> str | None:
    """What makes a labelled completion unusable, or None."""
    if not isinstance(label, bool):
        return f"its label is {label!r} ({type(label).__name__}): true (a desirable completion) or false (not)"
    if problem := prompt_problem(prompt):
        return problem
    if is_text(prompt) != is_text(completion) or not (is_text(completion) or isinstance(completion, list)):
        return "prompt and completion must both be text or both conversations (lists of messages)"
    if isinstance(completion, list):
        roles = [message.get("role") if isinstance(message, dict) else None for message in completion]
        if not completion or any(role != "assistant" for role in roles):
            return f"its completion has the roles {roles}: the assistant's turn alone, [{{role: assistant, ...}}]"
        if not all(is_text(message.get("content")) for message in completion):
            return "its completion's message has no text content"
    return None
