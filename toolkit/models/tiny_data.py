"""Tiny mode's data (tiny.py's part): small, deterministic, learnable rows for each task (sentiment sentences,
arithmetic conversations, preference pairs, prompts with answers; image-text rows from tiny_vision.py), written once
into the cache by their content, so that concurrent ranks write the same bytes and every run reads the same file.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

from ..project import aside, cache_root
from ..settings import tasks as task_table
from . import tiny_vision


def cache_dir() -> Path:
    return cache_root() / "tiny"


POSITIVE = ["great", "wonderful", "superb", "lovely", "brilliant", "delightful", "charming", "excellent"]


NEGATIVE = ["awful", "dreadful", "boring", "terrible", "clumsy", "tedious", "bland", "poor"]


NOUNS = ["film", "story", "cast", "script", "ending", "score", "pacing", "camera work", "dialogue", "plot"]


FILLER = ["the", "really", "quite", "was", "felt", "overall", "honestly", "a bit", "in places", "truly"]


def classification_rows(n: int = 1024, seed: int = 0) -> list[dict[str, Any]]:
    """Sentences whose label is the sentiment of their adjectives: learnable in a few steps, of varied length."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        label = rng.randrange(2)
        adjectives = [rng.choice(POSITIVE if label else NEGATIVE) for _ in range(rng.randint(2, 6))]
        words = [rng.choice(FILLER) for _ in range(rng.randint(0, 6))] + [rng.choice(NOUNS), *adjectives]
        rng.shuffle(words)
        text = " ".join(words)
        if text not in seen:  # unique rows, so a test can tell which rank saw which
            seen.add(text)
            rows.append({"text": text, "label": label})
    return rows


def chat_rows(n: int = 1024, seed: int = 0) -> list[dict[str, Any]]:
    """Arithmetic conversations of one to three turns, some with a system prompt."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You are a helpful calculator."})
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            messages.append({"role": "user", "content": f"What is {a} plus {b}?"})
            messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
        key = json.dumps(messages)
        if key not in seen:
            seen.add(key)
            rows.append({"messages": messages})
    return rows


def preference_rows(n: int = 1024, seed: int = 0) -> list[dict[str, Any]]:
    """Preference pairs on the arithmetic conversations: the right sum, stated, against a wrong one, hedged. The
    preference is learnable within a few steps (the hedge), and more slowly (the sum)."""
    rng = random.Random(seed)
    rows = []
    for row in chat_rows(n, seed):
        *context, answer = row["messages"]
        a, b = (int(word) for word in context[-1]["content"].removesuffix("?").split() if word.isdigit())
        wrong = a + b + rng.choice([-1, 1]) * rng.randint(1, 9)
        rejected = {"role": "assistant", "content": f"{a} plus {b} is {wrong}, or maybe not."}
        rows.append({"chosen": [*context, answer], "rejected": [*context, rejected]})
    return rows


def labelled_rows(n: int = 1024, seed: int = 0, undesirable_every: int = 2) -> list[dict[str, Any]]:
    """Labelled completions for KTO, unpaired: each preference pair gives one row, its rejected answer (undesirable)
    every `undesirable_every` rows, else its chosen one, so no prompt has both."""
    rows = []
    for k, pair in enumerate(preference_rows(n, seed)):
        desirable = k % undesirable_every != 0
        *context, answer = pair["chosen" if desirable else "rejected"]
        rows.append({"prompt": context, "completion": [answer], "label": desirable})
    return rows


def prompt_rows(n: int = 1024, seed: int = 0) -> list[dict[str, Any]]:
    """Prompts for GRPO: the arithmetic conversations' first question, with its answer for the accuracy reward."""
    rows = []
    for row in chat_rows(n, seed):
        question = next(m for m in row["messages"] if m["role"] == "user")
        a, b = (int(word) for word in question["content"].removesuffix("?").split() if word.isdigit())
        rows.append({"prompt": [question], "answer": str(a + b)})
    return rows


def texts_of(task: str, rows: list[dict[str, Any]]) -> list[str]:
    """The tiny data's text, to train its tokenizer on."""
    if task == "classification":
        return [r["text"] for r in rows]
    if task_table.task(task).samples_online:
        return [m["content"] for r in rows for m in r["prompt"]] + [f"{r['answer']}." for r in rows]
    if task_table.task(task).labelled:
        return [m["content"] for r in rows for m in r["prompt"] + r["completion"]]
    return [m["content"] for r in rows for c in ([r["messages"]] if task == "sft" else [r["chosen"], r["rejected"]])
            for m in c]  # fmt: skip


TINY_ROWS = {"classification": classification_rows, "sft": chat_rows, "dpo": preference_rows, "grpo": prompt_rows,
             "rloo": prompt_rows, "distill": prompt_rows, "reward": preference_rows, "kto": labelled_rows}  # fmt: skip


def write_tiny_dataset(task: str) -> Path:
    if task_table.task(task).images:
        return write_tiny_images()
    rows = TINY_ROWS[task]()
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path = cache_dir() / f"{task}-{hashlib.sha256(text.encode()).hexdigest()[:10]}.jsonl"
    if not path.exists():  # content-addressed: concurrent ranks write the same bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = aside(path)
        tmp.write_text(text)
        tmp.replace(path)
    return path


def write_tiny_images() -> Path:
    """The image-text tiny data (tiny_vision.image_rows): its JSON lines beside their images, in a folder named by
    its content (written aside, then renamed: concurrent ranks write the same files)."""
    scratch = aside(cache_dir() / "images")
    shutil.rmtree(scratch, ignore_errors=True)
    text = "".join(json.dumps(r) + "\n" for r in tiny_vision.image_rows(scratch))
    (scratch / "data.jsonl").write_text(text)
    folder = cache_dir() / f"vlm_sft-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    if (folder / "data.jsonl").is_file():
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        save_atomically(folder, lambda tmp: scratch.replace(tmp))
    return folder / "data.jsonl"


def save_atomically(path: Path, save) -> None:
    """Write into a temporary folder, then rename: concurrent ranks never see half a folder."""
    tmp = aside(path)
    save(tmp)
    try:
        tmp.replace(path)
    except OSError:  # another rank got there first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
