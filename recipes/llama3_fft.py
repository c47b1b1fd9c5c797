"""Meta-Llama-3-8B, full fine-tune (every weight), supervised on UltraChat conversations.

bf16 weights and compute, gradient checkpointing; loss on the assistant's tokens only. 8B parameters with
AdamW need about 16 bytes per parameter before activations: shard them (FSDP or ZeRO-3) across 8 x 80 GB.

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/llama3_fft.py
    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/llama3_fft.py --tiny
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="meta-llama/Meta-Llama-3-8B",
    dtype="bfloat16",
    task="sft",
    dataset_name="HuggingFaceH4/ultrachat_200k",
    train_split="train_sft",
    eval_split="test_sft",
    max_eval_samples=1000,
    chat_template="llama3",
    max_seq_length=2048,
    bf16=True,
    activation_checkpointing=True,  # a.k.a. gradient checkpointing
    learning_rate=2e-5,
    lr_scheduler_type="cosine",
    warmup_steps=0.03,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    num_train_epochs=1,
    logging_steps=5,
)

if __name__ == "__main__":
    run(RECIPE)
