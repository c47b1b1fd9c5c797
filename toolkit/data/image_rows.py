"""vlm_sft's rows through the data room: checked as read (each image opened; one line for a row that cannot train),
image paths made absolute (relative ones are the data file's folder's), then measured with the model's own
processor: each row's tokens with its images' (length-grouped batches, the token counts), and the rows whose image
--max_seq_length would cut left out and counted. The rows stay as read: the collator (vision.py) runs the processor
on each batch, in the family's own pixel layout, so nothing is tokenized ahead or cached.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import DataError
from .length_grouping import LENGTH
from .vision import VisionCollator, extents, vision_conversation

# A format's conversation column and its images' column (optional: images may sit in their parts).
IMAGE_FORMATS = {"messages": ("messages", "images"), "llava": ("conversations", "image")}


def image_columns(columns: list[str], where: str) -> list[str]:
    """The columns a split of image-text rows trains on, by its format (vision.py's docstring shows both)."""
    for conversation, images in IMAGE_FORMATS.values():
        if conversation in columns:
            return [conversation] + ([images] if images in columns else [])
    raise DataError(f"task vlm_sft trains on image-and-text conversations: a messages column (with an images column, "
                    f"or images in their parts) or LLaVA's conversations and image; {where} has {columns}: rename "
                    "its columns (docs/vision.md).")  # fmt: skip


def image_problem(columns: list[str], root: Path | None) -> Callable[..., str | None]:
    """What makes a row unusable (vision_conversation's reason), or None: for loading.py's row check."""

    def problem(*values: Any) -> str | None:
        try:
            vision_conversation(dict(zip(columns, values, strict=True)), root)
        except DataError as error:
            return str(error)
        return None

    return problem


def absolute_paths(split, columns: list[str], root: Path | None):
    """The split with its image paths made absolute: a relative one is the data file's folder's, wherever the run
    starts (and whichever data set of a mixture it came from)."""
    if root is None or len(columns) < 2:
        return split
    feature = split.features[columns[1]]
    if getattr(getattr(feature, "feature", feature), "dtype", None) != "string":  # not paths: datasets.Image, bytes
        return split

    def absolute(value):
        if isinstance(value, list):
            return [absolute(v) for v in value]
        return str(root / value) if isinstance(value, str) and not Path(value).is_absolute() else value

    column = columns[1]
    return split.remove_columns(column).add_column(column, [absolute(value) for value in split[column]])


def measured(split, collator: VisionCollator, name: str) -> tuple[Any, int]:
    """The split's rows that --max_seq_length can keep whole (cut after their last image when long), each with its
    tokens (capped there) in the LENGTH column, and how many were left out: a row is never trained on part of an
    image. Runs the processor on each row, as training will."""
    kept, lengths = [], []
    for k, row in enumerate(split):
        ((end, tokens),) = extents(collator, [vision_conversation(row)])
        if end <= collator.max_length:
            kept.append(k)
            lengths.append(min(tokens, collator.max_length))
    if not kept:
        raise DataError(f"No row of the {name} split fits --max_seq_length {collator.max_length} with its images' "
                        "tokens: raise it, or lower the image resolution.")  # fmt: skip
    return split.select(kept).add_column(LENGTH, lengths), len(split) - len(kept)


def images_per_row(split, sample: int = 256) -> float:
    """The images a row holds, on average over the first `sample` rows (none decoded), for the plan's image path;
    1 for a split without rows."""
    if split is None or not len(split):
        return 1.0
    rows = split.select(range(min(sample, len(split))))
    columns = image_columns(rows.column_names, "the training split")
    counts = [0] * len(rows)
    if len(columns) > 1:  # as stored: an image column's values are not opened
        for k, value in enumerate(rows.select_columns(columns[1:]).with_format("arrow")[columns[1]].to_pylist()):
            counts[k] += len(value) if isinstance(value, list) else value is not None
    if columns[0] == "messages":  # images held by their parts
        for k, messages in enumerate(rows["messages"]):
            counts[k] += sum(isinstance(part, dict) and part.get("type") == "image" and part.get("image") is not None
                             for message in messages if isinstance(message["content"], list)
                             for part in message["content"])  # fmt: skip
    return sum(counts) / len(counts)
