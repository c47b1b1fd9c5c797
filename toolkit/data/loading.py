"""Reading a recipe's data: a data set (Hub, local file, folder of class subfolders, `package:` path) or a weighted
mixture of several, its splits, and every row checked before anything is tokenized (preparation.py does that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
from datasets import ClassLabel, Dataset, DatasetDict, concatenate_datasets, load_dataset

from ..errors import DataError, warn
from ..settings.arguments import DataArguments
from ..settings.tasks import task
from .conversations import tools_problem, tools_text
from .formats import FORMATS, PROBLEMS, columns_of, detect, kind_of, to_messages
from .held_out import split_by_prompt
from .image_rows import absolute_paths, image_columns, image_problem
from .labelled import LABELLED_COLUMNS, labelled_problem
from .preference import PAIR_COLUMNS, kept_columns, pair_problem
from .prompts import as_prompts, prompt_problem
from .sources import check_hub_dataset, resolve

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_raw(args: DataArguments) -> DatasetDict:
    """The recipe's data: its train rows (and eval rows, by split name or held out from train), checked."""
    return load_data(args)[0]


def load_data(args: DataArguments) -> tuple[DatasetDict, str]:
    """The recipe's data set, or the mixture of several (each source's share of rows drawn with a fixed seed,
    then shuffled together; eval rows of every source kept whole), and a line saying what was read, how."""
    weights = args.sources()
    parts = {name: load_source(name, args) for name in weights}
    formats = {name: data_format for name, (_, data_format) in parts.items()}
    if len({kind_of(f) for f in formats.values()}) > 1:
        raise DataError(f"The mixture's data sets are of formats that do not mix: {formats}. Mix conversations "
                        "(messages, sharegpt, alpaca) with conversations, text with text.")  # fmt: skip
    how = "" if args.data_format else ", detected"
    described = []
    for name, (part, data_format) in parts.items():
        described.append(name + (f" ({data_format}{how})" if data_format else ""))
        if len(parts) > 1:
            described[-1] += f" x{weights[name]:g} = {round(weights[name] * len(part['train'])):,} rows"
    if len(parts) == 1:
        ds = next(iter(parts.values()))[0]
    else:
        ds = mixed({name: part for name, (part, _) in parts.items()}, weights)
    out = DatasetDict({"train": _head(ds["train"], args.max_train_samples)})
    if "eval" in ds:
        out["eval"] = _head(ds["eval"], args.max_eval_samples)
    mixture = "a mixture of " if len(parts) > 1 else ""
    return out, mixture + ", ".join(described)


def aligned(splits: list[Dataset]) -> list[Dataset]:
    """The sources' splits with one layout per column where one can hold the others: datasets keeps conversations
    with tool calls as JSON objects (its `Json` feature) and plain ones as structs (a column one source lacks, its
    rows get as None: a source without `tools` offers none); whatever no layout holds is left for the caller's
    error."""
    for column in splits[0].column_names:
        layouts = list(dict.fromkeys(repr(s.features[column]) for s in splits if column in s.column_names))
        if len(layouts) < 2:
            continue
        for layout in (s.features[column] for s in splits if column in s.column_names):
            try:
                splits = [s.cast_column(column, layout) if column in s.column_names else s for s in splits]
                break
            except (TypeError, ValueError, NotImplementedError, pa.ArrowException):
                continue
    return splits


def load_source(name: str, args: DataArguments) -> tuple[DatasetDict, str | None]:
    """One data set's train and eval splits, its rows checked and read in its format (conversations as
    messages), only the columns the task uses kept; and that format (sft) or None."""
    resolved = resolve(name)
    path = Path(resolved)
    if path.is_dir() and not any(path.glob("*.json*")) and _class_folders(path):
        ds = DatasetDict({"train": _load_class_folders(path, args.text_encoding)})
    elif path.is_file():
        ds = DatasetDict({"train": _load_file(path)})
    else:
        check_hub_dataset(resolved)
        ds = load_dataset_or_say_why(resolved, name, args.dataset_config)
    splits = {args.train_split, args.eval_split} - {None}
    for split in splits:  # before the columns are read: a misspelt split is named as such
        if split not in ds:
            raise DataError(f"Data set '{name}' has no split '{split}'; it has {sorted(ds)}.")
    data_format = None
    if args.task == "sft":
        train_columns = ds[args.train_split].column_names
        data_format = args.data_format or detect(train_columns, args.messages_column, f"Data set '{name}'")
    for split in splits:
        ds[split] = checked_rows(ds[split], split, name, args, data_format)
    train = ds[args.train_split]
    evaluation = ds[args.eval_split] if args.eval_split else None
    if evaluation is None and args.eval_fraction > 0:  # by prompt where rows have one (held_out.py), else by row
        by_prompt = None
        if args.task != "classification" and not task(args.task).images:
            by_prompt = split_by_prompt(train, args.eval_fraction, args.messages_column)
        if by_prompt is not None:
            train, evaluation = by_prompt
        else:
            stratify = args.label_column if isinstance(train.features.get(args.label_column), ClassLabel) else None
            split = train.train_test_split(test_size=args.eval_fraction, seed=0, stratify_by_column=stratify)
            train, evaluation = split["train"], split["test"]
    out = DatasetDict({"train": train} if evaluation is None else {"train": train, "eval": evaluation})
    return out, data_format


