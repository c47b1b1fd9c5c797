"""The tasks a recipe can name, and the model classes each one loads, in one place.

The classes are named, not imported, so that reading the table costs nothing (`python -m toolkit plan` imports
it); `model_class` and friends import on use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    auto_class: str  # transformers' Auto class for the model
    peft_task_type: str  # peft's TaskType member for a LoRA adapter on it
    peft_auto_class: str  # peft's Auto class that loads base + adapter
    # Whether the model's loss is a sum over tokens divided by the Trainer's `num_items_in_batch`. A
    # classification head takes **kwargs but ignores it and returns a per-example mean; left on, the Trainer treats
    # that mean as token-normalised and multiplies loss and gradients by the number of processes, and skips the
    # division by gradient-accumulation steps.
    token_normalised_loss: bool


TASKS = {
    "classification": Task(
        "AutoModelForSequenceClassification",
        "SEQ_CLS",
        "AutoPeftModelForSequenceClassification",
        token_normalised_loss=False,
    ),
    "sft": Task("AutoModelForCausalLM", "CAUSAL_LM", "AutoPeftModelForCausalLM", token_normalised_loss=True),
}


def task(name: str) -> Task:
    """The task a recipe names; an unknown one is an error listing the known ones."""
    from ..errors import ConfigError

    if name not in TASKS:
        raise ConfigError(f"task must be {' or '.join(repr(t) for t in TASKS)}, got '{name}'.")
    return TASKS[name]


def infer_task(config) -> str:
    """The task of a model given without a recipe, from its config: the heads it was saved with (`architectures`),
    else sft where transformers has a causal LM for it, else classification."""
    names = " ".join(getattr(config, "architectures", None) or [])
    if "ForCausalLM" in names or "LMHeadModel" in names:
        return "sft"
    if any(head in names for head in ("ForSequenceClassification", "ForMaskedLM", "ForTokenClassification")):
        return "classification"
    return "sft" if type(config) in model_class("sft")._model_mapping else "classification"


def model_class(name: str):
    """transformers' Auto class for a task: AutoModelForCausalLM, AutoModelForSequenceClassification."""
    return getattr(importlib.import_module("transformers"), task(name).auto_class)


def peft_task_type(name: str):
    from peft import TaskType

    return TaskType[task(name).peft_task_type]


def peft_model_class(name: str):
    """peft's Auto class that loads a saved adapter on its base model."""
    return getattr(importlib.import_module("peft"), task(name).peft_auto_class)
