"""LoRA adapters (peft): added for training, and merged into their base after it."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel

from ..settings import tasks
from ..settings.model_arguments import ModelArguments, torch_dtype
from ..settings.tasks import peft_model_class, peft_task_type


def add_lora(model: PreTrainedModel, args: ModelArguments, task: str, target_modules: str | list[str] | None = None):
    """Wrap the model with a LoRA adapter; the adapter records `model.name_or_path` as its base. `target_modules`:
    the layers to adapt, where the model's room knows better than --lora_target_modules (an image-text model's)."""
    from peft import LoraConfig, get_peft_model

    settings = args.lora_settings() | ({"target_modules": target_modules} if target_modules else {})
    config = LoraConfig(**settings, lora_dropout=args.lora_dropout, task_type=peft_task_type(task))
    return get_peft_model(model, config)


def save_merged(adapter_dir: str | Path, task: str, dtype: str, target: Path | None = None) -> Path:
    """Merge a saved LoRA adapter into its base weights: a standalone model in `target` (ADAPTER_DIR/merged).

    Works from the consolidated adapter on disk, so it is the same for every strategy (the adapter was gathered
    from its shards when saved). Loads one full copy of the base model in host RAM.
    """
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # This runs on rank 0 alone, after training. Under a ZeRO-3 run, from_pretrained would still partition the
    # model across ranks: collectives only this rank joins, a hang. This is the run's last step, so drop it.
    unset_hf_deepspeed_config()
    model = adapted_model(adapter_dir, task, dtype=torch_dtype(dtype))  # in the precision the base trained in
    merged = model.merge_and_unload()  # W + (alpha / r) * B @ A, adapters removed
    target = Path(adapter_dir) / "merged" if target is None else target
    merged.save_pretrained(target)
    if tasks.task(task).images:  # an image-text model's processor: image processor, tokenizer, chat template
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(adapter_dir).save_pretrained(target)
    else:
        AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(target)
    return target


def adapted_model(adapter_dir: str | Path, task: str, **kwargs):
    """A saved adapter on its base: by peft's Auto class for the task, or where peft has none (an image-text
    model) the base by the task's Auto class and the adapter put on it."""
    if tasks.task(task).peft_auto_class:
        return peft_model_class(task).from_pretrained(adapter_dir, **kwargs)
    from peft import PeftConfig, PeftModel

    base = tasks.model_class(task).from_pretrained(PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path,
                                                   **kwargs)  # fmt: skip
    return PeftModel.from_pretrained(base, adapter_dir)
