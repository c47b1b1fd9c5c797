"""The layered parser: a recipe and its overrides into typed settings (arguments.py).

A recipe is a flat mapping of defaults (alignment-handbook style). Values are resolved in this order, later
wins: `TrainingArguments` defaults < toolkit defaults < the recipe < `--tiny` settings < this machine (a run's
own: machine_layer) < a YAML file given with `--config` < command-line flags. Every key is checked against the
known fields, so a typo fails at once with the closest valid name; numbers a YAML file leaves as text are
converted; `--name none` unsets an optional setting of the toolkit's.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import importlib.util
import sys
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from ..errors import ConfigError, warn
from .arguments import ARGUMENT_CLASSES, Arguments, DataArguments, RunArguments, check_together, check_training
from .compile import AUTO
from .model_arguments import DTYPE_ALIASES, ModelArguments
from .policy import PolicyArguments
from .tasks import task
from .values import NULLS

AUTO_SETTINGS = ("torch_compile", "per_device_train_batch_size")  # flags that take `auto` beside their type's values


def has_accelerator() -> bool:
    """A GPU (or an XPU) this process can train on: without one, every process trains on the CPU."""
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def computes_bf16() -> bool:
    """Whether this machine computes bf16 at speed: a GPU, or a CPU with oneDNN's bf16 kernels (AVX512, AMX). An
    AVX2-only CPU runs bf16 matmuls in torch's reference kernel instead: 157x slower than fp32 (512x2048 by
    2048x2048, one core of an AMD EPYC, torch 2.13), so a 3-minute CPU run takes hours."""
    import torch

    return has_accelerator() or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def machine_layer(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The run's machine below `--config` and flags (`given`): a recipe's bf16 (weights or autocast) on a CPU that
    would emulate it becomes fp32, said in one line; bf16 given by --config or a flag is kept."""
    if computes_bf16():
        return {}
    changed = {}
    if DTYPE_ALIASES.get(values.get("dtype"), values.get("dtype")) == "bfloat16" and "dtype" not in given:
        changed["dtype"] = "float32"
    if values.get("bf16") is True and "bf16" not in given:
        changed["bf16"] = False
    if changed:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        warn(f"this CPU ({capability}) has no bf16 kernels (oneDNN's need AVX512 or AMX): the recipe's bf16 runs in "
             "float32 here, as bf16 emulated on such a CPU was measured 157x slower. --dtype bfloat16 --bf16 true "
             "keeps it.")  # fmt: skip
    return changed


