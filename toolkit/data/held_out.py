"""The held-out split (--eval_fraction) by prompt: every row of a prompt on one side of it.

KTO's labelled completions come several to a prompt (kto-mix-14k's), as do preference pairs and SFT answers to one
question; a split by row left most held-out prompts in training too (188 of 200 held-out rows, in the report that
found it), so the held-out figures measured prompts the model had trained on. Here the prompts are split, with
datasets' own `train_test_split` (the fraction, seed 0) over them, and each side takes all of its prompts' rows.
Where no prompt repeats that is the split by row, row for row (a permutation of as many prompts as rows); rows
without a prompt (classification's texts, plain text) split by row, as before.
"""

from __future__ import annotations

import json
from typing import Any

from datasets import Dataset

from ..errors import DataError


def prompt_of(row: dict[str, Any], messages_column: str) -> Any:
    """What a row answers, by the columns the data room keeps: a `prompt` column (grpo, rloo, distill, kto, SFT's
    prompt_completion, text pairs); a pair's conversation without its answer (the turns chosen and rejected share);
    a conversation's turns before its first answer. None where a row has no prompt."""
    if "prompt" in row:
        return row["prompt"]
    if isinstance(row.get("chosen"), list):
        return row["chosen"][:-1]
    messages = row.get(messages_column)
    if isinstance(messages, list):
        first = next((k for k, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        return messages[:first]
    return None


def split_by_prompt(split: Dataset, fraction: float, messages_column: str) -> tuple[Dataset, Dataset] | None:
    """(train, held out) with `fraction` of the prompts held out, or None where the rows have no prompt."""
    columns = [c for c in ("prompt", "chosen", messages_column) if c in split.column_names][:1]
    if not columns or not len(split):
        return None
    groups: dict[str, list[int]] = {}
    for k, value in enumerate(split[columns[0]]):
        prompt = prompt_of({columns[0]: value}, messages_column)
        groups.setdefault(json.dumps(prompt, sort_keys=True, default=str), []).append(k)
    members = list(groups.values())
    if len(members) < 2:
        raise DataError(f"eval_fraction {fraction:g} holds out a share of the prompts, and all {len(split):,} rows "
                        "answer one prompt: pass --eval_fraction 0, or held-out rows of their own with "
                        "--eval_split.")  # fmt: skip
    sides = Dataset.from_dict({"group": range(len(members))}).train_test_split(test_size=fraction, seed=0)
    train, held_out = ([k for g in sides[side]["group"] for k in members[g]] for side in ("train", "test"))
    return split.select(train), split.select(held_out)
