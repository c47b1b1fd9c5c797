"""Image-and-text conversations: rows in the formats people have, read into messages with image parts and their
images, and a collator that runs the model's own processor on each batch and labels what the assistant says.

Formats (one row):
  messages  {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "..."}]}, ...],
             "images": [...]}: the Hub's and TRL's vision format (an image part may hold its image itself)
  llava     {"conversations": [{"from": "human", "value": "<image>\\nWhat is ...?"}, {"from": "gpt", ...}],
             "image": "a.jpg" or [...]}: LLaVA's JSON
An image is a path (relative to the data's folder), bytes, a `datasets.Image` value ({"bytes", "path"}) or a PIL
image.

Labels. A processor expands each image placeholder into the image's tokens inside its own call (Qwen2-VL repeats
<|image_pad|>, Idefics3 writes a grid of tiles, Gemma 3 adds newlines around it), so character offsets in the
rendered conversation do not map onto its ids. The labels are found as for text (conversations.py: the
assistant's tokens in the rendered conversation, before expansion) and carried onto the processor's ids by
aligning the two token sequences (difflib): outside an expansion they are the same tokens, one for one. Image
tokens, prompt tokens and padding never carry a label, and no family needs code of its own.
"""

from __future__ import annotations

import difflib
import io
from pathlib import Path
from typing import Any

import torch

from ..errors import DataError
from .conversations import IGNORE_INDEX, SHAREGPT, TurnLayout, tokenize_conversations

LLAVA_PLACEHOLDER = "<image>"


def open_image(value: Any, root: Path | None = None):
    """A PIL image, RGB, from a path, bytes, a datasets.Image value or a PIL image; DataError saying which."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):  # datasets.Image without decoding: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, bytes):
            return Image.open(io.BytesIO(value)).convert("RGB")
        if isinstance(value, str):
            path = Path(value) if root is None or Path(value).is_absolute() else root / value
            if not path.is_file():
                raise DataError(f"its image {value} is not a file" + (f" (looked in {root})" if root else ""))
            return Image.open(path).convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise DataError(f"its image does not decode ({error})") from None
    raise DataError(f"its image is a {type(value).__name__}, not a path, bytes or an image")


def from_llava(row: dict) -> tuple[list[dict], list]:
    """LLaVA's conversations and image(s) as messages with image parts, and the images."""
    messages = []
    for turn in row["conversations"]:
        role = SHAREGPT.get(turn.get("from"), turn.get("from"))
        pieces = str(turn.get("value", "")).split(LLAVA_PLACEHOLDER)
        content: list[dict] = []
        for k, piece in enumerate(pieces):
            if k:
                content.append({"type": "image"})
            text = piece.strip("\n") if len(pieces) > 1 else piece  # "<image>\nWhat is it?": the line break is LLaVA's
            if text:
                content.append({"type": "text", "text": text})
        messages.append({"role": role, "content": content})
    images = row.get("image")
    return messages, [] if images is None else images if isinstance(images, list) else [images]


def from_messages(row: dict) -> tuple[list[dict], list]:
    """The messages format: text contents become text parts; images held by their parts join the images column's."""
    messages, images = [], list(row.get("images") or [])
    for message in row["messages"]:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part.get("type") == "image" and part.get("image") is not None:
                images.append(part["image"])
                part = {"type": "image"}
            parts.append(part)
        messages.append({"role": message["role"], "content": parts})
    return messages, images


def vision_conversation(row: dict, root: Path | None = None) -> tuple[list[dict], list]:
    """A row's messages (content as parts) and its images, opened; DataError for a row that cannot train: images
    and placeholders that do not pair up, an image in an assistant turn, an image that does not decode."""
    if "conversations" in row:
        messages, images = from_llava(row)
        mark = f"a {LLAVA_PLACEHOLDER} in its text"
    elif "messages" in row:
        messages, images = from_messages(row)
        mark = 'an {"type": "image"} part'
    else:
        raise DataError(f"it has neither messages nor conversations (it has {sorted(row)})")
    placeholders = 0
    for message in messages:
        count = sum(part.get("type") == "image" for part in message["content"])
        if count and message["role"] == "assistant":
            raise DataError("an assistant turn holds an image: the model would be trained to write one; images go in "
                            "user turns")  # fmt: skip
        placeholders += count
    if placeholders > len(images):
        raise DataError(f"{placeholders} image placeholder(s) and {len(images)} image(s): a row without its image")
    if len(images) > placeholders:
        raise DataError(f"{len(images)} image(s) and {placeholders} placeholder(s): mark where each image goes with "
                        f"{mark}")  # fmt: skip
    return messages, [open_image(image, root) for image in images]


