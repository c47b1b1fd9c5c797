"""The model room: a model's config and tokenizer, checked before any weights (loading.py, whose `blueprint` and
`load_for_training` are the room's entries), the architecture on the meta device (meta.py), parameter counts
(counts.py), LoRA and QLoRA (lora.py), and tiny mode's scaled-down checkpoints, tokenizers and data (tiny.py)."""
