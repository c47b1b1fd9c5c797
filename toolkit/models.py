"""Model loading: Hub id or local folder (tiny mode is a local folder too), dtype, attention, LoRA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .arguments import ModelArguments
from .sources import check_hub_model, resolve

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ParameterCounts:
    total: int
    trainable: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ParameterCounts:
        # parameters() yields a tied weight once, so tied embeddings are not counted twice
        params = list(model.parameters())
        return cls(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))


def model_class(task: str):
    return AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM


def load_tokenizer(args: ModelArguments) -> PreTrainedTokenizerBase:
    name = resolve(args.model_name_or_path)
    check_hub_model(name)
    return AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)


def load_model(
    args: ModelArguments,
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    label_names: list[str] | None,
) -> PreTrainedModel:
    if args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got '{args.dtype}'.")
    kwargs = {}
    if label_names is not None:
        kwargs = dict(
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id={n: i for i, n in enumerate(label_names)},
        )
    name = resolve(args.model_name_or_path)
    check_hub_model(name)
    model = model_class(task).from_pretrained(
        name,
        dtype=DTYPES[args.dtype],
        attn_implementation=args.attn_implementation,
        trust_remote_code=args.trust_remote_code,
        **kwargs,
    )
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id  # sequence classification finds the last real token
    return model


def add_lora(model: PreTrainedModel, args: ModelArguments, task: str):
    """Wrap the model with a LoRA adapter; the adapter records `model.name_or_path` as its base."""
    from peft import LoraConfig, TaskType, get_peft_model

    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        # "all-linear": peft finds every linear layer of this architecture except the output head
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        task_type=TaskType.SEQ_CLS if task == "classification" else TaskType.CAUSAL_LM,
    )
    return get_peft_model(model, config)
