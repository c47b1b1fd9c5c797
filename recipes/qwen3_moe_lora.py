"""Qwen3-30B-A3B (a mixture of experts: 128 experts, 8 routed per token, 3B of its 30B parameters active), a LoRA
adapter on every linear layer and on every expert, supervised on UltraChat conversations.

The experts are fused (one 3-D weight per projection stacks a layer's 128): "all-linear" adapts them through
peft's adapters on parameters (ParamWrapper), which take no dropout. The frozen bf16 base is 61 GB: sharded over
the GPUs (fsdp2.yaml, zero3.yaml) it leaves each 80 GB GPU room for the activations. The plan:
`python -m toolkit plan qwen3_moe_lora --gpus 8`.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/qwen3_moe_lora.py
    make finetune CONFIG=fsdp2 MODEL=qwen3_moe_lora NUM_PROCESSES=2 ARGS=--tiny   # offline, a toy Qwen3-MoE
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
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.0,  # peft's adapters on the fused experts' weights take no dropout
    router_aux_loss_coef=0.001,  # the family's load-balancing loss, on: a fine-tune can unbalance the routers
    bf16=True,
    activation_checkpointing=True,
    learning_rate=1e-4,
    lr_scheduler_type="cosine",
    warmup_steps=0.03,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=8,
    num_train_epochs=1,
    logging_steps=10,
    save_strategy="steps",
    save_steps=500,
    eval_strategy="steps",
    eval_steps=500,
)

if __name__ == "__main__":
    run(RECIPE)
