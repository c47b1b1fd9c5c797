"""The architecture with every tensor on the meta device: exact shapes, no memory, no download. The planner counts
its parameters (planner/shape.py), the checks read its module names (LoRA targets, FSDP's layer class)."""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError
from ..settings.tasks import TASKS, check_task, model_class, peft_task_type
from .vision import adapter_targets, check_parts, image_encoder, train_parts


def meta_model(config, task: str, lora: dict | None = None, parts: str | None = None) -> torch.nn.Module:
    """The architecture with every tensor on the meta device: exact shapes, no memory, no download. An image-text
    model's full fine-tune trains the `parts` (--train_parts) and freezes the rest, as the run does."""
    check_task(config, task)
    auto = model_class(task)
    if type(config) not in auto._model_mapping and not getattr(config, "auto_map", None):
        other = next((t for t in TASKS if t != task and type(config) in model_class(t)._model_mapping), None)
        fix = f"pass --task {other}" if other else f"the toolkit's tasks ({', '.join(TASKS)}) do not cover it"
        raise ConfigError(f"transformers has no {task} model for {config.model_type} ({auto.__name__}): {fix}.")
    with torch.device("meta"), outside_zero3_init():
        model = auto.from_config(config)
        if lora:
            import warnings

            from peft import LoraConfig, get_peft_model

            with warnings.catch_warnings():  # peft asks transformers 5 a deprecated question: noise in `plan`
                warnings.simplefilter("ignore", FutureWarning)
                lora = dict(lora, target_modules=adapter_targets(model, lora["target_modules"]))
            model = get_peft_model(model, LoraConfig(task_type=peft_task_type(task), **lora))
        elif parts and image_encoder(model) is not None:
            train_parts(model, check_parts(parts))
    return model


@contextlib.contextmanager
def outside_zero3_init():
    """Inside a ZeRO-3 run, transformers builds every model under deepspeed.zero.Init (partitioned, with
    collectives): not what a meta model for counting wants. Suspend that for the block."""
    from transformers.integrations import deepspeed as hf_deepspeed

    current = hf_deepspeed._hf_deepspeed_config_weak_ref  # the Trainer's config, held weakly by transformers
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if current is not None and current() is not None:
            hf_deepspeed.set_hf_deepspeed_config(current())


def saved_model_bytes(folder, task: str) -> int:
    """The weights of a saved model as `from_pretrained` loads them by default (dtype "auto": its config's; fp32
    where the config says none), counted on the meta device (shared tensors once)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    return sum(p.numel() for p in meta_model(config, task).parameters()) * dtype.itemsize