def toolkit_defaults(recipe_name: str) -> dict[str, Any]:
    """Defaults that differ from `TrainingArguments`' own, for every recipe."""
    defaults: dict[str, Any] = {
        "output_dir": f"runs/{recipe_name}",
        "run_name": recipe_name,
        "logging_steps": 10,
        "save_strategy": "no",
        # The tracker counts real tokens itself, on the device, read once per log line (metrics/tracking.py); the
        # Trainer's own count gathers and reads every micro-batch's.
        "include_num_input_tokens_seen": "no",
        "report_to": "wandb" if importlib.util.find_spec("wandb") else "none",
        "activation_checkpointing_kwargs": {"use_reentrant": False},
        # transformers models use every parameter in forward: skip DDP's extra graph traversal per step
        "ddp_find_unused_parameters": False,
        # The Trainer replaces a NaN/inf loss by the running mean in its logs; the toolkit stops the run instead.
        "logging_nan_inf_filter": False,
        # Micro-batches of similar lengths pad less: grouped per global batch (data/length_grouping.py).
        "train_sampling_strategy": "group_by_length",
        # Compiled where it was measured faster (settings/compile.py), once the strategy and attention are known.
        "torch_compile": AUTO,
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
    hints = [typing.get_type_hints(cls).items() for cls in (ModelArguments, DataArguments, PolicyArguments,
                                                            RunArguments)]  # fmt: skip
    return {name for items in hints for name, hint in items
            if isinstance(hint, types.UnionType) and type(None) in hint.__args__}  # fmt: skip


def unset_or(convert):
    """A command-line converter that reads none/null/empty as None (unset), anything else as `convert` does."""

    def converted(text: str):
        return None if text.strip().lower() in NULLS else convert(text)

    converted.__name__ = getattr(convert, "__name__", "value")  # argparse names it in "invalid int value"
    return converted


def auto_or(convert):
    """A command-line converter that reads `auto` as itself, anything else as `convert` does."""

    def converted(text: str):
        return AUTO if text.strip().lower() == AUTO else convert(text)

    converted.__name__ = getattr(convert, "__name__", "value")
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


def word_settings() -> set[str]:
    """Settings that take words and never a flag (save_strategy's "no", an enum of TrainingArguments')."""
    out = set()
    for cls in ARGUMENT_CLASSES:
        for name, hint in typing.get_type_hints(cls).items():
            options = set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
            words = str in options or any(isinstance(o, type) and issubclass(o, enum.Enum) for o in options)
            if words and bool not in options:
                out.add(name)
    return out


def coerce(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Numbers and flags written as text, as YAML 1.1 leaves them (`learning_rate: 1e-5` is the string "1e-5"),
    converted to the setting's type; a value that is not one is an error naming the setting. Words YAML 1.1 reads
    as flags (`save_strategy: no` is False) are the words again where the setting takes words."""
    kinds, words = scalar_types(), word_settings()
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, bool) and key in words:
            out[key] = "yes" if value else "no"
            continue
        kind = kinds.get(key)
        if kind is None or not isinstance(value, str) or (key in AUTO_SETTINGS and value.strip().lower() == AUTO):
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


def save_interval(values: dict[str, Any], layers: list[tuple[str, dict[str, Any]]]) -> None:
    """A save interval the user names is one the run keeps: save_steps given in a layer above the one that left
    save_strategy at `no` (the toolkit's default, or a recipe's) makes it `steps`, said in one line; `no` and
    save_steps set in the same layer contradict each other. `layers`: (where, its settings), lowest first."""

    def top(key: str) -> int:  # the highest layer that sets `key`; -1: none (a default)
        return max((i for i, (_, layer) in enumerate(layers) if key in layer), default=-1)

    strategy, steps = values.get("save_strategy"), values.get("save_steps")
    steps_at, strategy_at = top("save_steps"), top("save_strategy")
    if steps_at < 0 or strategy_at > steps_at or str(getattr(strategy, "value", strategy)).lower() != "no":
        return  # no interval named, a higher layer's save_strategy (`--save_strategy no` over a recipe's), or in use
    if not steps > 0:
        return  # not an interval: TrainingArguments says what is wrong with it
    where = layers[steps_at][0]
    if strategy_at == steps_at:
        raise ConfigError(f"save_strategy no and save_steps {steps:g} are both set in {where}: they conflict (no "
                          f"checkpoints, or one every {steps:g} steps?): drop save_strategy no to save every "
                          f"{steps:g} steps, or drop save_steps.")  # fmt: skip
    values["save_strategy"] = "steps"
    below = layers[strategy_at][0] if strategy_at >= 0 else "the toolkit's default"
    warn(f"save_steps {steps:g} ({where}) without save_strategy steps: the run saves a checkpoint every {steps:g} "
         f"steps (save_strategy steps, instead of no from {below}).")  # fmt: skip


def argument_parser() -> tuple[HfArgumentParser, list[str]]:
    """HfArgumentParser over the argument classes and --config, every flag optional and absent unless given (the
    layers below supply the rest); and the settings that are required of the layers together."""
    # allow_abbrev: a prefix is a typo, not a match; exit_on_error: a bad value is our one line, not argparse's
    parser = HfArgumentParser(ARGUMENT_CLASSES, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--config", help="YAML file of overrides (field: value).")
    required = [a.dest for a in parser._actions if a.required]
    optional = optional_settings()
    for action in parser._actions:
        action.required = False
        if action.dest != "help":
            action.default = argparse.SUPPRESS
        if action.dest in optional and action.type is not None:  # `--max_eval_samples none`: unset
            action.type = unset_or(action.type)
        if action.dest in AUTO_SETTINGS:  # `--torch_compile auto` beside true and false
            action.type = auto_or(action.type)
    return parser, required


def command_line_flags(parser: HfArgumentParser, argv: list[str]) -> dict[str, Any]:
    """The flags given on the command line, typed; a bad value or an unknown flag is one line naming the fix."""
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
    return vars(namespace)


def auto_batch(values: dict[str, Any], below: Any) -> int | None:
    """`--per_device_train_batch_size auto`: the rows a device trains on per optimizer step (the recipe's micro-batch x
    its accumulation), which the batch finder keeps while it picks the micro-batch (training/batch_finder.py); the
    recipe's micro-batch stands until then. None when the micro-batch is a number."""
    asked = values.get("per_device_train_batch_size")
    if not (isinstance(asked, str) and asked.strip().lower() == AUTO):
        return None
    if isinstance(below, bool) or not isinstance(below, int) or below < 1:
        raise ConfigError(f"per_device_train_batch_size auto keeps the recipe's rows per step and finds the micro-"
                          f"batch that fits, and the recipe sets {below!r}: give the recipe a number (its batch) and "
                          "pass auto on the command line.")  # fmt: skip
    try:
        accumulation = int(values.get("gradient_accumulation_steps", 1))
    except (TypeError, ValueError):
        raise ConfigError(f"gradient_accumulation_steps must be a whole number, got "
                          f"{values['gradient_accumulation_steps']!r}.") from None  # fmt: skip
    values["per_device_train_batch_size"] = below
    return below * accumulation


def parse(
    recipe: dict[str, Any], recipe_name: str, argv: list[str] | None = None, tiny_defaults=None, here: bool = False
) -> Arguments:
    """Resolve a recipe and its overrides into typed argument objects.

    `tiny_defaults(values) -> dict` supplies the `--tiny` layer; it sees the values resolved so far. `here`: the
    settings of a run on this machine (machine_layer, above the tiny one), not of a plan for another.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    check_keys(recipe, f"recipe '{recipe_name}'")
    recipe = coerce(recipe, f"recipe '{recipe_name}'")
    parser, required = argument_parser()
    flags = command_line_flags(parser, argv)
    config_file = flags.pop("config", None)
    overrides = load_overrides(config_file) if config_file is not None else {}

    values: dict[str, Any] = {**toolkit_defaults(recipe_name), **recipe}
    if {**values, **overrides, **flags}.get("tiny") and tiny_defaults is not None:
        values.update(tiny_defaults({**values, **overrides, **flags}))
    if here:
        values.update(machine_layer(values, set(overrides) | set(flags)))
    below = values.get("per_device_train_batch_size")  # the recipe's, which an `auto` above it keeps per step
    values.update(overrides)
    values.update(flags)
    batch_rows = auto_batch(values, below)
    save_interval(values, [(f"recipe '{recipe_name}'", recipe), (f"--config {config_file}", overrides),
                           ("the command line", flags)])  # fmt: skip
    missing = [k for k in required if values.get(k) is None]
    if missing:
        raise ConfigError(
            f"Recipe '{recipe_name}' does not set {missing}: add them to the recipe or pass --{missing[0]}."
        )
    compile_setting = values.get("torch_compile", AUTO)
    if isinstance(compile_setting, str) and compile_setting.strip().lower() == AUTO:
        compile_setting = AUTO
        values["torch_compile"] = False  # until the runner resolves it (settings/compile.py)
    if values.get("load_best_model_at_end") and str(values.get("eval_strategy", "no")).lower() == "no":
        tiny = " (tiny mode turns the recipe's evaluation off)" if values.get("tiny") else ""
        raise ConfigError(f"load_best_model_at_end keeps the checkpoint that evaluated best, and this run does not "
                          f"evaluate{tiny}: pass --eval_strategy steps with held-out rows (--eval_fraction 0.1), or "
                          "drop --load_best_model_at_end.")  # fmt: skip
    try:
        model, data, policy, run, training = parser.parse_dict(values)
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
    if training.label_smoothing_factor and task(data.task).fused_head == "gpu":
        # TRL's fused head scores plain next-token cross-entropy from the labels, which the Trainer takes away to
        # smooth them: its forward failed in a TypeError. Asked for, one line; on a GPU's default, off.
        if model.fused_loss:
            raise ConfigError(f"--fused_loss scores the plain next-token loss and cannot smooth the labels "
                              f"(label_smoothing_factor {training.label_smoothing_factor:g}): drop one.")  # fmt: skip
        model.fused_loss = False
    policy.resolve(data.task)
    if task(data.task).samples_online and policy.max_completion_length >= data.max_seq_length:
        raise ConfigError(f"max_completion_length {policy.max_completion_length} leaves no room for the prompt in "
                          f"max_seq_length {data.max_seq_length} (the longest prompt and completion, which the memory "
                          "plan sizes): raise --max_seq_length.")  # fmt: skip
    if task(data.task).images:  # its collator reads the rows' conversations and images, which the model does not
        training.remove_unused_columns = False
    # TRL's DPOTrainer and GRPOTrainer take their own configs: the TrainingArguments and these settings
    training = policy.trl_config(data.task, training, data.max_seq_length, model.trust_remote_code)
    return Arguments(
        model, data, run, training, recipe_name, policy, torch_compile=compile_setting, batch_rows=batch_rows
    )
