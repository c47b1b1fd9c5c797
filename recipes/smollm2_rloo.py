"""The GRPO demo's model, problems, rewards and budget (smollm2_grpo.py) trained by RLOO instead: each answer's
advantage is its reward less the mean of its 7 siblings' (leave one out), not its group's mean divided by the
group's spread, and the KL to the starting model (beta 0.05, TRL's default: under LoRA, the adapter switched off)
is a penalty on the reward. Before and after, both models answer the same held-out problems greedily (`toolkit
eval`), scored by the same reward (docs/rl.md compares it with GRPO).

    make demo-rloo
"""

from smollm2_grpo import RECIPE as GRPO

from toolkit import run

RECIPE = dict(GRPO, task="rloo")

if __name__ == "__main__":
    run(RECIPE)
