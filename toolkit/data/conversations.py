"""Chat SFT tokenization: a conversation's tokens, with labels on what the assistant says and nothing else.

An assistant turn's labels are its tokens from the end of the generation prompt (the assistant's header) through
the end of the rendered turn (its content and the template's end-of-turn marker, e.g. `<|eot_id|>`): what the
model must produce after the prompt a chat UI gives it. Three ways to find them, fastest first, same labels:
  marks     a template with `{% generation %}` blocks says which tokens are the assistant's (transformers'
            `return_assistant_tokens_mask`); the toolkit's own `llama3` template has them
  layout    the conversation is rendered once and each assistant turn found in it as the template's assistant
            header + its content + the template's turn ending (both learned once per template from two probe
            renders); one tokenization with character offsets maps those spans to tokens. Linear in the length.
  prefixes  the conversation rendered and tokenized up to each assistant turn, with and without the generation
            prompt: quadratic in the turns. The reference the others are tested against, and the fallback for a
            conversation the layout does not describe (a template that rewrites earlier turns, say).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..errors import DataError

IGNORE_INDEX = -100  # label of tokens that carry no loss (the Trainer's and PyTorch's cross-entropy convention)

# Llama 3's chat format (https://www.llama.com/docs/model-cards-and-prompt-formats/meta-llama-3/). The base
# Meta-Llama-3-8B tokenizer has these special tokens but ships no template. The generation marks say which part
# is the assistant's (tests check the ids against Meta's own encoder, tests/test_data.py).
CHAT_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT = {"human": "user", "gpt": "assistant"}  # ShareGPT's roles, and what they are in role/content form


def conversation_problem(messages: Any) -> str | None:
    """What makes a conversation unusable for SFT, or None: it would render as something else than it says."""
    if isinstance(messages, (str, dict)):
        what = "text" if isinstance(messages, str) else "one object"
        return (f"its messages column holds {what}, not a list of {{role, content}} messages: for plain text, "
                "name the column text (or pass --data_format text with a text column)")  # fmt: skip
    if not isinstance(messages, list) or not messages:
        return "the conversation is empty"
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            hint = " (ShareGPT's from/value: rename them role/content)" if "from" in keys else ""
            return f"message {k} has no role (it has {keys}){hint}"
        role = message["role"]
        if role not in ROLES:
            hint = f"; ShareGPT data: rename its roles {SHAREGPT}" if role in SHAREGPT else ""
            return f"message {k} has the role '{role}', not one of {', '.join(ROLES)}{hint}"
        if not isinstance(message.get("content"), str):
            what = "no" if message.get("content") is None else f"{type(message['content']).__name__}, not text,"
            return f"message {k} ({role}) has {what} content"
    if not any(message["role"] == "assistant" for message in messages):
        return "it has no assistant message, so nothing to learn"
    return None


def apply_chat_template_setting(tokenizer: PreTrainedTokenizerBase, template: str | None,
                                required: bool = True) -> None:  # fmt: skip
    """The recipe's template (named, one of TRL's shipped ones as trl:NAME, or Jinja) on the tokenizer; an error if
    conversations need one and it has none."""
    if template and template.startswith("trl:"):
        template = trl_template(template)
    if template and template not in CHAT_TEMPLATES and "{" not in template:
        named = ", ".join(CHAT_TEMPLATES)
        raise DataError(f"chat_template '{template}' is neither a named template ({named}, or trl:NAME for one of "
                        "TRL's) nor a Jinja template: pass --chat_template llama3, or leave it unset for the "
                        "tokenizer's own.")  # fmt: skip
    if template:
        tokenizer.chat_template = CHAT_TEMPLATES.get(template, template)
    if tokenizer.chat_template is None and required:
        raise DataError(
            f"The tokenizer has no chat template. Set one with --chat_template ({', '.join(CHAT_TEMPLATES)}, "
            "or a Jinja string)."
        )
    if tokenizer.pad_token is None:  # padding is masked out of attention and loss, so any token will do
        tokenizer.pad_token = tokenizer.eos_token


def trl_template(name: str) -> str:
    """`trl:NAME`: the chat template TRL ships as NAME.jinja (the families' own, tool calls included: qwen3,
    llama3_1, ...), for a tokenizer without one of its own (tiny mode's)."""
    import trl

    folder = Path(trl.__file__).parent / "chat_templates"
    path = folder / f"{name.removeprefix('trl:')}.jinja"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in folder.glob("*.jinja") if not p.stem.endswith("_training")))
        raise DataError(f"chat_template {name}: TRL ships no such template; it ships {shipped}.")
    return path.read_text()


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, layout: TurnLayout | None = None) -> list[int]:
    """What ends an answer: the end of sequence, and the special token that ends a turn in the chat template
    (<|eot_id|>, <|im_end|>), which is what a chat model emits when it is done. A base Llama 3's end of sequence is
    <|end_of_text|> (128001) while its turns end with <|eot_id|> (128009): stopping at the first alone, a chat
    fine-tune of it rambles on past its answer. (Meta's own code stops at both: llama_models' `stop_tokens`.)"""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    layout = layout or (TurnLayout.of(tokenizer) if tokenizer.chat_template else None)  # a processor's: vision.py
    if layout is not None and layout.ending:
        first = tokenizer(layout.ending, add_special_tokens=False)["input_ids"][:1]
        special = first and tokenizer.decode(first, skip_special_tokens=True) == ""
        if special and first[0] not in ids:
            ids.append(first[0])
    return ids


