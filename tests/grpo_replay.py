"""A GRPO rollout that replays fixed completions (`--rollout_func tests/grpo_replay.py:replay`): each prompt's
k-th completion is the tiny data's sum off by -1, 0 or +1, chosen by a hash of the prompt and k, so the accuracy
reward varies within a group. The same prompts get the same completions on one process or split over several:
what makes a distributed GRPO run comparable with a single process (sampling differs with how rows are split)."""

from __future__ import annotations

import hashlib
import json


def replay(prompts: list, trainer) -> dict:
    tokenizer = trainer.processing_class
    seen: dict[str, int] = {}
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        key = json.dumps(prompt)
        k = seen[key] = seen.get(key, -1) + 1
        prompt_ids.append(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))  # fmt: skip
        a, b = (int(word) for word in prompt[-1]["content"].removesuffix("?").split() if word.isdigit())
        offset = hashlib.sha256(f"{key}:{k}".encode()).digest()[0] % 3 - 1
        completion_ids.append(
            tokenizer.encode(f"{a + b + offset}.", add_special_tokens=False) + [tokenizer.eos_token_id]
        )
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
