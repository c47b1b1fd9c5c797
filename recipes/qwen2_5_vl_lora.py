"""Qwen2.5-VL 7B (instruction-tuned), a LoRA adapter on its language model, supervised on LLaVA-Instruct's image
conversations (TRL's vision example data: a messages column with image parts, and the images).

The vision tower (with its merger) stays frozen and the adapter takes the decoder's linear layers; an image is as
many tokens as its 28-pixel tiles at the processor's resolution (a 640 x 480 picture: about 400), so rows run to
one or two thousand. bf16 with the fp32 adapter fits one 40-80 GB GPU. Without torchvision the processor loads for
images alone (its video processor needs it), which is all this task uses (docs/vision.md).

    python recipes/qwen2_5_vl_lora.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/qwen2_5_vl_lora.py
    make finetune MODEL=qwen2_5_vl_lora ARGS=--tiny                 # offline, a toy Qwen2.5-VL, in seconds
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="Qwen/Qwen2.5-VL-7B-Instruct",
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
