"""Recipe arguments and the layered parser.

A recipe is a flat mapping of defaults (alignment-handbook style). Values are resolved in this order, later
wins: `TrainingArguments` defaults < toolkit defaults < the recipe < `--tiny` settings < a YAML file given
with `--config` < command-line flags. Every key is checked against the known fields, so a typo fails at once
with the closest valid name.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from ..distributed.launch import has_accelerator
from ..errors import ConfigError


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Hub id, local folder, or package:<module>/<path>."})
    dtype: str = field(default="auto", metadata={"help": "Weights dtype: auto, float32, bfloat16, float16."})
    attn_implementation: str | None = field(default=None, metadata={"help": "eager, sdpa, flash_attention_2."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code from the Hub repo."})
    use_lora: bool = field(default=False, metadata={"help": "Train a PEFT LoRA adapter instead of all weights."})
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Comma-separated module names, or all-linear (every linear but the head)."},
    )
    merge_lora: bool = field(
        default=False,
        metadata={"help": "LoRA: also save base + adapter merged into one standalone model in OUTPUT_DIR/merged."},
    )

    def lora_settings(self) -> dict[str, Any] | None:
        """The peft LoraConfig arguments that decide the adapter's shape (dropout aside), or None without LoRA."""
        if not self.use_lora:
            return None
        targets = self.lora_target_modules  # "all-linear": peft finds every linear layer but the output head
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",")]
        return {"r": self.lora_r, "lora_alpha": self.lora_alpha, "target_modules": targets}


@dataclass
class DataArguments:
    task: str = field(metadata={"help": "classification or sft."})
    dataset_name: str = field(
        metadata={"help": "Hub id, local file (json/jsonl/csv/parquet), folder of class subfolders, or package: path."}
    )
    dataset_config: str | None = None
    train_split: str = "train"
    eval_split: str | None = field(default=None, metadata={"help": "Split to evaluate on; else eval_fraction."})
    eval_fraction: float = field(default=0.0, metadata={"help": "Hold out this fraction of train for evaluation."})
    text_columns: str = field(default="text", metadata={"help": "classification: one column, or two comma-separated."})
    label_column: str = "label"
    messages_column: str = field(default="messages", metadata={"help": "sft: list of {role, content} messages."})
    chat_template: str | None = field(default=None, metadata={"help": "sft: a named template (llama3) or Jinja."})
    max_seq_length: int = 512
    packing: bool | None = field(
        default=None,
        metadata={
            "help": "sft: several conversations per row up to max_seq_length, attention kept inside each. "
            "Default: on where the model's attention supports it."
        },  # fmt: skip
    )
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    text_encoding: str = field(default="utf-8", metadata={"help": "Encoding of .txt files in a class folder."})


@dataclass
class RunArguments:
    tiny: bool = field(default=False, metadata={"help": "Same architecture at toy size, random init, local data."})
    gpu_type: str | None = field(default=None, metadata={"help": "Price-table entry; detected when not given."})
    hourly_usd: float | None = field(default=None, metadata={"help": "Price per device-hour, overrides the table."})
    pricing: str = field(default="on_demand", metadata={"help": "on_demand or spot."})
    cost_overhead: float = field(
        default=1.0, metadata={"help": "Multiplies every dollar figure (e.g. 1.3 for failed runs and tuning)."}
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "Dense peak TFLOPS per device for MFU; from the price table when not given (GPUs)."},
    )
    budget_usd: float | None = field(
        default=None,
        metadata={"help": "Stop cleanly, with a checkpoint, before the run's cost (resumes included) passes this."},
    )
    force_budget: bool = field(
        default=False, metadata={"help": "Start even when the planned cost of the whole run exceeds --budget_usd."}
    )
    lr_reference_batch_size: int | None = field(
        default=None,
        metadata={"help": "Linear LR scaling: lr *= global_batch / this (Goyal et al. 2017), with warmup."},
    )
    wandb_project: str = "finetune-recipes"
    wandb_group: str | None = None
    wandb_tags: str | None = field(default=None, metadata={"help": "Extra comma-separated W&B tags."})
    resume: str | None = field(
        default=None,
        metadata={
            "help": "auto: continue from the newest complete checkpoint in output_dir (or start fresh, saying "
            "so); or a checkpoint folder."
        },  # fmt: skip
    )
    record_rank_reports: bool = field(
        default=False,
        metadata={"help": "Write rows trained on and a weight digest per rank to output_dir/rank_reports/."},
    )


ARGUMENT_CLASSES = (ModelArguments, DataArguments, RunArguments, TrainingArguments)


def toolkit_defaults(recipe_name: str) -> dict[str, Any]:
    """Defaults that differ from `TrainingArguments`' own, for every recipe."""
    defaults: dict[str, Any] = {
        "output_dir": f"runs/{recipe_name}",
        "run_name": recipe_name,
        "logging_steps": 10,
        "save_strategy": "no",
        "include_num_input_tokens_seen": "non_padding",  # tokens/s counts only real tokens
        "report_to": "wandb" if importlib.util.find_spec("wandb") else "none",
        "activation_checkpointing_kwargs": {"use_reentrant": False},
        # transformers models use every parameter in forward: skip DDP's extra graph traversal per step
        "ddp_find_unused_parameters": False,
        # The Trainer replaces a NaN/inf loss by the running mean in its logs; the toolkit stops the run instead.
        "logging_nan_inf_filter": False,
        # Micro-batches of similar lengths pad less: grouped per global batch (length_grouping.py).
        "train_sampling_strategy": "group_by_length",
    }
    if not has_accelerator():
        # Without it, a multi-process launch on CPU trains as independent, non-distributed ranks.
        defaults["use_cpu"] = True
    return defaults


