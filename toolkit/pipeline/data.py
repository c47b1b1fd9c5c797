"""Data: load a data set (Hub, local file, or folder of class subfolders) and tokenize it for the task.

Tokenization goes through `datasets.map`, so it is cached on disk and reused by later runs and other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import ClassLabel, Dataset, DatasetDict, load_dataset
from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding, PreTrainedTokenizerBase

from ..errors import ToolkitError, warn
from .arguments import DataArguments
from .length_grouping import LENGTH
from .packing import IGNORE_INDEX, PackedCollator, pack
from .sources import check_hub_dataset, resolve

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

# Llama 3's chat format (https://www.llama.com/docs/model-cards-and-prompt-formats/meta-llama-3/). The base
# Meta-Llama-3-8B tokenizer has these special tokens but ships no template.
CHAT_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}


class DataError(ToolkitError, ValueError):
    """A data set that does not fit the recipe: missing columns, no rows left, ..."""


@dataclass
class PreparedData:
    train: Dataset
    eval: Dataset | None
    collator: Any
    label_names: list[str] | None  # classification only


def load_raw(args: DataArguments) -> DatasetDict:
    """Load the data set named by the recipe; eval split by name or held out from train."""
    name = resolve(args.dataset_name)
    path = Path(name)
    if path.is_dir() and not any(path.glob("*.json*")) and _class_folders(path):
        ds = DatasetDict({"train": _load_class_folders(path, args.text_encoding)})
    elif path.is_file():
        ds = DatasetDict({"train": _load_file(path)})
    else:
        check_hub_dataset(name)
        ds = load_dataset(name, args.dataset_config)
    for split in {args.train_split, args.eval_split} - {None}:
        if split not in ds:
            raise DataError(f"Data set '{args.dataset_name}' has no split '{split}'; it has {sorted(ds)}.")
        ds[split] = checked_rows(ds[split], split, args)
    train = ds[args.train_split]
    evaluation = ds[args.eval_split] if args.eval_split else None
    if evaluation is None and args.eval_fraction > 0:
        stratify = args.label_column if isinstance(train.features.get(args.label_column), ClassLabel) else None
        split = train.train_test_split(test_size=args.eval_fraction, seed=0, stratify_by_column=stratify)
        train, evaluation = split["train"], split["test"]
    out = DatasetDict({"train": _head(train, args.max_train_samples)})
    if evaluation is not None:
        out["eval"] = _head(evaluation, args.max_eval_samples)
    return out


def _load_file(path: Path) -> Dataset:
    """A local json/jsonl/csv/parquet file; an empty or malformed one is one error naming the file and the row."""
    from datasets.exceptions import DatasetGenerationError

    fmt = LOCAL_FORMATS.get(path.suffix)
    if fmt is None:
        raise DataError(f"Unsupported data file {path}: use one of {sorted(LOCAL_FORMATS)}.")
    with open(path, "rb") as f:
        empty = not f.read(4096).strip()
    if empty:
        raise DataError(f"{path} is empty: point --dataset_name at a file with rows.")
    try:
        return load_dataset(fmt, data_files={"train": str(path)})["train"]
    except (DatasetGenerationError, StopIteration) as error:
        cause = error
        while cause.__cause__ is not None:  # datasets wraps the parser's error: the root names the row
            cause = cause.__cause__
        detail = " ".join(str(cause).split()) or type(cause).__name__
        raise DataError(f"{path} cannot be read as {fmt} ({detail}): fix that row (rows count from 0), or remove "
                        "it.") from None  # fmt: skip


def _head(ds: Dataset, n: int | None) -> Dataset:
    return ds.select(range(min(n, len(ds)))) if n else ds


def _class_folders(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and any(d.glob("*.txt")))


def _load_class_folders(root: Path, encoding: str) -> Dataset:
    """`root/<class>/*.txt` -> rows of (text, label), the label a ClassLabel of the folder names."""
    classes = _class_folders(root)
    texts, labels = [], []
    for index, folder in enumerate(classes):
        for file in sorted(folder.glob("*.txt")):
            try:
                texts.append(file.read_text(encoding=encoding))
            except UnicodeDecodeError as error:
                raise DataError(f"{file} is not {encoding} text ({error.reason} at byte {error.start}): pass its "
                                "encoding with --text_encoding, e.g. latin-1.") from None  # fmt: skip
            labels.append(index)
    names = [c.name for c in classes]
    return Dataset.from_dict({"text": texts, "label": labels}).cast_column("label", ClassLabel(names=names))


# ------------------------------------------------------------------------------------- rows checked


ROLES = ("system", "user", "assistant", "tool")
SHAREGPT = {"human": "user", "gpt": "assistant"}  # ShareGPT's roles, and what they are in role/content form


def conversation_problem(messages: Any) -> str | None:
    """What makes a conversation unusable for SFT, or None: it would render as something else than it says."""
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


def label_problem(num_classes: int | None) -> Any:
    """What makes a classification row unusable: no text, no label, or a label outside the ClassLabel's range."""

    def problem(text: Any, label: Any) -> str | None:
        if not isinstance(text, str) or not text.strip():
            return "its text is empty"
        if label is None:
            return "it has no label"
        if num_classes is not None and not 0 <= label < num_classes:
            return (f"its label {label} is not one of the {num_classes} classes (0 to {num_classes - 1}; -1 marks an "
                    "unlabeled row, as in GLUE's test splits)")  # fmt: skip
        return None

    return problem


