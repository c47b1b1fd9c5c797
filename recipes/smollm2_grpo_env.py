"""GRPO in an environment (recipes/environments/shop.py): SmolLM2-135M-Instruct asked the total stock of two
items a shop keeps hidden; each episode it looks them up with the shop's `stock` tool, a turn each, and gives the
total with `answer`; the shop's get_reward scores the episode at its end. Each episode plays in its own process,
forked from the one Shop (docs/rl.md#environments); each call has --tool_timeout. SmolLM2 as it ships never
calls a tool: `make demo-env` starts this stage from a LoRA SFT on episodes played right (smollm2_shop_sft.py).

    make demo-env
    python recipes/smollm2_grpo_env.py --model_name_or_path runs/smollm2_shop_sft/merged
    make finetune MODEL=smollm2_grpo_env ARGS=--tiny
"""

from pathlib import Path

from smollm2_grpo import RECIPE as GRPO

from toolkit import run

HERE = Path(__file__).resolve().parent  # the shop and its rows are found from any working directory

RECIPE = dict(
    GRPO,  # the GRPO demo's model settings, LoRA, learning rate and sampling temperature
    dataset_name=str(HERE / "data" / "shop.jsonl"),
    environment=f"{HERE / 'environments' / 'shop.py'}:Shop",
    reward_funcs=None,  # the shop's get_reward is the reward
    chat_template="trl:qwen2_5",  # SmolLM2's own template shows no tool calls; Qwen2.5's uses the same turns
    max_tool_calls=3,  # two lookups and the answer
    num_generations=4,
    max_completion_length=160,  # three calls (~30 tokens each) and their results
    max_seq_length=560,  # the two tools' descriptions (~250 tokens) and the question, then the completion
    max_steps=8,
    per_device_train_batch_size=8,  # completions: 2 micro-batches of 8 = 4 questions x 4 episodes a step
    output_dir="runs/smollm2_grpo_env",
)

if __name__ == "__main__":
    run(RECIPE)