def load_dataset_or_say_why(resolved: str, name: str, config: str | None) -> DatasetDict:
    """`datasets.load_dataset` of a local folder or a Hub id, its failures one DataError naming the fix (a folder
    without data files, a data set or config that is not there, files it cannot parse)."""
    from datasets.exceptions import DataFilesNotFoundError, DatasetGenerationError, DatasetNotFoundError

    try:
        return load_dataset(resolved, config)
    except (DataFilesNotFoundError, DatasetNotFoundError, DatasetGenerationError, FileNotFoundError, ValueError,
            ConnectionError) as error:  # fmt: skip
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        message = " ".join(str(cause).split())[:200] or type(cause).__name__
        if Path(resolved).is_dir():
            fix = (f"point --dataset_name at a folder of {', '.join(sorted(LOCAL_FORMATS))} files, at one such file, "
                   "or at a folder of class subfolders of .txt files")  # fmt: skip
        else:
            fix = "check the name and --dataset_config on the Hub (`hf auth login` for a gated one)"
        raise DataError(f"Data set '{name}' cannot be read ({message}): {fix}.") from None


def mixed(parts: dict[str, DatasetDict], weights: dict[str, float]) -> DatasetDict:
    """alignment-handbook's mixture: each source's fraction of its train rows (whole copies, then a seeded
    sample), shuffled together; the eval rows of every source."""
    trains = []
    for name, part in parts.items():
        rows = len(part["train"])
        whole, remainder = divmod(round(weights[name] * rows), rows)
        if whole == remainder == 0:
            raise DataError(f"dataset_mixture's fraction {weights[name]:g} of the {rows} rows of {name} is no row: "
                            "raise it.")  # fmt: skip
        trains += [part["train"]] * whole + [part["train"].shuffle(seed=0).select(range(remainder))] * (remainder > 0)
    evals = [part["eval"] for part in parts.values() if "eval" in part]
    try:
        out = DatasetDict({"train": concatenate_datasets(aligned(trains)).shuffle(seed=0)})
        if evals:
            out["eval"] = concatenate_datasets(aligned(evals))
    except ValueError as error:  # features that do not line up
        features = {name: dict(part["train"].features) for name, part in parts.items()}
        raise DataError(f"The mixture's data sets have columns of different types ({' '.join(str(error).split())}): "
                        f"{features}. Make them agree, e.g. by saving each as jsonl.") from None  # fmt: skip
    return out


def _load_file(path: Path) -> Dataset:
    """A local json/jsonl/csv/parquet file; an empty or malformed one is one error naming the file and the row, one
    that holds no row (a csv header alone, a json `[]`) one naming the file."""
    from datasets import load_dataset_builder
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
    except ValueError:  # datasets read the file and wrote no row: it has none ("corresponds to no data")
        written = (load_dataset_builder(fmt, data_files={"train": str(path)}).info.splits or {}).get("train")
        if written is None or written.num_examples:
            raise
        raise DataError(f"{path} has no rows (a header or an empty list alone): point --dataset_name at a file with "
                        "rows.") from None  # fmt: skip


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


