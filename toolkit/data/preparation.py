"""Preparing a recipe's data for training: tokenized for its task (and packed), with its collator, from the cache
when this exact preparation was made before (`python -m toolkit prepare`, an earlier run, another rank).

Tokenization goes through `datasets.map`; the result is kept under a key of everything that decides it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import ClassLabel, DatasetDict
from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding, PreTrainedTokenizerBase

from ..errors import ConfigError, DataError
from ..metrics.samples import Prompt, held_out_prompts
from ..project import aside, cache_root
from ..settings.arguments import Arguments, DataArguments
from ..settings.mesh import sequence_split
from ..settings.tasks import task
from .conversations import IGNORE_INDEX, TurnLayout, apply_chat_template_setting
from .formats import kind, tokenize_rows
from .image_rows import measured
from .length_grouping import LENGTH
from .loading import load_data, require_columns
from .packing import PackedCollator, pack
from .vision import VisionCollator

PER_WORKER = 2000  # conversations a tokenizing process should have to do, to be worth starting (~1 s of start-up)


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset
    eval: Any | None
    collator: Any
    label_names: list[str] | None  # classification only
    note: str = ""  # where it came from: the cache, or tokenized now and how long it took
    prompts: list[Prompt] = field(default_factory=list)  # --generation_samples: held-out conversations, cut
    packed: bool = False  # rows hold several examples (packing.py)

    def summary(self) -> dict[str, Any]:
        """What the run's summary and model card say of its data."""
        return {"train_rows": len(self.train), "eval_rows": len(self.eval) if self.eval is not None else 0,
                "packed": self.packed, "note": self.note}  # fmt: skip


# --------------------------------------------------------------------------------------- classification


def label_names(ds: DatasetDict, column: str) -> list[str]:
    feature = ds["train"].features[column]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = set(ds["train"].unique(column))
    if "eval" in ds:
        values |= set(ds["eval"].unique(column))
    return [str(v) for v in sorted(values)]


def tokenized_classification(ds: DatasetDict, tokenizer: PreTrainedTokenizerBase,
                             args: DataArguments) -> tuple[DatasetDict, list[str]]:  # fmt: skip
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

    return ds.map(tokenize, batched=True, remove_columns=ds["train"].column_names, desc="Tokenizing"), names


# ---------------------------------------------------------------------------------------------------- SFT


