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


def rows(n: int, seed: int = 0) -> list[dict]:
    """`n` questions on two distinct fruits each, counts 2-39."""
    draw = random.Random(seed)
    out = []
    for _ in range(n):
        items = draw.sample(FRUITS, 2)
        question = (f"How many {items[0]} and {items[1]} does the shop have in all? Look each one up with the stock "
                    "tool, then give the total with the answer tool.")  # fmt: skip
        out.append({"prompt": [{"role": "user", "content": question}], "items": items,
                    "counts": [draw.randint(2, 39) for _ in items]})  # fmt: skip
    return out


if __name__ == "__main__":
    for row in rows(int(sys.argv[1]) if len(sys.argv) > 1 else 300):
        print(json.dumps(row))
