"""The model room: a model's config and tokenizer (loading.py, whose `blueprint` and `load_for_training` are the
room's entries; what refuses them before any weights, checks.py's MODEL list), the architecture on the meta device
(meta.py), parameter counts (counts.py), LoRA and QLoRA (lora.py), a mixture of experts' load-balancing loss by
layer (balance.py), dropout's settings (dropout.py), and tiny mode's scaled-down checkpoints and tokenizers
(tiny.py) and data (tiny_data.py); GGUF files: llama.cpp's converter and quantizer (gguf_convert.py) and a GGUF
run by llama.cpp as the evaluation calls a model (gguf_model.py)."""