def checked_rows(split: Dataset, name: str, args: DataArguments) -> Dataset:
    """The rows of a split, each checked before tokenizing: the first unusable one is an error naming its index
    (0-based, in the file's order) and the fix; with --skip_bad_rows the unusable ones are left out and counted."""
    if args.task == "sft":
        columns, problem_of = [args.messages_column], conversation_problem
        require_columns(split, columns, "--messages_column")
    else:
        text = [c.strip() for c in args.text_columns.split(",")][0]
        columns = [text, args.label_column]
        require_columns(split, [text], "--text_columns")
        require_columns(split, [args.label_column], "--label_column")
        feature = split.features[args.label_column]
        problem_of = label_problem(feature.num_classes if isinstance(feature, ClassLabel) else None)
    bad: list[tuple[int, str]] = []
    for start, batch in zip(range(0, len(split), 1000), split.select_columns(columns).iter(1000), strict=False):
        for offset, row in enumerate(zip(*(batch[c] for c in columns), strict=True)):
            problem = problem_of(*row)
            if problem and not args.skip_bad_rows:
                raise DataError(f"row {start + offset} of the {name} split of {args.dataset_name}: {problem}. Fix the "
                                "data, or pass --skip_bad_rows true to leave such rows out.")  # fmt: skip
            if problem:
                bad.append((start + offset, problem))
    if not bad:
        return split
    warn(f"left out {len(bad)} of {len(split)} rows of the {name} split (--skip_bad_rows); the first, row "
         f"{bad[0][0]}: {bad[0][1]}.")  # fmt: skip
    dropped = {index for index, _ in bad}
    return split.select([i for i in range(len(split)) if i not in dropped])


def require_columns(ds: Dataset, columns: list[str], flag: str) -> None:
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise DataError(
            f"The data set has no column {missing} (it has {ds.column_names}). Point the recipe at the right "
            f"column with {flag}."
        )


# --------------------------------------------------------------------------------------- classification


def label_names(ds: DatasetDict, column: str) -> list[str]:
    feature = ds["train"].features[column]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = set(ds["train"].unique(column))
    if "eval" in ds:
        values |= set(ds["eval"].unique(column))
    return [str(v) for v in sorted(values)]


