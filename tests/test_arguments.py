"""Layered arguments: recipe < --tiny < YAML < command line, and clear errors for typos and bad files."""

from __future__ import annotations

import importlib
import os
import platform
import re
from pathlib import Path

import pytest

from toolkit.errors import ConfigError
from toolkit.models.tiny import tiny_layer
from toolkit.settings import parser
from toolkit.settings.parser import parse

RECIPE = dict(
    model_name_or_path="google-bert/bert-base-cased",
    task="classification",
    dataset_name="nyu-mll/glue",
    learning_rate=2e-5,
    per_device_train_batch_size=32,
    max_seq_length=128,
)


def test_yaml_words_read_as_flags_are_words_again(tmp_path):
    """YAML 1.1 reads an unquoted `no` as False: `save_strategy: no` was refused as "False is not a valid
    SaveStrategy". A setting that takes words gets the word; a flag (bf16) and a flag-or-word setting
    (torch_compile) keep the flag."""
    overrides = tmp_path / "o.yaml"
    overrides.write_text("save_strategy: no\neval_strategy: no\nbf16: no\ntorch_compile: no\n")
    args = parse(RECIPE, "bert", ["--config", str(overrides)])
    assert args.training.save_strategy == "no" and args.training.eval_strategy == "no"
    assert args.training.bf16 is False and args.torch_compile is False


def test_layers_later_wins(tmp_path):
    overrides = tmp_path / "o.yaml"
    overrides.write_text("learning_rate: 3.0e-5\nmax_seq_length: 256\nlora_r: 8\n")
    args = parse(RECIPE, "bert", ["--config", str(overrides), "--max_seq_length", "64"])
    assert args.training.learning_rate == 3e-5  # YAML over recipe
    assert args.data.max_seq_length == 64  # command line over YAML
    assert args.model.lora_r == 8
    assert args.training.per_device_train_batch_size == 32  # recipe over TrainingArguments' default of 8
    assert args.training.output_dir == "runs/bert"  # toolkit default
    assert args.training.logging_nan_inf_filter is False  # toolkit default over TrainingArguments' True
    assert args.training.include_num_input_tokens_seen == "no"  # the tracker counts tokens (metrics/tracking.py)


def test_tiny_layer_sits_under_explicit_flags():
    args = parse(RECIPE, "bert", ["--tiny", "--max_steps", "3"], tiny_defaults=tiny_layer)
    assert args.run.tiny
    assert args.training.max_steps == 3  # flag beats tiny
    assert args.training.learning_rate == 2e-3  # tiny beats recipe
    assert args.data.dataset_name.endswith(".jsonl")
    checkpoint = Path(args.model.model_name_or_path)  # a local tiny checkpoint of the recipe's model
    assert checkpoint.name.startswith("google-bert--bert-base-cased-classification-")
    assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer.json").is_file()
    plain = parse(RECIPE, "bert", [], tiny_defaults=tiny_layer)
    assert not plain.run.tiny and plain.data.dataset_name == "nyu-mll/glue"


def test_tiny_from_yaml(tmp_path):
    overrides = tmp_path / "o.yaml"
    overrides.write_text("tiny: true\n")
    args = parse(RECIPE, "bert", ["--config", str(overrides)], tiny_defaults=tiny_layer)
    assert args.run.tiny and args.data.dataset_name.endswith(".jsonl")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learning_rat", "1e-4"], "Did you mean '--learning_rate'?"),
        (["--num_train_epoch", "4"], "Did you mean '--num_train_epochs'?"),
        (["--lora_r", "many"], "Invalid command-line arguments"),
        (["--merge_lora", "true"], "merge_lora merges a LoRA adapter: set use_lora true too"),
    ],
)
def test_bad_flags(argv, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("(", r"\(")):
        parse(RECIPE, "bert", argv)


