"""What the model says as it trains, as a run records it: `--generation_samples N` answers N fixed held-out
prompts at each evaluation (training/generation_samples.py) into OUTPUT/samples.jsonl, read back here for the
end of the run and for `toolkit report`.

The prompts are the first N held-out conversations cut before their last assistant turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLES_FILE = "samples.jsonl"
RUN_LOG = "run_log.jsonl"  # every log line of a run, written by the trainer, read by `toolkit report`
EPISODES_FILE = "episodes.jsonl"  # a run in an environment: one episode a step (training/episodes.py)
EVAL_FILE = "eval_results.json"  # the fine-tuned model against its base (`toolkit eval`, results/evaluation.py)
EXPORTS_FILE = "gguf/exports.json"  # its GGUF files, their sizes and agreement (`toolkit export`, shipping/export.py)


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, str]]  # the conversation up to its last assistant turn
    reference: str  # that turn, as the data has it


def held_out_prompts(conversations: list[list[dict[str, str]]], count: int) -> list[Prompt]:
    """The first `count` conversations, each cut before its last assistant message."""
    prompts = []
    for messages in conversations:
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
        if last > 0:
            prompts.append(Prompt(messages[:last], messages[last]["content"]))
        if len(prompts) == count:
            break
    return prompts


def read_samples(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / SAMPLES_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def side_by_side(output_dir: str | Path) -> str:
    """The first and the last answers of a run to each prompt (with an evaluation before training: the base
    model's and the fine-tuned model's), as printed at the end of a run."""
    rows = read_samples(output_dir)
    first, last = min(row["step"] for row in rows), max(row["step"] for row in rows)
    lines = [f"what the model says, step {first} and step {last}:"]
    for row in (r for r in rows if r["step"] == first):
        after = next(r["answer"] for r in rows if r["step"] == last and r["prompt"] == row["prompt"])
        lines += [f"  prompt     {row['prompt']}", f"  reference  {row['reference']}",
                  f"  step {first:<5} {row['answer']}", f"  step {last:<5} {after}", ""]  # fmt: skip
    return "\n".join(lines).rstrip()
