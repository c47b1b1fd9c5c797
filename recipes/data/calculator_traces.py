"""Writes the tool demo's two SFT sets (`make demo-tools`, docs/rl.md) from reasoning-gym's two-term problems
("Calculate 50 * 83."; sums, differences and products of 1-2 digit numbers):

    calculator_traces.jsonl  every row offers the calculator (its `tools` column, as the GRPO run's --tools
                             calculator does); every other row calls it (the question's expression, the
                             tool's result, the answer), the rest answer directly: the model learns the call
                             and that it may skip it, and the GRPO stage when calling pays
    direct_answers.jsonl     the same questions answered directly, no tool (the demo's other arm)

The demo's GRPO runs and held-out problems have three terms (sums and differences of 2-3 digit numbers),
so no SFT question is one of them.

    python recipes/data/calculator_traces.py
"""

import json
from pathlib import Path

import reasoning_gym
from transformers.utils import get_json_schema

from toolkit.training.tools import calculator

HERE = Path(__file__).parent
ROWS = 400


def main() -> None:
    problems = reasoning_gym.create_dataset("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=2,
                                            operators=["+", "-", "*"], allow_negation=False, allow_parentheses=False,
                                            size=4 * ROWS, seed=7)  # fmt: skip
    questions = list({p["question"]: p for p in problems}.values())[:ROWS]  # each question once
    tools = json.dumps([get_json_schema(calculator)])
    with open(HERE / "calculator_traces.jsonl", "w") as traced, open(HERE / "direct_answers.jsonl", "w") as direct:
        for k, p in enumerate(questions):
            ask, answer = {"role": "user", "content": p["question"]}, str(p["answer"])
            call = {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": p["metadata"]["expression"]}},
            }
            messages = [ask, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "name": "calculator", "content": calculator(p["metadata"]["expression"])},
                        {"role": "assistant", "content": answer}]  # fmt: skip
            said = messages if k % 2 == 0 else [ask, messages[-1]]
            traced.write(json.dumps({"messages": said, "tools": tools}) + "\n")
            direct.write(json.dumps({"messages": [ask, {"role": "assistant", "content": answer}]}) + "\n")
    print(f"{len(questions)} questions -> {HERE}/calculator_traces.jsonl, direct_answers.jsonl")


if __name__ == "__main__":
    main()
