"""What the model says as it trains: `--generation_samples N` answers N fixed held-out prompts at each evaluation.

The prompts are the first N held-out conversations cut before their last assistant turn; the answer is greedy, so
runs and steps compare. Every rank generates (under FSDP and ZeRO-3 each forward gathers the sharded weights, a
collective every rank must join: `synced_gpus`); rank 0 appends to OUTPUT/samples.jsonl and logs a W&B table.
With an evaluation before training (`--eval_on_start true`), step 0 holds the base model's answers.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SAMPLES_FILE = "samples.jsonl"


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


class GenerationSamples:
    """Trainer part: after each evaluation, greedy answers to `self.sample_prompts`. Needs `self.plan` (RunPlan)
    and the run's `--generation_max_new_tokens` in `self.recipe`."""

    sample_prompts: list[Prompt] = []

    def evaluate(self, *args, **kwargs):
        metrics = super().evaluate(*args, **kwargs)
        if self.sample_prompts:
            self.record_samples(self.generate_samples())
        return metrics

    def generate_samples(self) -> list[str]:
        model, tokenizer = self.model, self.processing_class
        synced = self.accelerator.num_processes > 1 and self.plan.layout.shard_params
        training = model.training
        model.eval()
        answers = []
        with torch.no_grad():
            for prompt in self.sample_prompts:
                ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"].to(self.args.device)  # fmt: skip
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=self.recipe.run.generation_max_new_tokens, synced_gpus=synced,
                                     pad_token_id=tokenizer.pad_token_id)  # fmt: skip
                answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
        model.train(training)
        return answers

    def record_samples(self, answers: list[str]) -> None:
        if not self.is_world_process_zero():
            return
        step = self.state.global_step
        rows = [{"step": step, "prompt": p.messages[-1]["content"], "reference": p.reference, "answer": answer,
                 "messages": p.messages} for p, answer in zip(self.sample_prompts, answers, strict=True)]  # fmt: skip
        with open(Path(self.args.output_dir) / SAMPLES_FILE, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            columns = ["step", "prompt", "reference", "answer"]
            table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            wandb.run.log({"eval/samples": table, "train/global_step": step})


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
