"""Qwen3-0.6B distilled on-policy from Qwen3-30B-A3B (a mixture of experts, the family's own teacher size) on
GSM8K's questions: the student answers each question itself and learns, token by token, the teacher's
next-token distribution on its own answer (reverse KL, TRL's default), so it learns where it goes wrong rather
than imitating text it would never write. Full fine-tune, bf16; the teacher is frozen (61 GB in bf16), partitioned
with the student under ZeRO-3.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/qwen3_distill.py
    make finetune MODEL=qwen3_distill ARGS=--tiny
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="Qwen/Qwen3-0.6B",
    teacher_model_name_or_path="Qwen/Qwen3-30B-A3B",
    dtype="bfloat16",
    task="distill",
    dataset_name="openai/gsm8k",
    dataset_config="main",
    prompt_column="question",
    eval_fraction=0.02,
    max_completion_length=512,
    max_seq_length=768,  # the longest question (~250 tokens with the template) and its answer
    beta=1.0,  # reverse KL: the student's own answers scored by the teacher
    temperature=1.0,
    bf16=True,
    activation_checkpointing=True,
    learning_rate=1e-6,
    lr_scheduler_type="cosine",
    warmup_steps=0.05,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=4,
    max_steps=200,
    logging_steps=5,
    save_strategy="steps",
    save_steps=50,
)

if __name__ == "__main__":
    run(RECIPE)