def checked_rows(split: Dataset, name: str, source: str, args: DataArguments, data_format: str | None) -> Dataset:
    """The rows of a split, each checked before tokenizing (the first unusable one is an error naming its index,
    0-based in the file's order, and the fix; with --skip_bad_rows the unusable ones are left out and counted),
    read as messages where the format is a conversation's, and only the task's columns kept."""
    offered = False  # an SFT row's `tools` column: the tools its conversation offers, checked beside it
    if task(args.task).pairs:
        if not set(PAIR_COLUMNS) <= set(split.column_names):
            raise DataError(f"task {args.task} trains on preference pairs, chosen and rejected columns (UltraFeedback-"
                            f"binarized's layout); the {name} split of {source} has {split.column_names}: rename its "
                            "columns, or point --dataset_name at preference data.")  # fmt: skip
        columns, problem_of, keep = PAIR_COLUMNS, pair_problem, kept_columns(split)
    elif task(args.task).labelled:
        if not set(LABELLED_COLUMNS) <= set(split.column_names):
            raise DataError(f"task {args.task} trains on labelled completions, prompt, completion and label columns "
                            f"(TRL's unpaired layout: kto-mix-14k's); the {name} split of {source} has "
                            f"{split.column_names}: rename its columns; pairs (chosen, rejected) train with --task "
                            "dpo.")  # fmt: skip
        columns, problem_of, keep = LABELLED_COLUMNS, labelled_problem, LABELLED_COLUMNS
    elif task(args.task).samples_online:
        if args.prompt_column not in split.column_names:
            raise DataError(f"task {args.task} samples completions to prompts (text, or a conversation ending on the "
                            f"user's turn); the {name} split of {source} has no column '{args.prompt_column}', it has "
                            f"{split.column_names}: name the prompts' column with --prompt_column.")  # fmt: skip
        columns, problem_of, keep = [args.prompt_column], prompt_problem, split.column_names  # rewards read them
    elif task(args.task).images:  # image-and-text conversations, each image opened (image_rows.py)
        columns = keep = image_columns(split.column_names, f"the {name} split of {source}")
        problem_of = image_problem(columns, root := data_folder(source))
    elif data_format is not None:
        columns = columns_of(data_format, args.messages_column)
        flag = "--messages_column" if data_format == "messages" else f"--data_format (it is {data_format})"
        require_columns(split, columns, flag)
        problem_of, keep = PROBLEMS[data_format], columns
        offered = data_format in ("messages", "prompt_completion") and "tools" in split.column_names
        if offered:
            keep = [*columns, "tools"]  # the tools each conversation offers (TRL's tool-calling SFT data)
    else:
        text_columns = [c.strip() for c in args.text_columns.split(",")]
        columns = [text_columns[0], args.label_column]
        require_columns(split, [text_columns[0]], "--text_columns")
        require_columns(split, [args.label_column], "--label_column")
        feature = split.features[args.label_column]
        problem_of = label_problem(feature.num_classes if isinstance(feature, ClassLabel) else None)
        keep = [c for c in [*text_columns, args.label_column] if c in split.column_names]
    # A JSON file mixing formats loads as the union of their columns, each row's others empty (None): a row of
    # another format is named as such, not as an empty row of this one.
    others = {f: columns_of(f, args.messages_column) for f in FORMATS if f != data_format and data_format
              and set(columns_of(f, args.messages_column)) <= set(split.column_names)}  # fmt: skip
    read = list(dict.fromkeys([*columns, *(c for cs in others.values() for c in cs), *(["tools"] * offered)]))
    bad: list[tuple[int, str]] = []
    for start, batch in zip(range(0, len(split), 1000), split.select_columns(read).iter(1000), strict=False):
        for offset, values in enumerate(zip(*(batch[c] for c in read), strict=True)):
            row = dict(zip(read, values, strict=True))
            problem = problem_of(*(row[c] for c in columns)) or (tools_problem(row["tools"]) if offered else None)
            if problem and (mixed := next((f for f, cs in others.items() if all(row[c] is not None for c in cs)),
                                          None)):  # fmt: skip
                raise DataError(f"row {start + offset} of the {name} split of {source} is a {mixed} row ("
                                f"{', '.join(others[mixed])}) among {data_format} rows ({', '.join(columns)}): one "
                                "format per data set. Split the file by format (a dataset_mixture can train on "
                                "both), or convert its rows (docs/data.md).")  # fmt: skip
            if problem and not args.skip_bad_rows:
                raise DataError(f"row {start + offset} of the {name} split of {source}: {problem}. Fix the data, "
                                "or pass --skip_bad_rows true to leave such rows out.")  # fmt: skip
            if problem:
                bad.append((start + offset, problem))
    if bad:
        warn(f"left out {len(bad)} of {len(split)} rows of the {name} split of {source} (--skip_bad_rows); the "
             f"first, row {bad[0][0]}: {bad[0][1]}.")  # fmt: skip
        dropped = {index for index, _ in bad}
        split = split.select([i for i in range(len(split)) if i not in dropped])
    if data_format in ("sharegpt", "alpaca"):
        return to_messages(split, data_format, args.messages_column)
    if task(args.task).samples_online:
        return as_prompts(split, args.prompt_column)
    if task(args.task).images:
        return absolute_paths(split.select_columns(keep), columns, root)
    if offered:  # one JSON string a row: sources of other layouts (list, string) then mix
        return split.select_columns(keep).map(lambda row: {"tools": tools_text(row["tools"])})
    return split.select_columns(keep)


def data_folder(source: str) -> Path | None:
    """The folder a local data set's relative paths (its images) start from; None for a Hub data set."""
    path = Path(resolve(source))
    return path.parent if path.is_file() else path if path.is_dir() else None


def require_columns(ds: Dataset, columns: list[str], flag: str) -> None:
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise DataError(
            f"The data set has no column {missing} (it has {ds.column_names}). Point the recipe at the right "
            f"column with {flag}."
        )