def test_typo_in_recipe_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"'max_seq_len' in recipe 'bert'. Did you mean 'max_seq_length'\?"):
        parse({**RECIPE, "max_seq_len": 10}, "bert", [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("lerning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"Did you mean 'learning_rate'\?"):
        parse(RECIPE, "bert", ["--config", str(bad)])


def test_malformed_and_missing_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse(RECIPE, "bert", ["--config", str(bad)])
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse(RECIPE, "bert", ["--config", str(bad)])
    with pytest.raises(ConfigError, match="Config file not found"):
        parse(RECIPE, "bert", ["--config", str(tmp_path / "nope.yaml")])


def test_missing_required_and_bad_choice():
    with pytest.raises(ConfigError, match=r"No data set: set dataset_name \(or dataset_mixture\)"):
        parse({k: v for k, v in RECIPE.items() if k != "dataset_name"}, "bert", [])
    with pytest.raises(ConfigError, match="task must be"):
        parse(RECIPE, "bert", ["--task", "regression"])


@pytest.mark.parametrize("name", ["bert", "llama3_fft", "llama3_lora", "minilm_bbc"])
def test_every_recipe_parses(name):
    recipe = importlib.import_module(name).RECIPE
    args = parse(recipe, name, [])
    assert args.model.model_name_or_path == recipe["model_name_or_path"]
    assert args.model.use_lora == (name == "llama3_lora")
    tiny = parse(recipe, name, ["--tiny"], tiny_defaults=tiny_layer)
    assert tiny.run.tiny and tiny.model.dtype == "float32" and not tiny.training.bf16


def test_secrets_masked_in_resolved_config():
    args = parse(RECIPE, "bert", ["--hub_token", "hf_supersecret"])
    assert "hf_supersecret" not in str(args.resolved())


def test_a_named_save_interval_turns_saving_on_and_a_contradiction_is_refused(tmp_path, capsys):
    """save_steps above the layer that left save_strategy at no (the toolkit's default, or a recipe's) makes it
    steps, said in one line; no and save_steps in one layer (flags, a --config file) are refused; a higher layer's
    --save_strategy no still turns a recipe's saving off."""

    def strategy(recipe: dict, argv: list[str]) -> str:
        return parse({**RECIPE, **recipe}, "bert", argv).training.save_strategy.value

    assert strategy({}, []) == "no" and capsys.readouterr().err == ""  # the toolkit's default, said nothing
    assert strategy({}, ["--save_steps", "2"]) == "steps"
    assert "save_steps 2 (the command line) without save_strategy steps" in capsys.readouterr().err
    overrides = tmp_path / "o.yaml"
    overrides.write_text("save_steps: 50\n")
    assert strategy({}, ["--config", str(overrides)]) == "steps"
    assert strategy({"save_steps": 100}, []) == "steps"
    assert strategy({"save_strategy": "no"}, ["--save_steps", "2"]) == "steps"  # the flag over the recipe's no
    assert "instead of no from recipe 'bert'" in capsys.readouterr().err.splitlines()[-1]
    assert strategy({"save_strategy": "steps", "save_steps": 100}, ["--save_strategy", "no"]) == "no"
    assert strategy({"save_strategy": "epoch"}, ["--save_steps", "2"]) == "epoch"  # not the default: as given
    with pytest.raises(ConfigError, match="save_strategy no and save_steps 2 are both set in the command line"):
        strategy({}, ["--save_strategy", "no", "--save_steps", "2"])
    overrides.write_text("save_strategy: 'no'\nsave_steps: 50\n")
    with pytest.raises(ConfigError, match=f"both set in --config {overrides}: they conflict"):
        strategy({}, ["--config", str(overrides)])


def test_a_recipes_bf16_runs_in_fp32_on_a_cpu_that_would_emulate_it(monkeypatch, capsys):
    recipe = {**RECIPE, "dtype": "bfloat16", "bf16": True}
    monkeypatch.setattr(parser, "computes_bf16", lambda: False)
    args = parse(recipe, "bert", [], here=True)
    assert (args.model.dtype, args.training.bf16) == ("float32", False)
    assert "has no bf16 kernels" in capsys.readouterr().err
    kept = parse(recipe, "bert", ["--dtype", "bf16", "--bf16", "true"], here=True)  # asked for, on this machine
    assert (kept.model.dtype, kept.training.bf16) == ("bfloat16", True)
    assert "bf16 kernels" not in capsys.readouterr().err
    planned = parse(recipe, "bert", [])  # a plan is for the GPU it names, not for this machine
    assert (planned.model.dtype, planned.training.bf16) == ("bfloat16", True)
    monkeypatch.setattr(parser, "computes_bf16", lambda: True)
    assert parse(recipe, "bert", [], here=True).model.dtype == "bfloat16"


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file() or platform.machine() != "x86_64", reason="x86 Linux")
def test_bf16_kernels_are_the_ones_this_cpu_has():
    """oneDNN's bf16 kernels need AVX512's core (F, BW, VL, DQ) or AVX-NE-CONVERT (AVX2 cores that convert bf16):
    read from the kernel's CPU flags, not from torch."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU computes bf16")
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ("SSE41", "AVX", "AVX2", "AVX2_VNNI")
    assert parser.computes_bf16() == (
        ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags) and not capped
    )  # oneDNN kept below them (ONEDNN_MAX_CPU_ISA=AVX2, a bf16 CPU run as an AVX2 one) has none


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("qwen3_distill", ["--tools", "calculator"], "tools 'calculator' is read only by task grpo, and this run's "
                                                     "task is distill: drop it, or train with --task grpo"),
        ("qwen3_distill", ["--num_generations", "4"], "num_generations 4 is read only by tasks grpo and rloo"),
        ("qwen3_distill", ["--reward_weights", "1,2"], "reward_weights '1,2' is read only by tasks grpo and rloo"),
        ("qwen3_kto", ["--reward_funcs", "accuracy"], "reward_funcs 'accuracy' is read only by tasks grpo and rloo"),
        ("qwen3_kto", ["--tools", "calculator"], "tools 'calculator' is read only by task grpo, and this run's task "
                                                 "is kto"),
        ("qwen3_grpo", ["--desirable_weight", "2"], "desirable_weight 2.0 is read only by task kto, and this run's "
                                                    "task is grpo: drop it, or train with --task kto"),
        ("smollm2_chat", ["--beta", "0.2"], "beta 0.2 is read only by tasks dpo, kto, grpo, rloo and distill"),
    ],
)  # fmt: skip
def test_a_setting_only_other_tasks_read_is_one_line(recipe, flags, message):
    """A setting of PolicyArguments given under a task that does not read it (settings/policy.py's READ_BY) is
    refused as the settings are parsed, not accepted and dropped; at its default it is no one's concern."""
    values = importlib.import_module(recipe).RECIPE
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(values, recipe, flags)
    parse(values, recipe, [flags[0], str(parse_default(flags[0]))])


def parse_default(flag: str):
    from dataclasses import fields

    from toolkit.settings.policy import PolicyArguments

    return next(f.default for f in fields(PolicyArguments) if f.name == flag.removeprefix("--"))


def test_label_smoothing_turns_the_fused_head_off_or_is_one_line_with_it():
    """TRL's fused head scores the plain next-token loss from the labels, which the Trainer takes away to smooth
    them: with --fused_loss asked for, one line; on a GPU's default (the head on), the head off. Before, TRL's fused
    forward failed in a TypeError at the first step."""
    from llama3_fft import RECIPE as LLAMA

    args = parse(LLAMA, "llama3_fft", ["--tiny", "--label_smoothing_factor", "0.1"], tiny_defaults=tiny_layer)
    assert args.model.fused_loss is False
    with pytest.raises(ConfigError, match=r"cannot smooth the labels \(label_smoothing_factor 0.1\): drop one"):
        parse(LLAMA, "llama3_fft", ["--tiny", "--label_smoothing_factor", "0.1", "--fused_loss", "true"],
              tiny_defaults=tiny_layer)  # fmt: skip
