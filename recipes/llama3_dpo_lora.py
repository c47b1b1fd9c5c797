"""DPO with a LoRA adapter on every linear layer (the LoRA SFT recipe's adapter; ten times the full DPO's lr).

The reference is the starting model with the adapter off: no second copy of the 8B weights, so one 80 GB GPU
holds the run. The adapter is saved on its own (load it with peft.AutoPeftModelForCausalLM; --merge_lora true
also writes the merged model).

    python recipes/llama3_dpo_lora.py
    make finetune MODEL=llama3_fft ARGS=--tiny && make finetune MODEL=llama3_dpo_lora ARGS=--tiny
"""

from llama3_dpo import RECIPE as FULL

from toolkit import run

RECIPE = dict(
    FULL,
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    lora_target_modules="all-linear",
    learning_rate=5e-6,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
)

if __name__ == "__main__":
    run(RECIPE)