def prepare_classification(
    ds: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments, main_process_first
) -> PreparedData:
    text_columns = [c.strip() for c in args.text_columns.split(",")]
    if not 1 <= len(text_columns) <= 2:
        raise DataError(f"text_columns takes one column or a pair, got {text_columns}.")
    for split in ds.values():
        require_columns(split, text_columns, "--text_columns")
        require_columns(split, [args.label_column], "--label_column")
    names = label_names(ds, args.label_column)
    is_class_label = isinstance(ds["train"].features[args.label_column], ClassLabel)
    index = {name: i for i, name in enumerate(names)}

    def tokenize(batch):
        out = tokenizer(*[batch[c] for c in text_columns], truncation=True, max_length=args.max_seq_length)
        labels = batch[args.label_column]
        out["labels"] = labels if is_class_label else [index[str(v)] for v in labels]
        out[LENGTH] = [len(x) for x in out["input_ids"]]  # for length-grouped batching
        return out

    with main_process_first(desc="tokenizing"):
        tokenized = ds.map(tokenize, batched=True, remove_columns=ds["train"].column_names, desc="Tokenizing")
    return PreparedData(
        tokenized["train"], tokenized.get("eval"), DataCollatorWithPadding(tokenizer), label_names=names
    )


# ---------------------------------------------------------------------------------------------------- SFT


def apply_chat_template_setting(tokenizer: PreTrainedTokenizerBase, template: str | None) -> None:
    if template and template not in CHAT_TEMPLATES and "{" not in template:
        named = ", ".join(CHAT_TEMPLATES)
        raise DataError(f"chat_template '{template}' is neither a named template ({named}) nor a Jinja template: "
                        "pass --chat_template llama3, or leave it unset for the tokenizer's own.")  # fmt: skip
    if template:
        tokenizer.chat_template = CHAT_TEMPLATES.get(template, template)
    if tokenizer.chat_template is None:
        raise DataError(
            f"The tokenizer has no chat template. Set one with --chat_template ({', '.join(CHAT_TEMPLATES)}, "
            "or a Jinja string)."
        )
    if tokenizer.pad_token is None:  # padding is masked out of attention and loss, so any token will do
        tokenizer.pad_token = tokenizer.eos_token


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_len: int) -> dict:
    """Token ids of a whole conversation, with labels only on the assistant's tokens.

    Each assistant turn's tokens are found as the difference between the conversation rendered up to the
    turn (with the generation prompt) and rendered through it, so any template works, as long as rendering a
    prefix gives a prefix of the tokens (checked).
    """

    def ids(msgs, generation_prompt=False):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

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
    input_ids, labels = input_ids[:max_len], labels[:max_len]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def prepare_sft(ds: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments, main_process_first,
                packing: bool = False):  # fmt: skip
    apply_chat_template_setting(tokenizer, args.chat_template)
    for split in ds.values():
        require_columns(split, [args.messages_column], "--messages_column")

    def tokenize(row):
        out = tokenize_conversation(tokenizer, row[args.messages_column], args.max_seq_length)
        return {**out, LENGTH: len(out["input_ids"])}  # for length-grouped batching

    with main_process_first(desc="tokenizing"):
        tokenized = ds.map(tokenize, remove_columns=ds["train"].column_names, desc="Tokenizing")
        # A conversation whose assistant turns were all truncated away teaches nothing.
        tokenized = tokenized.filter(lambda row: any(x != IGNORE_INDEX for x in row["labels"]), desc="Filtering")
    if len(tokenized["train"]) == 0:
        raise DataError(f"No training conversation has an assistant token within max_seq_length={args.max_seq_length}.")
    if packing:  # several conversations per row (packing.py)
        with main_process_first(desc="packing"):
            tokenized = {split: pack(rows, args.max_seq_length) for split, rows in tokenized.items()}
        collator = PackedCollator(tokenizer.pad_token_id)
        return PreparedData(tokenized["train"], tokenized.get("eval"), collator, label_names=None)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True)
    return PreparedData(tokenized["train"], tokenized.get("eval"), collator, label_names=None)


def prepare(ds: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments, main_process_first,
            packing: bool = False):  # fmt: skip
    if len(ds["train"]) == 0:
        raise DataError(f"The training split of '{args.dataset_name}' is empty.")
    if args.task == "classification":
        return prepare_classification(ds, tokenizer, args, main_process_first)
    return prepare_sft(ds, tokenizer, args, main_process_first, packing)
