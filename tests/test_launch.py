"""Real 2-process launches over gloo through `accelerate launch`: the recipes train as one distributed job."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys

import pytest
import torch
from conftest import BIN, ROOT, check, launch, rank_reports, run_cmd
from safetensors.torch import load_file

from toolkit import tiny
from toolkit.arguments import DataArguments
from toolkit.data import load_raw, prepare

pytestmark = pytest.mark.launch

RECIPE_TASK = {"bert": "classification", "llama3_fft": "sft", "llama3_lora": "sft"}


def tokenized_rows(recipe: str) -> list[list[int]]:
    """Every tokenized training row, computed here independently of the run."""
    task = RECIPE_TASK[recipe]
    model_name = "google-bert/bert-base-cased" if recipe == "bert" else "meta-llama/Meta-Llama-3-8B"
    tokenizer = tiny.tiny_tokenizer(model_name, task)
    values = {k: v for k, v in tiny.tiny_training_defaults(task).items() if k in DataArguments.__dataclass_fields__}
    args = DataArguments(task=task, **values)
    data = prepare(load_raw(args), tokenizer, args, lambda desc: contextlib.nullcontext())
    return data.train["input_ids"]


def row_hashes(rows: list[list[int]]) -> set[str]:
    return {hashlib.sha1(json.dumps(ids).encode()).hexdigest() for ids in rows}


ONE_EPOCH = ("--tiny", "--record_rank_reports", "true", "--max_steps", "-1", "--num_train_epochs", "1")


@pytest.mark.parametrize("recipe, accumulation", [("bert", 1), ("llama3_fft", 2), ("llama3_lora", 1)])
def test_ddp_two_processes(recipe, accumulation, tmp_path):
    out = tmp_path / "run"
    flags = (*ONE_EPOCH, "--gradient_accumulation_steps", str(accumulation), "--report_to", "none")
    result = check(launch("ddp", recipe, *flags, "--output_dir", str(out), cwd=tmp_path))
    reports = rank_reports(out)
    assert [r["process_index"] for r in reports] == [0, 1]
    for r in reports:
        assert r["strategy"]["distributed_type"] == "MULTI_CPU"
        assert r["strategy"]["num_processes"] == 2
        assert r["strategy"]["backend"] == "gloo"
    # One epoch: the ranks saw disjoint halves that together are the whole data set.
    rows = tokenized_rows(recipe)
    rows0, rows1 = set(reports[0]["rows"]), set(reports[1]["rows"])
    assert not rows0 & rows1
    assert rows0 | rows1 == row_hashes(rows)
    # Tokens counted: exactly the non-padding tokens of every row, over both ranks and all micro-batches.
    assert reports[0]["tokens_seen"] == reports[1]["tokens_seen"] == sum(len(r) for r in rows)
    # Replicas stayed identical, and they learned.
    assert reports[0]["weights_sha256"] == reports[1]["weights_sha256"]
    losses = reports[0]["losses"]
    assert sum(losses[-5:]) / 5 < 0.97 * sum(losses[:5]) / 5, losses  # LoRA on a random base: ~5%
    assert "MULTI_CPU, 2 process(es)" in result.stdout
    assert f"8 per device x {accumulation} accumulation x 2 processes = {16 * accumulation} global" in result.stdout
    assert "cost: $" in result.stdout

    # The same global batch in one process gives the same losses (classification included: left alone, the
    # Trainer scales a classification loss by the number of processes).
    single = tmp_path / "single"
    script = str(ROOT / "recipes" / f"{recipe}.py")
    check(
        run_cmd(
            [sys.executable, script, *flags, "--output_dir", str(single), "--per_device_train_batch_size", "16"],
            cwd=tmp_path,
        )
    )
    reference = rank_reports(single)[0]
    assert reference["strategy"]["num_processes"] == 1
    assert losses == pytest.approx(reference["losses"], rel=2e-3, abs=1e-4)


def test_lora_adapter_reloads_with_peft(tmp_path):
    """The tiny LoRA run saves an adapter that peft loads by itself (its tiny base is saved beside it)."""
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "run"
    check(launch("ddp", "llama3_lora", "--tiny", "--output_dir", str(out), "--report_to", "none", cwd=tmp_path))
    saved = load_file(out / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert not (out / "model.safetensors").exists()  # the adapter only, not a copy of the base

    model = AutoPeftModelForCausalLM.from_pretrained(out)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    lora_b = [k for k in saved if "lora_B" in k]
    assert lora_b and any(saved[k].abs().sum() > 0 for k in lora_b)  # B starts at zero: it trained
    for key, value in saved.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "").endswith(key.split("base_model.model.")[-1])]
        assert len(match) == 1 and torch.equal(match[0], value), key


def test_collapsed_launch_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process: the toolkit refuses to train."""
    result = launch("", "bert", "--tiny", "--output_dir", str(tmp_path / "run"), cwd=tmp_path, launcher_args=("--cpu",))
    assert result.returncode != 0
    assert "asked for several processes but started only this one" in result.stderr
    assert "accelerate_configs/ddp.yaml" in result.stderr
    assert not (tmp_path / "run").exists()


def test_fsdp_fallback_to_ddp_is_refused(tmp_path):
    """On CPU accelerate quietly turns an FSDP config into DDP: refused before the first step."""
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        (ROOT / "accelerate_configs" / "ddp.yaml")
        .read_text()
        .replace("distributed_type: MULTI_GPU", "distributed_type: FSDP")
        + "fsdp_config:\n  fsdp_version: 2\n  fsdp_cpu_ram_efficient_loading: false\n  fsdp_sync_module_states: false\n"
    )
    result = launch(str(config.with_suffix("")), "bert", "--tiny", "--output_dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode != 0, result.stderr[-3000:]
    assert "The config asks for FSDP but accelerate set up MULTI_CPU" in result.stderr
    assert not list((tmp_path / "run").glob("*.safetensors"))


def test_make_finetune_offline_fails_fast_then_trains_tiny(tmp_path):
    # An unreachable endpoint, without HF_HUB_OFFLINE: the reachability probe must catch it, not 30 s of retries.
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    result = run_cmd(
        ["make", "-s", "finetune", "MODEL=bert", f"BIN={BIN}", f"ARGS=--output_dir {tmp_path / 'hub'}"],
        cwd=ROOT,
        env=env,
    )
    assert result.returncode != 0
    ours = result.stderr.split("Traceback")[0]  # accelerate's launcher adds its own traceback after ours
    for way in ("--model_name_or_path", "--tiny", "make demo", "google-bert/bert-base-cased"):
        assert way in ours
    assert f'File "{ROOT / "toolkit"}' not in result.stderr  # no traceback through our code

    out = tmp_path / "tiny"
    result = check(
        run_cmd(
            [
                "make",
                "-s",
                "finetune",
                "MODEL=bert",
                f"BIN={BIN}",
                f"ARGS=--tiny --max_steps 4 --report_to none --output_dir {out}",
            ],
            cwd=ROOT,
            env=env,
        )
    )
    assert "saved to" in result.stdout
    assert (out / "model.safetensors").exists()