def workers(rows: int) -> int | None:
    """Processes to tokenize with: one per CPU core for data sets large enough to repay starting them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, rows // PER_WORKER) if rows >= 2 * PER_WORKER and cores > 1 else None


def tokenized_sft(ds: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments,
                  packing: bool) -> DatasetDict:  # fmt: skip
    data_format = kind(ds["train"].column_names, args.messages_column)
    layout = TurnLayout.of(tokenizer) if tokenizer.chat_template else None  # learned once here, not per worker

    def tokenize(batch):
        rows = tokenize_rows(tokenizer, batch, data_format, args.messages_column, args.max_seq_length, layout)
        out = {key: [row[key] for row in rows] for key in ("input_ids", "attention_mask", "labels")}
        return {**out, LENGTH: [len(ids) for ids in out["input_ids"]]}  # for length-grouped batching

    tokenized = DatasetDict({
        name: split.map(tokenize, batched=True, remove_columns=split.column_names, num_proc=workers(len(split)),
                        desc=f"Tokenizing {name}")
        for name, split in ds.items()
    })  # fmt: skip
    # A row whose trained tokens were all truncated away teaches nothing.
    tokenized = tokenized.filter(lambda row: any(x != IGNORE_INDEX for x in row["labels"]), desc="Filtering")
    if len(tokenized["train"]) == 0:
        raise DataError(f"No training row has a token to learn (an assistant's, a completion's) within "
                        f"max_seq_length={args.max_seq_length}: raise it.")  # fmt: skip
    if packing:  # several rows per row (packing.py)
        tokenized = DatasetDict({split: pack(rows, args.max_seq_length) for split, rows in tokenized.items()})
    return tokenized


def prepared_folder(ds: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments, packing: bool) -> Path:
    """Where this preparation is kept: named by everything that decides it, so a launch finds what `python -m
    toolkit prepare` (or an earlier run) made, and a change to any of it makes a new one. The input splits by
    datasets' own fingerprints (of the files, and of each selection and split made of them), the tokenizer by
    its full definition and chat template, the settings, and the source of the code that tokenizes and packs."""
    from . import conversations, formats
    from . import packing as packing_module

    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    code = (inspect.getsource(module) for module in (sys.modules[__name__], conversations, formats, packing_module))
    parts = [json.dumps({name: split._fingerprint for name, split in ds.items()}), definition,
             json.dumps([tokenizer.chat_template, tokenizer.pad_token, type(tokenizer).__name__, packing,
                         dataclasses.asdict(args)], sort_keys=True, default=str), *code]  # fmt: skip
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_root() / "prepared" / f"{args.task}-{key}"


def set_template(ds: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments) -> None:
    """SFT: the recipe's chat template on the tokenizer, where the rows need one (it decides the tokens, so it is
    set before the cache key is computed); text rows need none."""
    if args.task == "sft":
        rows = kind(ds["train"].column_names, args.messages_column)
        conversational = rows == "messages" or (
            rows == "prompt_completion" and isinstance(ds["train"][0]["prompt"], list)
        )
        apply_chat_template_setting(tokenizer, args.chat_template, required=conversational)


def counted(train) -> dict[str, int]:
    """Training examples and their tokens, in a tokenized split (packed rows: their conversations)."""
    examples = len(train)
    if "position_ids" in train.column_names:
        examples = sum(row.count(0) for row in train["position_ids"])
    return {"examples": examples, "tokens": sum(train[LENGTH])}


SAMPLE_ROWS = 1000  # raw rows tokenized to estimate a data set's tokens without preparing it


def data_tokens(args: Arguments, tokenizer: PreTrainedTokenizerBase, packing: bool) -> tuple[int, int, str]:
    """(training examples, their tokens, where the figures come from), for the planner's time and cost: this exact
    preparation's own count when it is in the cache (`python -m toolkit prepare`, an earlier run), else a seeded
    sample of the raw rows tokenized as the run will, scaled to them all."""
    raw, _ = load_data(args.data)
    set_template(raw, tokenizer, args.data)
    meta = prepared_folder(raw, tokenizer, args.data, packing) / "meta.json"
    if meta.is_file() and "tokens" in (found := json.loads(meta.read_text())):
        return found["examples"], found["tokens"], "the prepared data's own count"
    train = raw["train"]
    sample = train.shuffle(seed=0).select(range(min(SAMPLE_ROWS, len(train))))
    part = DatasetDict({"train": sample})
    if args.data.task == "classification":
        tokenized = tokenized_classification(part, tokenizer, args.data)[0]["train"]
    else:
        tokenized = tokenized_sft(part, tokenizer, args.data, packing=False)["train"]
    figures = counted(tokenized)
    scale = len(train) / len(sample)
    return (round(figures["examples"] * scale), round(figures["tokens"] * scale),
            f"a sample of {len(sample):,} of the {len(train):,} raw rows, tokenized as the run will")  # fmt: skip


def prepare(ds: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: DataArguments, main_process_first,
            packing: bool = False, processor: Any = None) -> PreparedData:  # fmt: skip
    """Tokenized (and packed) splits and their collator, from the cache when this exact preparation was made
    before (by `python -m toolkit prepare`, or another run or rank), else made now and kept there. Image-text
    rows (`processor`: the model's) are measured instead, and stay as read (image_rows.py)."""
    if len(ds["train"]) == 0:
        names = "', '".join(args.sources())
        raise DataError(f"The training split of '{names}' is empty.")
    if task(args.task).images:
        return prepared_images(ds, processor, args)
    if task(args.task).tokenized_by_trainer:  # TRL's trainers apply the chat template and tokenize themselves
        first = ds["train"][0]["chosen" if task(args.task).pairs else "prompt"]
        apply_chat_template_setting(tokenizer, args.chat_template, required=not isinstance(first, str))
        return PreparedData(ds["train"], ds.get("eval"), None, None)
    set_template(ds, tokenizer, args)
    folder = prepared_folder(ds, tokenizer, args, packing)
    with main_process_first(desc="preparing data"):
        if (folder / "meta.json").is_file():
            meta = json.loads((folder / "meta.json").read_text())
            tokenized = DatasetDict.load_from_disk(str(folder / "data"))
            note = f"from the cache {folder} (prepared {meta['prepared']}, in {meta['seconds']:.1f} s)"
        else:
            start = time.perf_counter()
            names = None
            if args.task == "classification":
                tokenized, names = tokenized_classification(ds, tokenizer, args)
            else:
                tokenized = tokenized_sft(ds, tokenizer, args, packing)
            meta = {"prepared": time.strftime("%Y-%m-%d %H:%M"), "seconds": time.perf_counter() - start,
                    "label_names": names, "rows": {name: len(split) for name, split in tokenized.items()},
                    **counted(tokenized["train"])}  # fmt: skip
            if os.environ.get("LOCAL_RANK", "0") == "0":
                keep(tokenized, meta, folder)
            rows = sum(len(split) for split in ds.values())
            note = f"tokenized {rows:,} rows in {meta['seconds']:.1f} s, kept in {folder}"
    if args.task == "classification":
        collator = DataCollatorWithPadding(tokenizer)
    elif packing or sequence_split() > 1:  # a split needs position_ids in every batch (PackedCollator)
        collator = PackedCollator(tokenizer.pad_token_id)
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True)
    return PreparedData(tokenized["train"], tokenized.get("eval"), collator, meta["label_names"], note)


