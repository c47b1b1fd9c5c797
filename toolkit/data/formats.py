"""SFT data formats: what a row looks like, how it is checked, and what the loss is on.

    format             columns                                     loss on
    messages           messages: [{role, content}, ...]            every assistant message
    sharegpt           conversations: [{from, value}, ...]         every gpt message (read as messages)
    alpaca             instruction, input (may be empty), output   the output (read as a user/assistant pair)
    prompt_completion  prompt, completion: text, or message lists  the completion
    text               text                                        every token: continued pre-training

A recipe names its format with `data_format`, or it is detected from the columns in the order above. ShareGPT
and Alpaca rows become messages, so the chat template and the assistant-only loss apply to them as to any
conversation. Text rows end with EOS and are cut into max_seq_length pieces rather than truncated (packing then
fills rows with them, attention kept inside each piece); prompt/completion text is not templated, as TRL does it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from ..errors import DataError
from ..settings.arguments import DATA_FORMATS
from .conversations import (
    IGNORE_INDEX,
    SHAREGPT,
    TurnLayout,
    as_called,
    conversation_problem,
    row_tools,
    tokenize_conversations,
    truncated,
)

COLUMNS = {  # in DATA_FORMATS' order, the detection order: a data set with messages and text is conversations
    "messages": None,  # the recipe's messages_column
    "sharegpt": ["conversations"],
    "alpaca": ["instruction", "output"],
    "prompt_completion": ["prompt", "completion"],
    "text": ["text"],
}
FORMATS = DATA_FORMATS
assert tuple(COLUMNS) == FORMATS
CONVERSATIONAL = ("messages", "sharegpt", "alpaca")  # read as messages


def columns_of(data_format: str, messages_column: str) -> list[str]:
    return COLUMNS[data_format] or [messages_column]


def detect(columns: list[str], messages_column: str, where: str) -> str:
    for data_format in FORMATS:
        if set(columns_of(data_format, messages_column)) <= set(columns):
            return data_format
    known = "; ".join(f"{name}: {', '.join(columns_of(name, messages_column))}" for name in FORMATS)
    raise DataError(f"{where} has the columns {columns}, which match no SFT format ({known}). Rename its columns, "
                    "or point --messages_column at its conversations.")  # fmt: skip


def is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def sharegpt_problem(conversation: Any) -> str | None:
    if not isinstance(conversation, list) or not conversation:
        return "the conversation is empty"
    for k, turn in enumerate(conversation):
        if not isinstance(turn, dict) or not {"from", "value"} <= set(turn):
            return f"turn {k} is not a ShareGPT {{from, value}} turn (it is {turn!r:.80})"
    return conversation_problem(as_messages("sharegpt", {"conversations": conversation}))


def alpaca_problem(instruction: Any, output: Any) -> str | None:
    if not is_text(instruction):
        return "its instruction is empty"
    return None if is_text(output) else "its output is empty, so nothing to learn"


def prompt_completion_problem(prompt: Any, completion: Any) -> str | None:
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational: message lists
        return conversation_problem(prompt + completion) or (
            None if any(m.get("role") == "assistant" for m in completion) else "its completion has no assistant message"
        )
    if not isinstance(prompt, str) or not is_text(completion):
        return "prompt and completion must both be text (completion not empty), or both lists of messages"
    return None


PROBLEMS: dict[str, Callable[..., str | None]] = {
    "messages": conversation_problem,
    "sharegpt": sharegpt_problem,
    "alpaca": alpaca_problem,
    "prompt_completion": prompt_completion_problem,
    "text": lambda text: None if is_text(text) else "its text is empty",
}


def as_messages(data_format: str, row: dict) -> list[dict]:
    """A ShareGPT or Alpaca row as role/content messages (unknown ShareGPT roles kept, for the check to name)."""
    if data_format == "sharegpt":
        return [{"role": SHAREGPT.get(turn["from"], turn["from"]), "content": turn["value"]}
                for turn in row["conversations"]]  # fmt: skip
    extra = (row.get("input") or "").strip()
    question = row["instruction"].strip() + (f"\n\n{extra}" if extra else "")
    return [{"role": "user", "content": question}, {"role": "assistant", "content": row["output"]}]


def to_messages(split: Dataset, data_format: str, messages_column: str) -> Dataset:
    """ShareGPT and Alpaca rows mapped to a messages column, the only one kept."""
    return split.map(lambda row: {messages_column: as_messages(data_format, row)}, remove_columns=split.column_names,
                     desc=f"Reading {data_format} rows as messages")  # fmt: skip


def kind_of(data_format: str | None) -> str | None:
    """The tokenization a format's rows get: conversations (messages), prompt_completion or text."""
    return "messages" if data_format in CONVERSATIONAL else data_format


def kind(columns: list[str], messages_column: str) -> str:
    """The tokenization prepared rows need: conversations (messages), prompt_completion or text."""
    if messages_column in columns:
        return "messages"
    return "prompt_completion" if "prompt" in columns else "text"


def tokenize_rows(tokenizer: PreTrainedTokenizerBase, batch: dict, data_format: str, messages_column: str,
                  max_len: int, layout: TurnLayout | None) -> list[dict]:  # fmt: skip
    """input_ids, attention_mask and labels for a batch of rows of a `kind`."""
    if data_format == "messages":
        return tokenize_conversations(tokenizer, batch[messages_column], max_len, layout, batch.get("tools"))
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if data_format == "text":  # every token trained; a long document becomes several rows, none of it dropped
        rows = []
        for ids in tokenizer(batch["text"])["input_ids"]:
            ids = ids + eos if ids[-1:] != eos else ids
            rows += [truncated(ids[i : i + max_len], ids[i : i + max_len], max_len)
                     for i in range(0, len(ids), max_len)]  # fmt: skip
        return rows
    prompts, completions = batch["prompt"], batch["completion"]
    if isinstance(prompts[0], list):  # conversations: the completion's assistant tokens, none of the prompt's
        tools = batch.get("tools") or [None] * len(prompts)
        rows = tokenize_conversations(tokenizer, [p + c for p, c in zip(prompts, completions, strict=True)], max_len,
                                      layout, tools)  # fmt: skip
        for row, prompt, offered in zip(rows, prompts, tools, strict=True):
            said = tokenizer.apply_chat_template(as_called(prompt), add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, tools=row_tools(offered))  # fmt: skip
            cut = len(said["input_ids"])
            row["labels"][:cut] = [IGNORE_INDEX] * min(cut, len(row["labels"]))
        return rows
    prompt_ids = tokenizer(prompts)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    return [truncated(p + c + eos, [IGNORE_INDEX] * len(p) + c + eos, max_len)
            for p, c in zip(prompt_ids, completion_ids, strict=True)]  # fmt: skip
