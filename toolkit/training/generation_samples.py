"""Trainer part: after each evaluation, greedy answers to `--generation_samples` held-out prompts (a callback).

The answer is greedy, so runs and steps compare. A model that trains with flex attention generates with sdpa
(models/attention.py's for_generation: flex cannot lower every prompt length). Every rank generates (under FSDP
and ZeRO-3 each forward gathers the sharded weights, a collective every rank must join: `synced_gpus`; under
pipeline stages each forward passes through them); rank 0
appends to OUTPUT/samples.jsonl (metrics/samples.py reads it back) and logs a W&B table. With an evaluation
before training (`--eval_on_start true`), step 0 holds the base model's answers.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..data.conversations import stop_token_ids
from ..metrics.samples import SAMPLES_FILE, Prompt
from ..models.attention import for_generation


def root_unsharded(model: torch.nn.Module):
    """FSDP1: `generate` on the wrapped model reaches the inner model's own methods, around the root unit's
    forward, which is what gathers the root's own parameters (the embeddings, the final norm, an untied head): they
    are gathered for the whole call here (TRL's GRPO generates so); each layer's unit still gathers its own in its
    forward. Anything else (FSDP2's per-module hooks, ZeRO-3's, replicated models): as it is."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False)
    return contextlib.nullcontext()


class GenerationSamples(TrainerCallback):
    def __init__(self, trainer, prompts: list[Prompt], max_new_tokens: int, synced: bool, pipeline=None):
        self.trainer, self.prompts = trainer, prompts
        self.max_new_tokens = max_new_tokens
        self.synced = synced  # weights sharded over several ranks: every rank joins each forward's gathers
        self.pipeline = pipeline  # pipeline stages: each forward runs through them (training/pipeline.py)

    def on_evaluate(self, args, state, control, **kwargs):
        self.record(self.generate(), state.global_step)

    def generate(self) -> list[str]:
        model, tokenizer, device = self.trainer.model, self.trainer.processing_class, self.trainer.args.device
        stop = stop_token_ids(tokenizer)  # the template's end of turn too: Llama 3's <|eot_id|>
        training = model.training
        model.eval()
        answers = []
        through_stages = self.pipeline.generating() if self.pipeline is not None else contextlib.nullcontext()
        with torch.no_grad(), root_unsharded(self.trainer.model_wrapped), for_generation(model), through_stages:
            for prompt in self.prompts:
                ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"].to(device)  # fmt: skip
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=self.max_new_tokens, synced_gpus=self.synced,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=stop,
                                     use_cache=self.pipeline is None)  # fmt: skip
                answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
        model.train(training)
        return answers

    def record(self, answers: list[str], step: int) -> None:
        if not self.trainer.is_world_process_zero():
            return
        rows = [{"step": step, "prompt": p.messages[-1]["content"], "reference": p.reference, "answer": answer,
                 "messages": p.messages} for p, answer in zip(self.prompts, answers, strict=True)]  # fmt: skip
        with open(Path(self.trainer.args.output_dir) / SAMPLES_FILE, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            columns = ["step", "prompt", "reference", "answer"]
            table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            wandb.run.log({"eval/samples": table, "train/global_step": step})