class _Renderer:
    """The processor's chat template over its tokenizer, as conversations.py calls a tokenizer: renders with the
    template, tokenizes the text as written (placeholders unexpanded)."""

    chat_template = None  # no generation marks to use: those would have the processor open the images

    def __init__(self, processor):
        self.processor = processor

    def apply_chat_template(self, messages, **kwargs):
        return self.processor.apply_chat_template(messages, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.processor.tokenizer(*args, **kwargs)


def prompt_batch(processor, messages: list[dict], image=None, max_pixels: int | None = None) -> tuple[dict, list[int]]:
    """A conversation to answer (`toolkit generate`, `chat`) as the processor's batch, `image` (a path) placed in the
    first user turn, scaled to `max_pixels` as the run's training images were (within), and the ids that end the
    answer (the end of sequence and the template's turn ending)."""
    from .conversations import stop_token_ids

    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    images = None
    if image is not None:
        first = next(m for m in parts if m["role"] == "user")
        first["content"].insert(0, {"type": "image"})
        images = [[within(open_image(str(image)), max_pixels)]]
    text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=images, return_tensors="pt")
    renderer = _Renderer(processor)
    return batch, stop_token_ids(processor.tokenizer, TurnLayout.of(renderer, parts=True))


def aligned_labels(written: dict, expanded: list[int]) -> tuple[list[int], list[bool]]:
    """`written`'s labels carried onto the processor's `expanded` ids, and which expanded tokens no written token
    matches (what the processor added: the images' tokens). A labelled token the alignment cannot place is a
    DataError: the processor changed the assistant's text."""
    labels, added = [IGNORE_INDEX] * len(expanded), [True] * len(expanded)
    source = written["input_ids"]
    matcher = difflib.SequenceMatcher(None, source, expanded, autojunk=False)
    placed = set()
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            added[b + k] = False
            labels[b + k] = written["labels"][a + k]
            placed.add(a + k)
    if any(label != IGNORE_INDEX and k not in placed for k, label in enumerate(written["labels"])):
        raise DataError("the processor's tokens of an assistant turn differ from its template's")
    return labels, added


def within(image, max_pixels: int | None):
    """The image scaled down, its aspect kept, to at most `max_pixels` pixels (--image_max_pixels); as it is when
    it has no more, or without the setting."""
    width, height = image.size
    if not max_pixels or width * height <= max_pixels:
        return image
    scale = (max_pixels / (width * height)) ** 0.5
    return image.resize((max(1, int(width * scale)), max(1, int(height * scale))), resample=3)  # bicubic


class VisionCollator:
    """Rows of (messages, images) -> the processor's batch (pixel values in the family's own layout) with labels on
    the assistant's tokens. A row longer than `max_length` is cut after its last image's tokens; one whose image
    the cut would split is a DataError (never a row with half an image)."""

    pad_to_multiple_of: int | None = None  # the attention kernel's and a sequence split's (preparation.py)

    def __init__(self, processor, max_length: int, max_pixels: int | None = None):
        self.processor, self.max_length, self.max_pixels = processor, max_length, max_pixels
        self.renderer = _Renderer(processor)
        self.layout = TurnLayout.of(self.renderer, parts=True)

    def encode(self, rows: list[tuple[list[dict], list]], **processor_kwargs) -> tuple[dict, list[dict]]:
        """The processor's batch of `rows` and each row's labels as its template writes them (not expanded)."""
        conversations = [messages for messages, _ in rows]
        texts = [self.processor.apply_chat_template(messages, tokenize=False) for messages in conversations]
        written = tokenize_conversations(self.renderer, conversations, 10**9, self.layout)
        images = [[within(image, self.max_pixels) for image in row_images] or None for _, row_images in rows]
        batch = self.processor(text=texts, images=images if any(images) else None, **processor_kwargs)
        return batch, written

    def __call__(self, rows: list[tuple[list[dict], list] | dict]) -> dict[str, torch.Tensor]:
        """A batch of (messages, images) pairs, or of rows as the data set holds them (read by vision_conversation,
        their image paths absolute: image_rows.py)."""
        rows = [vision_conversation(row) if isinstance(row, dict) else row for row in rows]
        batch, written = self.encode(rows, padding=True, padding_side="right", return_tensors="pt",
                                     pad_to_multiple_of=self.pad_to_multiple_of)  # fmt: skip
        labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        width = 0
        for i, row in enumerate(written):
            length = int(batch["attention_mask"][i].sum())
            row_labels, added = aligned_labels(row, batch["input_ids"][i, :length].tolist())
            if any(added[self.max_length :]):  # an image's tokens past the cut
                raise DataError(
                    f"{length} tokens with its images, above --max_seq_length {self.max_length}, and "
                    "the cut would split an image: raise --max_seq_length or lower the image resolution"
                )
            labels[i, :length] = torch.tensor(row_labels)
            width = max(width, min(length, self.max_length))
        batch["labels"] = labels
        if self.pad_to_multiple_of:
            width = min(-(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of, labels.shape[1])
        for key, value in batch.items():  # the text's columns cut to the longest kept row; the pixels stay whole
            if torch.is_tensor(value) and value.dim() == 2 and value.shape == labels.shape:
                batch[key] = value[:, :width]
        return dict(batch)


def extents(collator: VisionCollator, rows: list[tuple[list[dict], list]]) -> list[tuple[int, int]]:
    """Each row's (end of its last image's tokens, 0 without images; its tokens) in the processor's ids: a row
    whose image ends past --max_seq_length cannot be cut whole. Runs the processor on each row, as training will."""
    found = []
    for row in rows:
        batch, written = collator.encode([row])
        ids = list(batch["input_ids"][0])
        _, added = aligned_labels(written[0], ids)
        found.append((max((k + 1 for k, was_added in enumerate(added) if was_added), default=0), len(ids)))
    return found
