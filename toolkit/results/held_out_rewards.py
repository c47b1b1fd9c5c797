"""A grpo or rloo run's held-out evaluation: each model answers the held-out prompts greedily (the same completions for
the same weights, whatever the seed), at the run's --max_completion_length, and the run's own rewards score the
answers: each reward's mean, their weighted sum (`reward`, what the run maximised) and the share of completions
that ended within the length (`finished`). A reward model among the rewards is left out here (named in the table's
absence), as loading a second model for the comparison is not yet done."""

from __future__ import annotations

import sys
from typing import Any

from ..settings.policy import PolicyArguments
from ..training.rewards import Checked, reward_functions
from .held_out_tools import answers_with_tools, end_ids
from .record import RunRecord


def held_out_rewards(record: RunRecord, model, tokenizer, rows, batch_size: int = 16,
                     rewards: str | None = None) -> dict[str, float]:  # fmt: skip
    """The rewards of the model's greedy completions to the held-out prompts, averaged (a run with tools: with the
    tools, held_out_tools.py, and the share of answers that called one); `rewards` in place of the run's (a
    distill run has none: held_out_teacher.py scores its answers by accuracy)."""
    policy = scoring_policy(record, rewards)
    scores: dict[str, Any] = {}
    episodes = {}
    if policy.tools or policy.environment:
        answers = answers_with_tools(model, tokenizer, rows, policy, batch_size)
        completions, ids_out = [a.messages for a in answers], [a.ids for a in answers]
        finished = [float(a.finished) for a in answers]
        scores["tool_calls"] = sum(a.calls > 0 for a in answers) / len(answers)  # the share that called a tool
        episodes = episode_rewards(answers)
    else:
        texts, ids_out, finished = plain_answers(model, tokenizer, rows["prompt"], policy, batch_size)
        completions = as_completions(texts, rows["prompt"])
    scores.update(scored(policy, rows, completions, ids_out, episodes))
    scores["finished"] = sum(finished) / len(finished)
    return scores


def episode_rewards(answers: list) -> dict[str, list]:
    """Each environment class's get_reward over the answers' episodes (None where another class played it, or it
    was stopped), as TRL adds it: a reward named after the class, weight 1."""
    out: dict[str, list] = {}
    for k, answer in enumerate(answers):
        if answer.scored is not None:
            name, value = answer.scored
            out.setdefault(name, [None] * len(answers))[k] = value
    return out


def scoring_policy(record: RunRecord, rewards: str | None = None) -> PolicyArguments:
    """The run's online settings, its rewards resolved, or `rewards` in their place."""
    policy = record.arguments(PolicyArguments)
    if rewards:
        policy.reward_funcs, policy.reward_weights = rewards, None
    else:
        policy.resolve(record.task)
    return policy


def as_completions(texts: list[str], prompts: list) -> list:
    """Answers as TRL passes them to rewards: the assistant's message where the prompt is a conversation."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for t, p in zip(texts, prompts, strict=True)]  # fmt: skip


def scored(policy: PolicyArguments, rows, completions: list, ids_out: list, episodes: dict | None = None
           ) -> dict[str, float]:  # fmt: skip
    """Each of the policy's rewards (each checked, as in training) and each environment's (`episodes`: its
    get_reward's values, weight 1) averaged over the completions, and their weighted sum (`reward`); a reward model
    among them is left out."""
    functions = [(f, w) for f, w in zip(reward_functions(policy), policy.weights(), strict=True)
                 if isinstance(f, Checked)]  # fmt: skip
    columns = {key: rows[key] for key in rows.column_names if key != "prompt"}
    named = [(f.__name__, f(rows["prompt"], completions, ids_out, **columns), w) for f, w in functions]
    scores: dict[str, float] = {}
    total = [0.0] * len(completions)
    for name, values, weight in named + [(name, values, 1.0) for name, values in (episodes or {}).items()]:
        kept = [v for v in values if v is not None]
        scores[name] = sum(kept) / len(kept) if kept else float("nan")
        total = [t + weight * (v or 0.0) for t, v in zip(total, values, strict=True)]
    scores["reward"] = sum(total) / len(total)
    return scores


def plain_answers(model, tokenizer, prompts: list, policy, batch_size: int) -> tuple[list, list, list]:
    """Each prompt's greedy answer: its text, ids, and whether it ended within the length."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues each row's last token
    texts, finished, ids_out = [], [], []
    eos = end_ids(model, tokenizer)
    try:
        for start in range(0, len(prompts), batch_size):
            rendered = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                        for p in prompts[start : start + batch_size]]  # fmt: skip
            batch = tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.no_grad():
                out = model.generate(**batch, do_sample=False, max_new_tokens=policy.max_completion_length,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)  # fmt: skip
            for row in out[:, batch["input_ids"].shape[1] :].tolist():
                ends = next((k for k, t in enumerate(row) if t in eos), None)
                ids_out.append(row[: ends + 1 if ends is not None else len(row)])  # its end, as TRL's ids hold it
                finished.append(float(ends is not None))
                texts.append(tokenizer.decode(ids_out[-1], skip_special_tokens=True))
            print(f"  {len(texts)}/{len(prompts)} held-out prompts answered", file=sys.stderr, flush=True)
    finally:
        tokenizer.padding_side = side
    return texts, ids_out, finished
