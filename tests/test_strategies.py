"""The strategy matrix: every accelerate config x every recipe, launched for real on CPU (2 processes, gloo).

Each launch is checked for what really happened, not just its exit code: the strategy in effect, the bytes of
parameters and optimizer state each rank holds, disjoint data across ranks, the tokens counted, the losses
against a 1-process run with the same global batch, and the exported weights against that run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys

import pytest
import torch
from conftest import ROOT, check, launch, rank_reports, run_cmd

from toolkit import tiny
from toolkit.arguments import DataArguments
from toolkit.data import load_raw, prepare

pytestmark = pytest.mark.launch

# config -> (distributed type, sharding label, parameters sharded?, optimizer state sharded?, processes)
STRATEGIES = {
    "single_gpu": ("NO", "none (single process)", False, False, 1),
    "ddp": ("MULTI_CPU", "none (replicated, DDP)", False, False, 2),
    "zero1": ("DEEPSPEED", "ZeRO-1", False, True, 2),
    "zero2": ("DEEPSPEED", "ZeRO-2", False, True, 2),
    "zero2_offload": ("DEEPSPEED", "ZeRO-2 offload_optimizer=cpu", False, True, 2),
    "zero3": ("DEEPSPEED", "ZeRO-3", True, True, 2),
    "zero3_offload": ("DEEPSPEED", "ZeRO-3 offload_optimizer=cpu offload_param=cpu", True, True, 2),
    "fsdp2": ("FSDP", "FSDP2 FULL_SHARD", True, True, 2),
    "fsdp_shard_grad_op": ("FSDP", "FSDP2 SHARD_GRAD_OP", True, True, 2),
    "fsdp_offload": ("FSDP", "FSDP2 FULL_SHARD", True, True, 2),  # on CPU: runs without offload, and says so
}
RECIPES = {"bert": ("classification", 1), "llama3_fft": ("sft", 2), "llama3_lora": ("sft", 1)}  # task, accumulation
ONE_EPOCH = ("--tiny", "--record_rank_reports", "true", "--max_steps", "-1", "--num_train_epochs", "1",
             "--report_to", "none")  # fmt: skip


def tokenized_rows(recipe: str) -> list[list[int]]:
    """Every tokenized training row, computed here independently of the runs."""
    task = RECIPES[recipe][0]
    model_name = "google-bert/bert-base-cased" if recipe == "bert" else "meta-llama/Meta-Llama-3-8B"
    tokenizer = tiny.tiny_tokenizer(model_name, task)
    defaults = tiny.tiny_training_defaults(task, model_name)
    values = {k: v for k, v in defaults.items() if k in DataArguments.__dataclass_fields__}
    args = DataArguments(task=task, **values)
    return prepare(load_raw(args), tokenizer, args, lambda desc: contextlib.nullcontext()).train["input_ids"]


def row_hashes(rows) -> set[str]:
    return {hashlib.sha1(json.dumps(ids).encode()).hexdigest() for ids in rows}


def exported_weights(folder, recipe: str) -> dict[str, torch.Tensor]:
    """The weights a user gets back: the exported folder loaded with from_pretrained (peft's for adapters)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    loader = {"bert": AutoModelForSequenceClassification, "llama3_fft": AutoModelForCausalLM,
              "llama3_lora": AutoPeftModelForCausalLM}[recipe]  # fmt: skip
    return loader.from_pretrained(folder).state_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain 1-process run per recipe, with the matrix's global batch (2 x 8 per device)."""
    runs = {}

    def get(recipe):
        if recipe not in runs:
            out = tmp_path_factory.mktemp(f"reference-{recipe}")
            accumulation = str(RECIPES[recipe][1])
            check(run_cmd([sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), *ONE_EPOCH, "--output_dir",
                           str(out), "--per_device_train_batch_size", "16", "--gradient_accumulation_steps",
                           accumulation], cwd=out))  # fmt: skip
            runs[recipe] = (rank_reports(out)[0], exported_weights(out, recipe))
        return runs[recipe]

    return get


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("config", list(STRATEGIES))
def test_strategy(config, recipe, reference, tmp_path):
    kind, sharding, params_sharded, optim_sharded, processes = STRATEGIES[config]
    accumulation = RECIPES[recipe][1]
    per_device = 16 // processes
    out = tmp_path / "run"
    flags = [*ONE_EPOCH, "--gradient_accumulation_steps", str(accumulation),
             "--per_device_train_batch_size", str(per_device), "--output_dir", str(out)]  # fmt: skip
    result = check(launch(config, recipe, *flags, cwd=tmp_path, num_processes=processes))
    reports = rank_reports(out)
    ref_report, ref_weights = reference(recipe)

    # The strategy the config names is the one in effect.
    assert [r["process_index"] for r in reports] == list(range(processes))
    for r in reports:
        assert r["strategy"]["distributed_type"] == kind
        assert r["strategy"]["num_processes"] == processes
        assert r["strategy"]["sharding"] == sharding
    assert f"sharding      {sharding}\n" in result.stdout
    offload_warning = "fsdp_offload_params needs an accelerator: on CPU running the same FSDP config without offload"
    assert (offload_warning in result.stderr) == (config == "fsdp_offload")

    # What each rank holds: 1/2 of the reference's bytes where sharded, all of them where replicated.
    for r in reports:
        for key, sharded in (("param_bytes", params_sharded), ("optimizer_state_bytes", optim_sharded)):
            share = r[key] / ref_report[key]
            if sharded and processes > 1:
                assert 0.45 <= share <= 0.6, (key, share)
            else:
                assert share == 1.0, (key, share)

    # Data: disjoint across ranks, together the whole set; tokens counted exactly over ranks and micro-batches.
    rows = tokenized_rows(recipe)
    seen = [set(r["rows"]) for r in reports]
    assert not set.intersection(*seen) or processes == 1
    assert set.union(*seen) == row_hashes(rows)
    assert all(r["tokens_seen"] == sum(len(x) for x in rows) for r in reports)

    # Same answer as one process: the loss trajectory, and the exported, consolidated weights.
    assert reports[0]["losses"] == pytest.approx(ref_report["losses"], rel=2e-3, abs=1e-4)
    weights = exported_weights(out, recipe)
    assert weights.keys() == ref_weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value.float(), ref_weights[name].float(), rtol=1e-3, atol=2e-4, msg=name)
    if not params_sharded:
        assert len({r["weights_sha256"] for r in reports}) == 1  # replicas identical