def text_of(content: str | list[dict]) -> str:
    """A message's text: its content, or its text parts joined (a vision conversation's)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    generation_prompt: bool = False,
    tools: list[dict] | None = None,
) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         tools=tools)  # fmt: skip


def without_nulls(value: Any) -> Any:
    """`value` without the None fields a table adds: Arrow stores a column's lists of objects with the union of
    their fields, so a tool's schema, or a call's arguments, read back with the other tools' fields as None."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return [without_nulls(v) for v in value] if isinstance(value, list) else value


def as_called(messages: list[dict]) -> list[dict]:
    """The conversation with each tool call's arguments as written (without_nulls): what the model is taught."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    return [{**m, "tool_calls": without_nulls(m["tool_calls"])} if m.get("tool_calls") else m for m in messages]


def row_tools(value: Any) -> list[dict] | None:
    """A row's `tools` column (the tools the conversation offers, as TRL's tool-calling SFT data has it): JSON
    schemas as a list, or as one JSON string (what a table keeps without merging their fields); empty is none."""
    try:
        value = json.loads(value) if isinstance(value, str) and value.strip() else value or None
    except json.JSONDecodeError as error:
        raise DataError(f"a row's tools column is not JSON ({error}): write the tools' JSON schemas as a list, or "
                        "as one JSON string of that list.") from None  # fmt: skip
    if value is not None and not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
        raise DataError(f"a row's tools column holds {type(value).__name__}, not a list of JSON schemas (objects "
                        "with type and function, as transformers' get_json_schema writes them).")  # fmt: skip
    return without_nulls(value)


def tools_problem(value: Any) -> str | None:
    """What is wrong with a row's `tools` column (loading.py names the row), or None."""
    try:
        row_tools(value)
    except DataError as error:
        return str(error).removeprefix("a row's ").removesuffix(".")  # the caller ends the sentence
    return None


def tools_text(value: Any) -> str:
    """A row's tools as one JSON string ("" for none): what a table keeps whatever the source's layout."""
    offered = row_tools(value)
    return json.dumps(offered) if offered else ""


def tokenize_by_prefixes(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_len: int,
                         tools: list[dict] | None = None) -> dict:  # fmt: skip
    """The reference: each assistant turn's tokens are the difference between the conversation rendered up to the
    turn (with the generation prompt) and rendered through it. Any template works, as long as rendering a prefix
    gives a prefix of the tokens (checked)."""

    def ids(msgs, generation_prompt=False):
        return tokenizer(render(tokenizer, msgs, generation_prompt, tools), add_special_tokens=False)["input_ids"]

    input_ids = ids(messages)
    labels = [IGNORE_INDEX] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = len(ids(messages[:i], generation_prompt=True)), ids(messages[: i + 1])
        end = len(through)
        if through != input_ids[:end]:
            raise DataError("The chat template does not render a conversation's prefix as a prefix of its tokens.")
        labels[start:end] = input_ids[start:end]
    return truncated(input_ids, labels, max_len)


