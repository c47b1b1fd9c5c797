"""Labelled completions (task kto) as the data room reads them: TRL's unpaired preference layout, a `prompt`, a
`completion` and a boolean `label` (desirable or not) per row, the prompt and completion both text or both
conversations (the prompt ending on the user's turn, the completion the assistant's). Each row is checked here;
TRL's KTOTrainer applies the chat template and tokenizes (training/kto.py)."""

from __future__ import annotations

from typing import Any

from ..errors import DataError
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


def check_label_mix(labels) -> None:
    """KTO sets desirable completions against undesirable ones: training rows all of one label would train on one
    kind alone, TRL's only notice its advice on desirable_weight and undesirable_weight. One line, before the
    weights load."""
    labels = list(labels)
    desirable = sum(bool(label) for label in labels)
    if not labels or 0 < desirable < len(labels):
        return
    said, fix = (("true (desirable)", "add rows labelled false (undesirable completions), or train on these with "
                  "--task sft") if desirable else
                 ("false (undesirable)", "add rows labelled true (desirable completions)"))  # fmt: skip
    raise DataError(f"task kto: all {len(labels)} training rows are labelled {said}, and KTO learns from desirable "
                    f"completions set against undesirable ones: {fix}.")  # fmt: skip
