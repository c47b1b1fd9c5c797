"""Gemma 3 4B (instruction-tuned), a LoRA adapter on its language model, supervised on LLaVA-Instruct's image
conversations (TRL's vision example data: a messages column with image parts, and the images).

The vision tower and projector stay frozen and the adapter takes the decoder's linear layers (peft's all-linear
would adapt the tower's too); each image is 256 tokens, so rows run to about a thousand. bf16 with the fp32 adapter
fits one 24-80 GB GPU. Task vlm_sft: the model's own processor expands each image at batch time (docs/vision.md).

    python recipes/gemma3_vlm_lora.py
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/gemma3_vlm_lora.py
    make finetune MODEL=gemma3_vlm_lora ARGS=--tiny                 # offline, a toy Gemma 3, in seconds
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="google/gemma-3-4b-it",
    dtype="bfloat16",
    task="vlm_sft",
    dataset_name="HuggingFaceH4/llava-instruct-mix-vsft",
    eval_split="test",
    max_eval_samples=256,
    max_seq_length=2048,
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    bf16=True,
    activation_checkpointing=True,
    learning_rate=2e-4,
    lr_scheduler_type="cosine",
    warmup_steps=0.03,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    num_train_epochs=1,
    logging_steps=10,
    save_strategy="steps",
    save_steps=500,
    eval_strategy="steps",
    eval_steps=500,
)

if __name__ == "__main__":
    run(RECIPE)
