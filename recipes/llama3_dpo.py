"""Meta-Llama-3-8B after SFT, aligned with DPO on UltraFeedback preference pairs (Zephyr-7B-beta's recipe).

Starts from the SFT recipe's output (runs/llama3_fft: make finetune MODEL=llama3_fft first, or pass
--model_name_or_path with another chat model). Hyper-parameters are alignment-handbook's for Zephyr-7B-beta
(recipes/zephyr-7b-beta/dpo/config_full.yaml): beta 0.01, lr 5e-7 with cosine decay and 10% warmup, one epoch.
The reference model is a frozen copy of the start, sharded like the policy under FSDP and ZeRO-3: shard both.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/llama3_dpo.py
    make finetune MODEL=llama3_fft ARGS=--tiny && make finetune MODEL=llama3_dpo ARGS=--tiny
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="./runs/llama3_fft",  # the SFT recipe's output folder
    dtype="bfloat16",
    task="dpo",
    dataset_name="HuggingFaceH4/ultrafeedback_binarized",  # chosen/rejected conversations, binarized by score
    train_split="train_prefs",
    eval_split="test_prefs",
    chat_template="llama3",
    max_seq_length=1024,  # prompt and answer, each sequence of the pair
    beta=0.01,
    loss_type="sigmoid",  # DPO itself
    bf16=True,
    activation_checkpointing=True,
    learning_rate=5e-7,
    lr_scheduler_type="cosine",
    warmup_steps=0.1,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=2,
    num_train_epochs=1,
    logging_steps=10,
)

if __name__ == "__main__":
    run(RECIPE)
