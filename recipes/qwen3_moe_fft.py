"""Qwen3-30B-A3B (a mixture of experts: 128 experts, 8 routed per token), every weight trained, supervised on
UltraChat conversations, its experts split over the GPUs (expert parallelism).

The experts hold 29B of its 30.5B weights. Under fsdp2.yaml every layer's 128 experts are gathered to every GPU
to compute it; under fsdp2_ep.yaml each GPU keeps 128 / ep_size experts whole and each token goes to the GPUs of
its 8 experts and back (all-to-all), the rest FSDP2-sharded. With AdamW's states, 30.5B weights need ~490 GB: 8 x
80 GB with activation checkpointing. The plan: `python -m toolkit plan qwen3_moe_fft --gpus 8`.

    python -m toolkit launch --config_file accelerate_configs/fsdp2_ep.yaml --num_processes 8 \\
        --parallelism_config_dp_shard_size 8 --parallelism_config_ep_size 8 recipes/qwen3_moe_fft.py
    make finetune CONFIG=fsdp2_ep MODEL=qwen3_moe_fft ARGS=--tiny     # offline, a toy Qwen3-MoE on 2 processes
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="Qwen/Qwen3-30B-A3B",
    dtype="bfloat16",
    task="sft",
    dataset_name="HuggingFaceH4/ultrachat_200k",
    train_split="train_sft",
    eval_split="test_sft",
    max_eval_samples=1000,
    max_seq_length=2048,
    router_aux_loss_coef=0.001,  # the family's load-balancing loss, on: a fine-tune can unbalance the routers
    bf16=True,
    activation_checkpointing=True,
    learning_rate=1e-5,
    lr_scheduler_type="cosine",
    warmup_steps=0.03,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=16,
    num_train_epochs=1,
    logging_steps=10,
    save_strategy="steps",
    save_steps=500,
    eval_strategy="steps",
    eval_steps=500,
)

if __name__ == "__main__":
    run(RECIPE)