def prepared_images(ds: DatasetDict, processor: Any, args: DataArguments) -> PreparedData:
    """Image-text rows as read, each measured by the processor (its tokens with its images'), those an image cut
    would split left out and counted; the collator runs the processor on each batch."""
    collator = VisionCollator(processor, args.max_seq_length, args.image_max_pixels)
    start, splits, left_out = time.perf_counter(), {}, 0
    for name, split in ds.items():
        splits[name], dropped = measured(split, collator, name)
        left_out += dropped
    rows = sum(len(split) for split in ds.values())
    note = f"{rows:,} image-text rows measured by the model's processor in {time.perf_counter() - start:.1f} s"
    if left_out:
        note += (f"; {left_out:,} left out, their images' tokens ending past --max_seq_length {args.max_seq_length} "
                 "(raise it, or lower the image resolution)")  # fmt: skip
    return PreparedData(splits["train"], splits.get("eval"), collator, None, note)


def keep(tokenized: DatasetDict, meta: dict, folder: Path) -> None:
    """Written aside, then renamed: a reader finds the whole preparation or none."""
    partial = aside(folder, "partial")
    tokenized.save_to_disk(str(partial / "data"))
    (partial / "meta.json").write_text(json.dumps(meta))
    try:
        partial.replace(folder)
    except OSError:  # another process kept the same preparation first
        shutil.rmtree(partial, ignore_errors=True)


def prepare_data(args: Arguments, tokenizer: PreTrainedTokenizerBase, packing: bool,
                 pad_to_multiple_of: int | None = None, processor: Any = None) -> PreparedData:  # fmt: skip
    """The data room's entry: the recipe's data read and checked (loading.py), prepared for its task (tokenized,
    packed, cached), with the held-out prompts --generation_samples answers. `pad_to_multiple_of`: every batch's
    width is a multiple of it (what the attention kernel needs, models/attention.py's pad_multiple, and a sequence
    split, settings/mesh.py's split_multiple)."""
    raw, read = load_data(args.data)
    data = prepare(raw, tokenizer, args.data, args.training.main_process_first, packing, processor)
    data.packed = packing
    if packing:  # flash attention's varlen path needs the micro-batch as one flattened row (packing.py)
        data.collator.flatten = "flash" in str(args.model.attn_implementation)
    if data.collator is not None:  # each of the three collators has the setting (DPO's is TRL's: the runner's)
        data.collator.pad_to_multiple_of = pad_to_multiple_of
    data.note = "; ".join(filter(None, [read, data.note]))
    if args.run.generation_samples:
        held_out = raw["eval"]
        if args.data.messages_column not in held_out.column_names:
            raise ConfigError("generation_samples answers held-out conversations: this data set has none (it is "
                              "prompt/completion or text): drop generation_samples.")  # fmt: skip
        first = held_out.select(range(min(len(held_out), 8 * args.run.generation_samples)))
        data.prompts = held_out_prompts(first[args.data.messages_column], args.run.generation_samples)
    return data
