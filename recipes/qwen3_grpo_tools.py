"""The GSM8K GRPO recipe (qwen3_grpo.py) with a calculator the model may call while it answers: Qwen3's chat
template offers the tool, a completion that writes a tool call gets the result back as a tool message and goes
on, at most 4 rounds; the reward is the final answer's correctness. Each call runs in its own process with a time
limit: a tool that raises, hangs or returns nonsense is an error result the completion is scored with.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/qwen3_grpo_tools.py
    make finetune MODEL=qwen3_grpo_tools ARGS=--tiny
"""

from qwen3_grpo import RECIPE as GRPO

from toolkit import run

RECIPE = dict(GRPO, tools="calculator", max_tool_calls=4, tool_timeout=10.0)

if __name__ == "__main__":
    run(RECIPE)
