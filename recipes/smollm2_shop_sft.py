"""The environment demo's first stage (`make demo-env`, docs/rl.md): SmolLM2-135M-Instruct taught the shop's call
format by LoRA SFT on 200 episodes played right (recipes/data/shop_traces.jsonl, from
recipes/environments/shop.py: a lookup a turn, the sum written out, then the answer; half on one item, half on
two), each offering the shop's tools through Qwen2.5's chat template as the GRPO stage offers them. SmolLM2 as it
ships never calls a tool; the GRPO stage (smollm2_grpo_env.py) starts from this one's merged model.

    make demo-env
"""

from pathlib import Path

from smollm2_tools_sft import RECIPE as TOOLS_SFT

from toolkit import run

RECIPE = dict(
    TOOLS_SFT,  # the tool demo's first stage: model, template, LoRA, learning rate, budget
    dataset_name=str(Path(__file__).resolve().parent / "data" / "shop_traces.jsonl"),
    max_seq_length=512,  # the two tools' descriptions (~250 tokens) and a two-item episode (~150)
    output_dir="runs/smollm2_shop_sft",
)

if __name__ == "__main__":
    run(RECIPE)
