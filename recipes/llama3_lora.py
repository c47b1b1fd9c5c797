"""Meta-Llama-3-8B with a LoRA adapter on every linear layer, supervised on UltraChat conversations.

Only the adapter (about 0.5% of the weights) trains, so the frozen bf16 model plus adapter fits one 24-80 GB
GPU. The adapter is saved on its own; load it with `peft.AutoPeftModelForCausalLM.from_pretrained`.

    python recipes/llama3_lora.py
    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/llama3_lora.py --tiny
"""

from llama3_fft import RECIPE as FULL_FINETUNE

from toolkit import run

RECIPE = dict(
    FULL_FINETUNE,
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    lora_target_modules="all-linear",
    learning_rate=2e-4,
)

if __name__ == "__main__":
    run(RECIPE)
