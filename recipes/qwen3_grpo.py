"""Qwen3-0.6B, full fine-tune with online RL (GRPO) on GSM8K's grade-school math, rewarded by the answer's
correctness (math-verify judges the completion's last number against GSM8K's `#### N`). A GPU recipe: each GPU
samples 8 completions of up to 512 tokens for each of its 8 prompts a step (64 prompts on 8 GPUs); bf16,
activation checkpointing, no reference model (beta 0, TRL's default). Held-out: GSM8K's test split, base and
tuned greedy, scored the same way.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/qwen3_grpo.py
    python -m toolkit plan qwen3_grpo --gpu H100-80GB --gpus 8
    make finetune MODEL=qwen3_grpo ARGS=--tiny                      # offline, a toy Qwen3, in seconds
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="Qwen/Qwen3-0.6B",
    dtype="bfloat16",
    task="grpo",
    dataset_name="openai/gsm8k",
    dataset_config="main",
    prompt_column="question",  # the user's turn; `answer` ends in "#### <number>", which the reward reads
    eval_split="test",
    max_eval_samples=256,
    reward_funcs="accuracy",
    num_generations=8,
    max_completion_length=512,
    max_seq_length=768,  # the longest prompt and completion, for the memory plan
    temperature=1.0,
    bf16=True,
    activation_checkpointing=True,
    learning_rate=1e-6,
    lr_scheduler_type="cosine",
    warmup_steps=0.03,
    per_device_train_batch_size=16,  # completions
    gradient_accumulation_steps=4,
    max_steps=500,
    logging_steps=5,
    save_strategy="steps",
    save_steps=100,
    eval_strategy="no",
    eval_after_training=True,
)

if __name__ == "__main__":
    run(RECIPE)
