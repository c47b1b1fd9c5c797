"""A shop whose stock the model cannot see (the environment demo's, `make demo-env`, docs/rl.md): each episode is a
question about two items' total stock; the model looks each item up with `stock`, then gives the total with
`answer`, which ends the episode. The counts differ from row to row (the data's `items` and `counts`), so no
answer can be learnt by heart: it takes the turns. `get_reward` scores the episode at its end: 1 for the right
total given once, 0 for a wrong one or none.

    python recipes/environments/shop.py 300 > recipes/data/shop.jsonl   (the demo's rows, seeded)
"""

from __future__ import annotations

import json
import random
import sys

FRUITS = ("apples", "pears", "plums", "lemons", "limes", "figs", "kiwis", "mangos", "peaches", "cherries")


class Shop:
    """A shop's stock, looked up one item at a time."""

    def reset(self, items: list[str], counts: list[int], **row) -> None:
        self.counts = dict(zip(items, counts, strict=True))
        self.given: list[int] = []

    def stock(self, item: str) -> str:
        """How many of an item the shop has in stock.

        Args:
            item: The item's name, as the question writes it, e.g. "apples".
        """
        if item not in self.counts:
            return f"The shop sells no {item}: it sells {' and '.join(self.counts)}."
        return f"{self.counts[item]} {item}"

    def answer(self, total: int) -> str:
        """Give the final answer: the total the question asks for.

        Args:
            total: The number of items in all.
        """
        self.given.append(int(total))
        return "Answer recorded."

    def get_reward(self) -> float:
        return float(self.given == [sum(self.counts.values())])


def rows(n: int, seed: int = 0, items: int = 2) -> list[dict]:
    """`n` questions on `items` distinct fruits each, counts 2-39."""
    draw = random.Random(seed)
    out = []
    for _ in range(n):
        names = draw.sample(FRUITS, items)
        asked = " and ".join(names)
        question = (f"How many {asked} does the shop have in all? Look each one up with the stock tool, then give "
                    "the total with the answer tool." if items > 1 else
                    f"How many {asked} does the shop have? Look it up with the stock tool, then give the number with "
                    "the answer tool.")  # fmt: skip
        out.append({"prompt": [{"role": "user", "content": question}], "items": names,
                    "counts": [draw.randint(2, 39) for _ in names]})  # fmt: skip
    return out


def traces(n: int, seed: int = 1) -> list[dict]:
    """`n` episodes played right, as SFT rows (the demo's first stage: the call format, a lookup a turn, the sum
    written out before the answer): half on one item, half on two; each offers the shop's tools as the GRPO stage
    does (a `tools` column). Another seed than the GRPO rows', so their counts differ."""
    from transformers.utils import get_json_schema  # here: the shop itself is served where transformers is not

    tools = json.dumps([get_json_schema(Shop.stock), get_json_schema(Shop.answer)])
    out = []
    draw = random.Random(seed)
    for k in range(n):
        (row,) = rows(1, draw.randrange(2**32), items=1 + k % 2)
        messages = list(row["prompt"])
        for item, count in zip(row["items"], row["counts"], strict=True):
            messages += [call("stock", item=item), {"role": "tool", "name": "stock", "content": f"{count} {item}"}]
        total = sum(row["counts"])
        working = " + ".join(map(str, row["counts"])) + f" = {total}" if len(row["counts"]) > 1 else ""
        messages += [call("answer", working, total=total),
                     {"role": "tool", "name": "answer", "content": "Answer recorded."},
                     {"role": "assistant", "content": f"The shop has {total}."}]  # fmt: skip
        out.append({"messages": messages, "tools": tools})
    return out


def call(name: str, said: str = "", **arguments) -> dict:
    """An assistant turn that calls one tool."""
    return {"role": "assistant", "content": said,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}  # fmt: skip


if __name__ == "__main__":
    kind, n = (sys.argv[1], int(sys.argv[2])) if len(sys.argv) > 2 else ("rows", 300)
    for row in {"rows": rows, "traces": traces}[kind](n):
        print(json.dumps(row))
