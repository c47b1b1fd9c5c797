"""A GGUF file run by llama.cpp, called as the evaluation calls a transformers model, so that `toolkit eval --gguf`
scores each exported file by the same code, rows and metrics as the trained model.

forward(input_ids, attention_mask) gives every position's logits (llama.cpp's, a row at a time, its real tokens
only: padding gets zeros, which the metrics never read, as their labels are ignored there); generate(...) greedy
continuations, stopping at the given end ids, padded as transformers pads them. A module with one unused buffer,
so that the Trainer's evaluation loop (device and dtype reads) takes it as a model.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch
from transformers.modeling_outputs import CausalLMOutput


class GGUFModel(torch.nn.Module):
    main_input_name = "input_ids"

    def __init__(self, path: Path, config, generation_config, n_ctx: int):
        super().__init__()
        self.llama = opened_llama(path, n_ctx)
        self.config, self.generation_config, self.name = config, generation_config, path.name
        self.register_buffer("anchor", torch.zeros(1), persistent=False)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def logits_of(self, ids: list[int]) -> torch.Tensor:
        self.llama.reset()
        self.llama.eval(ids)
        return torch.from_numpy(self.llama.scores[: len(ids)].copy())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels=None, **_):
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        out = torch.zeros(*input_ids.shape, self.llama.n_vocab())
        for row, (ids, keep) in enumerate(zip(input_ids, mask, strict=True)):
            out[row, keep] = self.logits_of(ids[keep].tolist())
        loss = None
        if labels is not None:  # the Trainer's evaluation asks for it where rows have labels: the usual shifted mean
            loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                     ignore_index=-100)  # fmt: skip
        return CausalLMOutput(loss=loss, logits=out)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
                 eos_token_id=None, pad_token_id: int | None = None, **_) -> torch.Tensor:  # fmt: skip
        """Greedy continuations of each row (left-padded, as generation pads), their ends padded."""
        stops = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        rows = []
        for ids, keep in zip(input_ids, mask, strict=True):
            answer, _ = greedy(self.llama, ids[keep].tolist(), max_new_tokens, stops)
            rows.append(answer + [pad_token_id if pad_token_id is not None else 0] * (max_new_tokens - len(answer)))
        return torch.cat([input_ids, torch.tensor(rows, dtype=input_ids.dtype)], dim=1)

    def close(self) -> None:
        self.llama.close()


def opened_llama(path: Path, n_ctx: int):
    """llama.cpp's model of the file, every position's logits kept (llama-cpp-python keeps none without
    logits_all), on every core."""
    from .gguf_convert import bindings

    return bindings().Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), logits_all=True,
                            n_threads=os.cpu_count(), verbose=False, seed=0)  # fmt: skip


def greedy(llama, ids: list[int], max_new_tokens: int, stops) -> tuple[list[int], float]:
    """llama.cpp's greedy continuation of `ids`, ending at a stop id or `max_new_tokens`, and the seconds its
    decoding took (after the prompt, whose pass gives the first token)."""
    llama.reset()
    llama.eval(ids)
    answer: list[int] = []
    start = time.perf_counter()
    while len(answer) < max_new_tokens:
        answer.append(int(llama.scores[llama.n_tokens - 1].argmax()))
        if answer[-1] in stops:
            break
        llama.eval(answer[-1:])
    return answer, time.perf_counter() - start


def exported_files(run: Path, quants: list[str], held_out: bool = True) -> dict[str, Path]:
    """RUN/gguf's file of each type in `quants`, as `toolkit export` named them; one line on how to write one that
    is missing, or where the evaluation has no held-out split to score them on."""
    from ..errors import ConfigError

    if quants and not held_out:
        raise ConfigError("--gguf scores the files on the held-out split: add held-out to --tasks.")
    files = {}
    for quant in quants:
        found = sorted((Path(run) / "gguf").glob(f"*-{quant.lower()}.gguf"))
        if not found:
            raise ConfigError(f"{run} has no {quant} GGUF file: `python -m toolkit export {run} --to gguf --quant "
                              f"{quant.lower()}` writes it.")  # fmt: skip
        files[quant] = found[0]
    return files


@contextlib.contextmanager
def opened(path: Path, run: Path, tokenizer, settings: dict):
    """A GGUFModel of the run's file at `path`, closed after."""
    model = GGUFModel(path, *configs(run, tokenizer), context(settings))
    print(f"eval: {path.name} (llama.cpp)", file=sys.stderr, flush=True)
    try:
        yield model
    finally:
        model.close()


def configs(run: Path, tokenizer):
    """The run's model config and generation config, its end ids the run's stop tokens (as the run saves them),
    which the evaluation reads off a model."""
    from transformers import AutoConfig, GenerationConfig

    from ..data.conversations import stop_token_ids

    folder = Path(run) / "merged" if (Path(run) / "merged" / "config.json").is_file() else Path(run)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        import json

        folder = Path(json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"])
    generation = GenerationConfig.from_pretrained(folder)
    generation.eos_token_id = stop_token_ids(tokenizer)
    return AutoConfig.from_pretrained(folder), generation


def context(settings: dict) -> int:
    """llama.cpp's context for a run's held-out rows: their length, and an online run's answers after them."""
    return int(settings.get("max_seq_length") or 2048) + int(settings.get("max_completion_length") or 0) + 8