def known_fields() -> set[str]:
    return {f.name for cls in ARGUMENT_CLASSES for f in fields(cls) if f.init} | {"config"}


def check_keys(values: dict[str, Any], where: str) -> None:
    """Fail on unknown keys, suggesting the closest known one."""
    known = known_fields()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"Unknown setting '{key}' in {where}.{hint}")


def load_overrides(path: str) -> dict[str, Any]:
    """Read a YAML file of overrides (a flat mapping of field: value)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Config file not found: {path}")
    try:
        values = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file {path} is not valid YAML: {e}") from e
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"Config file {path} must be a mapping of setting: value, got {type(values).__name__}.")
    check_keys(values, path)
    return values


def global_batch_size(training: TrainingArguments) -> int:
    """Samples per optimizer step over the whole job."""
    return training.per_device_train_batch_size * training.gradient_accumulation_steps * training.world_size


def scaled_learning_rate(base_lr: float, global_batch: int, reference_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): lr grows with the batch."""
    return base_lr * global_batch / reference_batch


def scale_learning_rate(training: TrainingArguments, reference_batch: int | None) -> float:
    """--lr_reference_batch_size: scale the learning rate to this job's global batch, in place, with a warmup;
    returns the recipe's own learning rate. Before the Trainer copies lr into DeepSpeed's "auto" values."""
    base = training.learning_rate
    if reference_batch:
        training.learning_rate = scaled_learning_rate(base, global_batch_size(training), reference_batch)
        if not training.warmup_steps:  # a large scaled lr needs a gradual start
            training.warmup_steps = 0.05
    return base


@dataclass
class Arguments:
    model: ModelArguments
    data: DataArguments
    run: RunArguments
    training: TrainingArguments
    recipe_name: str

    def resolved(self) -> dict[str, Any]:
        """Everything that defines the run, JSON-serialisable, secrets masked (TrainingArguments masks *_token)."""
        out = {"recipe": self.recipe_name}
        for part in (self.model, self.data, self.run):
            out.update(vars(part))
        out.update(self.training.to_dict())
        return out


def parse(recipe: dict[str, Any], recipe_name: str, argv: list[str] | None = None, tiny_defaults=None) -> Arguments:
    """Resolve a recipe and its overrides into typed argument objects.

    `tiny_defaults(values) -> dict` supplies the `--tiny` layer; it sees the values resolved so far.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    check_keys(recipe, f"recipe '{recipe_name}'")
    parser = HfArgumentParser(ARGUMENT_CLASSES, allow_abbrev=False)  # a prefix is a typo, not a match
    parser.add_argument("--config", help="YAML file of overrides (field: value).")
    required = [a.dest for a in parser._actions if a.required]
    for action in parser._actions:  # keep only the flags actually given; the layers below supply the rest
        action.required = False
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except SystemExit as e:
        if e.code == 0:
            raise
        raise ConfigError("Invalid command-line arguments (see the message above; --help lists them).") from e
    if unknown:
        flag = unknown[0].lstrip("-").split("=")[0]
        close = difflib.get_close_matches(flag, known_fields(), n=1)
        hint = f" Did you mean '--{close[0]}'?" if close else ""
        raise ConfigError(f"Unknown command-line argument '{unknown[0]}'.{hint}")
    flags = vars(namespace)
    overrides = load_overrides(flags.pop("config")) if "config" in flags else {}

    values: dict[str, Any] = {**toolkit_defaults(recipe_name), **recipe}
    if {**values, **overrides, **flags}.get("tiny") and tiny_defaults is not None:
        values.update(tiny_defaults({**values, **overrides, **flags}))
    values.update(overrides)
    values.update(flags)
    missing = [k for k in required if values.get(k) is None]
    if missing:
        raise ConfigError(
            f"Recipe '{recipe_name}' does not set {missing}: add them to the recipe or pass --{missing[0]}."
        )
    try:
        model, data, run, training = parser.parse_dict(values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Invalid setting: {e}") from e
    if data.task not in ("classification", "sft"):
        raise ConfigError(f"task must be 'classification' or 'sft', got '{data.task}'.")
    if run.pricing not in ("on_demand", "spot"):
        raise ConfigError(f"pricing must be 'on_demand' or 'spot', got '{run.pricing}'.")
    for name in ("budget_usd", "hourly_usd", "peak_tflops"):
        if getattr(run, name) is not None and getattr(run, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(run, name)}.")
    if run.cost_overhead < 1:
        raise ConfigError(f"cost_overhead multiplies the cost and is at least 1, got {run.cost_overhead}.")
    if run.resume and training.resume_from_checkpoint:
        raise ConfigError("Both resume and resume_from_checkpoint are set: keep one (--resume auto picks the newest).")
    if model.merge_lora and not model.use_lora:
        raise ConfigError("merge_lora merges a LoRA adapter: set use_lora true too, or drop merge_lora.")
    return Arguments(model, data, run, training, recipe_name)
