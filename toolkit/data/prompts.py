"""Prompts (task grpo, rloo) as the data room reads them: TRL's layout, a `prompt` column of text or of a
conversation that ends on the user's turn (the model answers it). Every other column stays: reward functions receive
them (an `answer` for the accuracy reward). TRL applies the chat template and tokenizes (training/rl.py)."""

from __future__ import annotations

from typing import Any

from .conversations import ROLES
from .formats import is_text

PROMPT = "prompt"


def prompt_problem(prompt: Any) -> str | None:
    """What makes a prompt unusable, or None: text, or a conversation of role/content messages ending on a user's."""
    if is_text(prompt):
        return None
    if not isinstance(prompt, list) or not prompt:
        return "its prompt is empty: give text, or a conversation ending on the user's turn"
    for k, message in enumerate(prompt):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not is_text(message.get("content")):
            return f"message {k} of its prompt is not a {{role, content}} message with text"
    if prompt[-1]["role"] != "user":
        return (f"its prompt ends on a {prompt[-1]['role']} message: the model answers the user's last turn, so "
                "end each prompt on it")  # fmt: skip
    return None


def as_prompts(split, column: str):
    """The split with its prompts in TRL's `prompt` column, each a conversation: text becomes the user's turn (the
    chat template then renders it as the model was tuned to read a question)."""
    if column != PROMPT:
        split = split.remove_columns([PROMPT]) if PROMPT in split.column_names else split
        split = split.rename_column(column, PROMPT)
    if getattr(split.features[PROMPT], "dtype", None) == "string":
        split = split.map(lambda row: {PROMPT: [{"role": "user", "content": row[PROMPT]}]})
    return split
