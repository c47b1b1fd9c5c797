"""The tool demo's second stage (`make demo-tools`, docs/rl.md): GRPO with a calculator the model may call while
it answers, from the first stage's model (smollm2_tools_sft.py, merged), on three-term problems the first stage
never showed (`Calculate 780 + 267 - 37.`: sums and differences of 2-3 digit numbers; reasoning-gym
works mixed operators out left to right, `50 + 83 * 6` = 798, which a calculator does not). Each completion
that writes a tool call gets the result back and goes on (at most 2 rounds, within 96 tokens); the reward is the
final answer's correctness (reasoning-gym's checker, on what the assistant said, not on the tool's result).
`toolkit eval` then has the first stage's model and this one answer the held-out problems greedily, with the
tool. The demo's other arm trains the same way with no tool (Makefile: demo-tools).

    make demo-tools
"""

from smollm2_grpo import RECIPE as GRPO

from toolkit import run

RECIPE = dict(
    GRPO,  # the GRPO demo's model settings, LoRA, learning rate, sampling temperature and reward
    model_name_or_path="runs/smollm2_tools_sft/merged",
    dataset_name="reasoning_gym:basic_arithmetic?min_terms=3&max_terms=3&min_digits=2&max_digits=3"
    "&operators=+,-&allow_negation=false&allow_parentheses=false&size=400&seed=1",
    chat_template="trl:qwen2_5",  # the template the first stage was taught with: it offers tools
    tools="calculator",
    max_tool_calls=2,
    num_generations=4,
    max_completion_length=96,  # a call (~40 tokens), its result (~20) and the answer
    max_seq_length=360,  # the longest prompt (259 tokens: the tool's description is most of it) and the completion
    max_steps=8,
    per_device_train_batch_size=8,  # completions: 2 micro-batches of 8 = 4 problems x 4 answers a step
    output_dir="runs/smollm2_grpo_tools",
)

if __name__ == "__main__":
    run(RECIPE)