def truncated(input_ids: list[int], labels: list[int], max_len: int) -> dict:
    input_ids, labels = input_ids[:max_len], labels[:max_len]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


@dataclass(frozen=True)
class TurnLayout:
    """How a template renders an assistant turn: `header` + content + `ending`."""

    header: str  # what the generation prompt adds: "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ending: str  # what follows the content in its turn: "<|eot_id|>", "<|im_end|>\n"

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, parts: bool = False) -> TurnLayout | None:
        """Learned from two renders of a probe conversation; None for a template that does not follow it. `parts`:
        the probe's contents as lists of text parts (a vision processor's template reads only those)."""

        def content(text: str) -> str | list[dict]:
            return [{"type": "text", "text": text}] if parts else text

        user = [{"role": "user", "content": content("Probe question")}]
        bare, prompt = render(tokenizer, user), render(tokenizer, user, generation_prompt=True)
        answered = render(tokenizer, [*user, {"role": "assistant", "content": content("Probe answer")}])
        if not prompt.startswith(bare) or not answered.startswith(prompt + "Probe answer"):
            return None
        return cls(prompt[len(bare) :], answered[len(prompt) + len("Probe answer") :])

    def spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]] | None:
        """Character spans of each assistant turn's labels in the rendered `text`, in order; None when a turn is
        not there as header + content (as given, or trimmed) + ending."""
        spans, cursor = [], 0
        for message in messages:
            if message["role"] != "assistant":
                continue
            said = text_of(message["content"])
            for content in dict.fromkeys((said, said.strip())):
                found = text.find(self.header + content + self.ending, cursor)
                if found >= 0:
                    start = found + len(self.header)
                    cursor = start + len(content) + len(self.ending)
                    spans.append((start, cursor))
                    break
            else:
                return None
        return spans


def labels_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool] | None:
    """Which tokens hold characters of a span. A token across a span's start is the answer's first word with the
    header's last space ("ASSISTANT: " + "It" is one token, "ĠIt"): trained. None when a token crosses a span's end
    (not a token boundary)."""
    trained, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k < len(spans) and start < spans[k][1] < end:
            return None
        trained.append(k < len(spans) and start < spans[k][1] and end > spans[k][0])
    return trained


def tokenize_conversations(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], max_len: int,
                           layout: TurnLayout | None, tools: list | None = None) -> list[dict]:  # fmt: skip
    """Each conversation's input_ids, attention_mask and labels (the assistant's tokens), as the reference
    gives them, by the fastest of the three ways that holds for the template and the conversation. `tools`: each
    conversation's `tools` column (row_tools), offered by the template as a run with --tools offers them."""
    offered = [row_tools(t) for t in tools] if tools is not None else [None] * len(conversations)
    conversations = [as_called(messages) for messages in conversations]
    if "generation %}" in (tokenizer.chat_template or ""):
        groups = (
            [(conversations, None)]
            if not any(offered)
            else [([c], t) for c, t in zip(conversations, offered, strict=True)]
        )
        rows = []
        for group, offer in groups:  # one call for the rows when none offers tools (they share none)
            out = tokenizer.apply_chat_template(group, tools=offer, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)  # fmt: skip
            rows += [truncated(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)], max_len)
                     for ids, mask in zip(out["input_ids"], out["assistant_masks"], strict=True)]  # fmt: skip
        return rows
    texts = [render(tokenizer, messages, tools=t) for messages, t in zip(conversations, offered, strict=True)]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    rows = []
    for messages, t, text, ids, offsets in zip(conversations, offered, texts, encoded["input_ids"],
                                               encoded["offset_mapping"], strict=True):  # fmt: skip
        spans = layout.spans(text, messages) if layout is not None else None
        trained = labels_from_spans(offsets, spans) if spans is not None else None
        if trained is None:
            rows.append(tokenize_by_prefixes(tokenizer, messages, max_len, t))
        else:
            rows.append(truncated(ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, trained, strict=True)],
                                  max_len))  # fmt: skip
    return rows


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_len: int) -> dict:
    """One conversation's tokens and labels (tokenize_conversations, for a single one)."""
    return tokenize_conversations(tokenizer, [messages], max_len, TurnLayout.of(tokenizer))[0]
