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
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from ..distributed.launch import has_accelerator
from ..errors import ConfigError

# What people type for a dtype, and the name torch and transformers use.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
NULLS = ("none", "null", "")  # how a command line says "unset" for an optional setting


def optional_fields_unset(settings) -> None:
    """`--eval_split None`, `--chat_template ""`: an optional setting given as none/null/empty is unset (None),
    not a split or a template of that name."""
    for f in fields(settings):
        hint = typing.get_type_hints(type(settings)).get(f.name)
        optional = isinstance(hint, types.UnionType) and type(None) in hint.__args__
        value = getattr(settings, f.name)
        if optional and isinstance(value, str) and value.strip().lower() in NULLS:
            setattr(settings, f.name, None)


def at_least(name: str, value: float | None, low: float, fix: str = "") -> None:
    if value is not None and value < low:
        raise ConfigError(f"{name} must be at least {low:g}, got {value:g}{fix}.")


def looks_like_path(name: str) -> bool:
    """A local path, not a Hub id ("org/name"): it starts like one, or has more than one '/'."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).suffix in (".json",
           ".jsonl", ".csv", ".parquet")  # fmt: skip


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

    def __post_init__(self) -> None:
        optional_fields_unset(self)
        self.dtype = DTYPE_ALIASES.get(self.dtype.lower(), self.dtype.lower())
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype '{self.dtype}' is not one of {', '.join(DTYPES)} (bf16, fp16 and fp32 work too): "
                              "pass --dtype bfloat16, for example.")  # fmt: skip
        attention = self.attn_implementation
        if attention is not None and attention not in ATTENTION and "/" not in attention:  # "/": a Hub kernel
            raise ConfigError(f"attn_implementation '{attention}' is not one of {', '.join(ATTENTION)}: pass "
                              "--attn_implementation sdpa, for example.")  # fmt: skip
        at_least("lora_r", self.lora_r, 1, " (the adapter's rank; 8-64 is usual)")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be positive, got {self.lora_alpha} (twice lora_r is usual).")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout is a probability below 1, got {self.lora_dropout}: pass 0.05, say.")
        if not self.lora_target_modules.replace(",", " ").strip():
            raise ConfigError("lora_target_modules is empty: pass all-linear, or module names like q_proj,v_proj.")
        check_local_path(self.model_name_or_path, "model", "--model_name_or_path", "config.json")

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
    skip_bad_rows: bool = field(
        default=False,
        metadata={
            "help": "Leave out unusable rows (no assistant turn, null content, no label), counted, instead "
            "of stopping at the first."
        },  # fmt: skip
    )

    def __post_init__(self) -> None:
        optional_fields_unset(self)
        from .tasks import task

        task(self.task)
        at_least("max_seq_length", self.max_seq_length, 1)
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction is the share of train held out, from 0 to below 1, got "
                              f"{self.eval_fraction}: pass 0.1, say, or --eval_split <name>.")  # fmt: skip
        for name in ("max_train_samples", "max_eval_samples"):
            at_least(name, getattr(self, name), 1, " (leave it unset to use every row)")
        check_local_path(self.dataset_name, "data set", "--dataset_name")


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
    generation_samples: int = field(
        default=0,
        metadata={"help": "sft: at each evaluation, answer this many held-out prompts (OUTPUT/samples.jsonl, W&B)."},
    )
    generation_max_new_tokens: int = field(default=64, metadata={"help": "Length of each generation sample."})

    def __post_init__(self) -> None:
        optional_fields_unset(self)
        if self.pricing not in ("on_demand", "spot"):
            raise ConfigError(f"pricing must be 'on_demand' or 'spot', got '{self.pricing}'.")
        for name in ("budget_usd", "hourly_usd", "peak_tflops"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.cost_overhead < 1:
            raise ConfigError(f"cost_overhead multiplies the cost and is at least 1, got {self.cost_overhead}.")
        at_least("lr_reference_batch_size", self.lr_reference_batch_size, 1)
        at_least("generation_samples", self.generation_samples, 0)
        at_least("generation_max_new_tokens", self.generation_max_new_tokens, 1)


def check_local_path(name: str, what: str, flag: str, inside: str | None = None) -> None:
    """A setting that names a local path (not a Hub id, not a package: path) must exist, with `inside` in it."""
    from .sources import PACKAGE_PREFIX

    if name.startswith(PACKAGE_PREFIX) or not looks_like_path(name):
        return
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(f"The {what} path {name} does not exist: pass an existing path with {flag}, or a Hub id "
                          "(org/name).")  # fmt: skip
    if inside and path.is_dir() and not (path / inside).is_file():
        raise ConfigError(f"{name} has no {inside}: pass a folder written by save_pretrained with {flag}.")


def check_training(training: TrainingArguments) -> None:
    """The TrainingArguments fields with a domain transformers leaves to fail later (in the optimizer, the data
    loader, or the first save): checked before anything loads."""
    if training.learning_rate <= 0:
        raise ConfigError(f"learning_rate must be positive, got {training.learning_rate:g}: pass 2e-5, say.")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        at_least(name, getattr(training, name), 1)
    if training.max_steps <= 0 and training.num_train_epochs <= 0:
        raise ConfigError(f"Nothing to train: num_train_epochs is {training.num_train_epochs:g} and max_steps is "
                          "unset: pass --num_train_epochs 1 or --max_steps N.")  # fmt: skip
    if training.warmup_steps < 0 or training.weight_decay < 0:
        raise ConfigError("warmup_steps and weight_decay cannot be negative: pass 0 to turn them off.")
    if Path(training.output_dir).exists() and not Path(training.output_dir).is_dir():
        raise ConfigError(f"output_dir {training.output_dir} is a file: pass a folder with --output_dir.")
    if str(training.save_strategy) in ("steps", "SaveStrategy.STEPS") and training.save_steps <= 0:
        raise ConfigError(f"save_strategy steps with save_steps {training.save_steps:g} never saves: pass "
                          "--save_steps N.")  # fmt: skip


def check_together(data: DataArguments, run: RunArguments, training: TrainingArguments) -> None:
    """Settings that are each fine but fail together, after training has started."""
    evaluates = str(getattr(training.eval_strategy, "value", training.eval_strategy)) != "no"
    if evaluates and data.eval_split is None and not data.eval_fraction:
        raise ConfigError(f"eval_strategy {training.eval_strategy.value} has nothing to evaluate on: pass "
                          "--eval_split <split> or --eval_fraction 0.1, or --eval_strategy no.")  # fmt: skip
    if run.generation_samples and (data.task != "sft" or (data.eval_split is None and not data.eval_fraction)):
        raise ConfigError("generation_samples answers held-out prompts of an sft run: give it evaluation data "
                          "(--eval_split <split> or --eval_fraction 0.1), or drop it.")  # fmt: skip
    metric = training.metric_for_best_model
    known = {"loss"} | ({"accuracy"} if data.task == "classification" else {"perplexity", "token_accuracy"})
    if metric is not None and metric.removeprefix("eval_") not in known:
        raise ConfigError(f"metric_for_best_model '{metric}' is not a metric this {data.task} run reports (it "
                          f"reports {', '.join(sorted(known))}): pass --metric_for_best_model loss.")  # fmt: skip


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


def optional_settings() -> set[str]:
    """The toolkit's settings whose type admits None. (TrainingArguments' are transformers': there "none" can be a
    value of its own, as in --report_to none.)"""
    hints = [typing.get_type_hints(cls).items() for cls in (ModelArguments, DataArguments, RunArguments)]
    return {name for items in hints for name, hint in items
            if isinstance(hint, types.UnionType) and type(None) in hint.__args__}  # fmt: skip


def unset_or(convert):
    """A command-line converter that reads none/null/empty as None (unset), anything else as `convert` does."""

    def converted(text: str):
        return None if text.strip().lower() in NULLS else convert(text)

    converted.__name__ = getattr(convert, "__name__", "value")  # argparse names it in "invalid int value"
    return converted


def scalar_types() -> dict[str, type]:
    """Settings whose type is a number or a flag (optional or not), and that type; str-or-x settings excluded."""
    out = {}
    for cls in ARGUMENT_CLASSES:
        for name, hint in typing.get_type_hints(cls).items():
            options = set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
            kinds = options & {int, float, bool}
            if len(kinds) == 1 and str not in options:
                out[name] = kinds.pop()
    return out


def coerce(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Numbers and flags written as text, as YAML 1.1 leaves them (`learning_rate: 1e-5` is the string "1e-5"),
    converted to the setting's type; a value that is not one is an error naming the setting."""
    kinds = scalar_types()
    out = dict(values)
    for key, value in values.items():
        kind = kinds.get(key)
        if kind is None or not isinstance(value, str):
            continue
        try:
            if kind is bool:
                out[key] = {"true": True, "false": False, "yes": True, "no": False}[value.strip().lower()]
            else:
                out[key] = kind(float(value)) if kind is int and float(value).is_integer() else kind(value)
        except (KeyError, ValueError):
            wanted = "true or false" if kind is bool else f"a{'n integer' if kind is int else ' number'}"
            raise ConfigError(f"{key} in {where} must be {wanted}, got '{value}'.") from None
    return out


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
    return coerce(values, path)


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
    recipe = coerce(recipe, f"recipe '{recipe_name}'")
    # allow_abbrev: a prefix is a typo, not a match; exit_on_error: a bad value is our one line, not argparse's
    parser = HfArgumentParser(ARGUMENT_CLASSES, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--config", help="YAML file of overrides (field: value).")
    required = [a.dest for a in parser._actions if a.required]
    optional = optional_settings()
    for action in parser._actions:  # keep only the flags actually given; the layers below supply the rest
        action.required = False
        if action.dest != "help":
            action.default = argparse.SUPPRESS
        if action.dest in optional and action.type is not None:  # `--max_eval_samples none`: unset
            action.type = unset_or(action.type)
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:  # a value of the wrong type, or not among the choices
        raise ConfigError(f"Invalid command-line arguments: {e} (--help lists every setting).") from None
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
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Invalid setting: {' '.join(str(e).split())}") from None
    check_training(training)
    check_together(data, run, training)
    if run.resume and training.resume_from_checkpoint:
        raise ConfigError("Both resume and resume_from_checkpoint are set: keep one (--resume auto picks the newest).")
    if model.merge_lora and not model.use_lora:
        raise ConfigError("merge_lora merges a LoRA adapter: set use_lora true too, or drop merge_lora.")
    return Arguments(model, data, run, training, recipe_name)
