"""Qwen3-0.6B trained as a reward model on UltraFeedback's preference pairs: a sequence classifier with one output
that scores each chosen answer above its rejected one (TRL's RewardTrainer, the Bradley-Terry loss). Settings are
TRL's reward-modelling example's (full fine-tune, lr 1e-5, one epoch, batch 8 a device). The export is what a GRPO
recipe names as a learned reward: --reward_funcs ./runs/qwen3_reward (alone, or beside a checker, weighted).

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/qwen3_reward.py
    python -m toolkit plan qwen3_reward --gpu H100-80GB --gpus 8 --tokens_per_sample 600
    make finetune MODEL=qwen3_reward ARGS=--tiny                   # offline, a toy Qwen3, in seconds
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="Qwen/Qwen3-0.6B",
    dtype="bfloat16",
    task="reward",
    dataset_name="HuggingFaceH4/ultrafeedback_binarized",  # chosen/rejected conversations, binarized by score
    train_split="train_prefs",
    eval_split="test_prefs",
    max_eval_samples=1000,
    max_seq_length=1024,  # each sequence of a pair: the prompt and one answer
    bf16=True,
    activation_checkpointing=True,
    learning_rate=1e-5,
    lr_scheduler_type="linear",
    warmup_steps=0.03,
    per_device_train_batch_size=8,  # pairs
    num_train_epochs=1,
    logging_steps=10,
    eval_strategy="steps",
    eval_steps=200,
    save_strategy="steps",
    save_steps=500,
)

if __name__ == "__main__":
    run(RECIPE)
