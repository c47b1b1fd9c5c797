"""A scripted policy for the shop environment (recipes/environments/shop.py), in place of sampling: each episode
looks up both items, a turn each, then answers with their total off by -1, 0 or +1, chosen by a hash of the
question and the episode's place among its group's (the k-th of the same text in a call), so the shop's reward
varies within a group. The same questions get the same episodes on one process or split over several: what makes
a distributed run in an environment comparable with one process (sampling differs with how rows are split).

As a script it is the environment recipe with this policy, for `accelerate launch tests/shop_policy.py ...`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOP = str(ROOT / "recipes" / "environments" / "shop.py") + ":Shop"
ROWS = str(ROOT / "recipes" / "data" / "shop.jsonl")


def reply(text: str, k: int, offsets: bool = True) -> str:
    """The next turn of an episode whose text (prompt and turns so far) is `text`."""
    items = re.findall(r"How many (\w+) and (\w+) does", text)[-1]
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    if len(results) < 2:
        call = {"name": "stock", "arguments": {"item": items[len(results)]}}
    elif len(results) == 2:
        total = sum(int(result.split()[0]) for result in results)
        offset = hashlib.sha256(f"{text}:{k}".encode()).digest()[0] % 3 - 1 if offsets else 0
        call = {"name": "answer", "arguments": {"total": total + offset}}
    else:
        return "Done.<|im_end|>"
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"


def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """GRPOTrainer._generate_single_turn's place: each row's next turn (reply)."""
    tokenizer, seen, out = self.processing_class, {}, []
    for ids in prompt_ids:
        text = tokenizer.decode(ids)
        k = seen[text] = seen.get(text, -1) + 1
        out.append(tokenizer.encode(reply(text, k), add_special_tokens=False))
    return out, None


def install() -> None:
    from toolkit.training.rl import RecipeGRPOTrainer

    RecipeGRPOTrainer._generate_single_turn = generate


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "recipes"))
    from smollm2_grpo_env import RECIPE

    from toolkit import run

    install()
    run(RECIPE, name="smollm2_grpo_env")
