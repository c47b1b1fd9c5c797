"""Tensor parallelism (accelerate_configs/tp.yaml): transformers shards the model by its own TP plan as it loads,
accelerate hands both ranks the same rows; on CPU over gloo, for real."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check, launch, rank_reports, run_cmd
from safetensors.torch import load_file
from transformers import AutoConfig, BertConfig, LlamaConfig, TrainingArguments

from toolkit.errors import ConfigError
from toolkit.models import tiny
from toolkit.models.loading import check_tensor_parallel
from toolkit.settings.parser import parse

# Checkpoints every 2 steps: under tp.yaml, of the weights only by default (transformers cannot save the
# optimizer of a model it sharded at load); the 1-process run is told the same.
FLAGS = ["--tiny", "--report_to", "none", "--max_steps", "4", "--logging_steps", "1", "--save_strategy", "steps",
         "--save_steps", "2", "--record_rank_reports", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def llama_two_kv_heads(tmp_path_factory) -> Path:
    """A user's small Llama whose 4 attention heads and 2 key/value heads split over 2 ranks (the recipe's tiny
    Llama 3 keeps Meta's 4:1 grouping, one key/value head, which no TP size above 1 divides)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("llama-kv2")
    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_tensor_parallel_matches_one_process(llama_two_kv_heads, tmp_path):
    """2 ranks, tp=2 (one data-parallel replica) against 1 process with the same batch: both ranks train on the
    1-process run's rows, with its losses, tokens counted once, each rank holding half of every split weight
    (the norms stay whole: named below) and its optimizer state, as the run's own plan says; checkpoints and the
    export are the whole model."""
    model = ["--model_name_or_path", str(llama_two_kv_heads)]
    one, two = tmp_path / "one", tmp_path / "two"
    check(run_cmd([sys.executable, str(ROOT / "recipes" / "llama3_fft.py"), *FLAGS, *model, "--save_only_model",
                   "true", "--output_dir", str(one)], cwd=tmp_path))  # fmt: skip
    result = check(launch("tp", "llama3_fft", *FLAGS, *model, "--output_dir", str(two), cwd=tmp_path))
    assert "sharding      tensor parallel, each layer split over 2 ranks" in result.stdout
    assert "mesh          tp=2" in result.stdout
    assert "8 per device x 1 accumulation x 1 data-parallel replicas = 8 global" in result.stdout

    (reference,) = rank_reports(one)
    ranks = rank_reports(two)
    for rank in ranks:
        assert rank["rows"] == reference["rows"]  # the same rows, in the same order, on both ranks
        assert rank["losses"] == pytest.approx(reference["losses"], rel=2e-3, abs=1e-4)
    summaries = [json.loads((d / "run_summary.json").read_text()) for d in (one, two)]
    assert summaries[1]["summary"]["tokens"] == summaries[0]["summary"]["tokens"]  # once, not once per rank

    weights = load_file(one / "model.safetensors")
    whole = {name for name in weights if "norm" in name}  # RMSNorm weights: replicated on every rank
    replicated = sum(weights[n].nbytes for n in whole)
    split = sum(t.nbytes for n, t in weights.items() if n not in whole)
    for rank in ranks:
        assert rank["param_bytes"] == split // 2 + replicated
        assert rank["optimizer_state_bytes"] == 2 * rank["param_bytes"]  # AdamW's two moments of its slice
    planned = summaries[1]["config"]["memory_plan"]["device"]["parameters"]
    assert planned == (split + replicated) // 2  # the plan halves every weight: off by half the norms
    assert abs(ranks[0]["param_bytes"] - planned) == replicated // 2

    assert not list((two / "checkpoint-2").glob("optimizer*"))  # weights only, by the tensor-parallel default
    for folder in (two, two / "checkpoint-2"):  # whole tensors, as from a 1-process run
        saved = load_file(folder / "model.safetensors")
        assert {n: t.shape for n, t in saved.items()} == {n: t.shape for n, t in weights.items()}
    exported = load_file(two / "model.safetensors")
    for name, value in weights.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-3, atol=2e-4, msg=name)
    assert "distributed_config" not in json.loads((two / "config.json").read_text())  # loads anywhere


@pytest.mark.parametrize(
    ("config", "mesh", "world", "flags", "message"),
    [
        (LlamaConfig(num_attention_heads=32, num_key_value_heads=8), {"tp": 3}, 3, ["--save_strategy", "no"],
         "tp_size 3 does not divide the model's 32 attention heads"),
        (LlamaConfig(num_attention_heads=32, num_key_value_heads=2), {"tp": 4}, 4, ["--save_strategy", "no"],
         "tp_size 4 does not divide the model's 2 key/value heads"),
        (BertConfig(), {"tp": 2}, 2, ["--save_strategy", "no"], "bert has no tensor-parallel plan in transformers"),
        (LlamaConfig(), {"dp_shard": 2, "tp": 2}, 2, ["--save_strategy", "no"],
         "the mesh dp_shard=2 x tp=2 covers 4 processes and the launch has 2: set --num_processes 4"),
        (LlamaConfig(), {"tp": 2}, 2, ["--save_only_model", "false"], "leave --save_only_model at true"),
    ],
)  # fmt: skip
def test_tensor_parallel_refusals_name_the_fix(config, mesh, world, flags, message):
    """Before any weight loads: what transformers or accelerate would fail on later, deep in a traceback."""
    from llama3_fft import RECIPE

    args = parse(RECIPE, "llama3_fft", ["--output_dir", "/tmp/unused", *flags])
    assert isinstance(args.training, TrainingArguments)
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(config, mesh, world, args.training.save_only_model)
    check_tensor_parallel(AutoConfig.for_model("llama"), {}, world, False)  # no mesh: nothing to check
