"""Qwen3-0.6B aligned with KTO on kto-mix-14k: single completions labelled desirable or not (thumbs up or down),
no pairs needed. TRL's KTO example's settings: beta 0.1, lr 5e-7 (a full fine-tune), equal weights for the two
labels (the mix is balanced). The reference is a frozen copy of the start, sharded like the policy.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/qwen3_kto.py
    make finetune MODEL=qwen3_kto ARGS=--tiny
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="Qwen/Qwen3-0.6B",
    dtype="bfloat16",
    task="kto",
    dataset_name="trl-lib/kto-mix-14k",  # prompt and completion conversations, a boolean label
    train_split="train",
    eval_split="test",
    max_seq_length=1024,  # prompt and completion
    beta=0.1,
    loss_type="kto",
    bf16=True,
    activation_checkpointing=True,
    learning_rate=5e-7,
    lr_scheduler_type="cosine",
    warmup_steps=0.1,
    per_device_train_batch_size=8,  # KTO's KL estimate mismatches rows within a micro-step: more than 1 a device
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=2,
    num_train_epochs=1,
    logging_steps=10,
)

if __name__ == "__main__":
    run(RECIPE)
