"""LoRA adapters (peft): added for training, and merged into their base after it."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel

from ..settings.arguments import ModelArguments, torch_dtype
from ..settings.tasks import peft_model_class, peft_task_type


def add_lora(model: PreTrainedModel, args: ModelArguments, task: str):
    """Wrap the model with a LoRA adapter; the adapter records `model.name_or_path` as its base."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**args.lora_settings(), lora_dropout=args.lora_dropout, task_type=peft_task_type(task))
    return get_peft_model(model, config)


def save_merged(adapter_dir: str | Path, task: str, dtype: str) -> Path:
    """Merge a saved LoRA adapter into its base weights: a standalone model in ADAPTER_DIR/merged.

    Works from the consolidated adapter on disk, so it is the same for every strategy (the adapter was gathered
    from its shards when saved). Loads one full copy of the base model in host RAM.
    """
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # This runs on rank 0 alone, after training. Under a ZeRO-3 run, from_pretrained would still partition the
    # model across ranks: collectives only this rank joins, a hang. This is the run's last step, so drop it.
    unset_hf_deepspeed_config()
    # in the precision the base trained in
    model = peft_model_class(task).from_pretrained(adapter_dir, dtype=torch_dtype(dtype))
    merged = model.merge_and_unload()  # W + (alpha / r) * B @ A, adapters removed
    target = Path(adapter_dir) / "merged"
    merged.save_pretrained(target)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(target)
    return target
