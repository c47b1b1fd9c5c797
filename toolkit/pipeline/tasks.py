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


def model_class(task: str):
    """transformers' Auto class for a task: AutoModelForCausalLM, AutoModelForSequenceClassification."""
    return getattr(importlib.import_module("transformers"), TASKS[task].auto_class)


def peft_task_type(task: str):
    from peft import TaskType

    return TaskType[TASKS[task].peft_task_type]


def peft_model_class(task: str):
    """peft's Auto class that loads a saved adapter on its base model."""
    return getattr(importlib.import_module("peft"), TASKS[task].peft_auto_class)
