"""QLoRA: llama3_lora's adapter over Meta-Llama-3-8B's linear layers held in 4-bit NF4 with double quantization
(Dettmers et al. 2023), bf16 compute. The frozen base takes about 5.7 GB instead of 16, so the run fits one
24 GB GPU at micro-batch 4 with activation checkpointing (`python -m toolkit plan llama3_qlora --gpu RTX-4090
--gpus 1`). Needs bitsandbytes (make install brings it); trains under single_gpu.yaml or ddp.yaml.

    python recipes/llama3_qlora.py
    python recipes/llama3_qlora.py --tiny
"""

from llama3_lora import RECIPE as LORA

from toolkit import run

RECIPE = dict(LORA, load_in_4bit=True)

if __name__ == "__main__":
    run(RECIPE)
