"""RecipeTrainer: run header, learning-rate scaling, cost, and the W&B run it writes (read back from disk)."""

from __future__ import annotations

import json
import sys

import pytest
from bert import RECIPE as BERT
from conftest import ROOT, check, run_cmd

from toolkit import train
from toolkit.trainer import scaled_learning_rate
from toolkit.wandb_run import read_offline_run, redact


def test_linear_lr_scaling_with_warmup(tmp_path, capsys):
    argv = ["--tiny", "--max_steps", "4", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
            "--lr_reference_batch_size", "4", "--report_to", "none", "--output_dir", str(tmp_path)]  # fmt: skip
    result = train(BERT, argv, name="bert")
    # global batch 16 = 4x the reference: 4x the tiny rate of 2e-3
    assert result.trainer.args.learning_rate == pytest.approx(scaled_learning_rate(2e-3, 16, 4)) == 8e-3
    assert result.trainer.args.warmup_steps == 0.05
    out = capsys.readouterr().out
    assert "learning rate 0.008 (scaled from 0.002 at batch 4)" in out
    assert "8 per device x 2 accumulation x 1 processes = 16 global" in out


def test_cost_in_logs_is_wall_time_times_price(tmp_path):
    result = train(BERT, ["--tiny", "--max_steps", "6", "--report_to", "none", "--output_dir", str(tmp_path)], "bert")
    trainer = result.trainer
    last = [e for e in trainer.state.log_history if "cost_usd" in e][-1]
    hours = last["vcpu_hours"] / trainer.cost.units
    assert last["cost_usd"] == pytest.approx(last["vcpu_hours"] * trainer.cost.usd_per_unit_hour, rel=1e-3)
    # the billed wall time covers the Trainer's own measured training time, and not much more
    assert result.metrics["train_runtime"] <= hours * 3600 <= result.metrics["train_runtime"] + 5
    train_logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all(e["tokens_per_second"] > 0 for e in train_logs)


def test_memory_plan_at_start_equals_what_the_run_holds(tmp_path, capsys):
    """The plan printed (and sent to W&B) before training is the planner's; its model states are what the run
    then really holds (one process, fp32, AdamW: parameters and optimizer states to the byte)."""
    result = train(BERT, ["--tiny", "--max_steps", "2", "--report_to", "none", "--output_dir", str(tmp_path)], "bert")
    trainer = result.trainer
    held, plan = trainer.held_bytes(), trainer.memory_plan
    assert plan.device["parameters"] == held["param_bytes"] > 0
    assert plan.device["optimizer_states"] == held["optimizer_state_bytes"] == 2 * held["param_bytes"]
    assert plan.device["cuda_context"] == 0  # a CPU run
    assert "memory plan" in capsys.readouterr().out
    assert trainer.run_config()["memory_plan"]["device_total"] == plan.device_total


def test_not_fitting_warning_names_the_planner():
    from toolkit.planner import GIB, not_fitting_warning

    assert not_fitting_warning(70 * GIB, 80 * GIB) is None
    assert not_fitting_warning(70 * GIB, 0) is None  # no GPU: nothing to compare with
    message = not_fitting_warning(79 * GIB, 80 * GIB)
    assert "79.0 GiB per device" in message and "python -m toolkit plan" in message


def test_redact_masks_credentials_at_any_depth():
    cleaned = redact({"hub_token": "hf_x", "nested": {"WANDB_API_KEY": "k", "lr": 1}, "list": [{"password": "p"}]})
    assert cleaned == {"hub_token": "<redacted>", "nested": {"WANDB_API_KEY": "<redacted>", "lr": 1},
                       "list": [{"password": "<redacted>"}]}  # fmt: skip


def test_wandb_offline_run_without_an_account(tmp_path):
    """No API key and no WANDB_MODE: the run goes offline by itself; its file holds what the Trainer logged."""
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": None, "HF_TOKEN": "hf_envsecret_123", "WANDB_MODE": None,
           "WANDB_DIR": str(tmp_path)}  # fmt: skip
    argv = [sys.executable, str(ROOT / "recipes" / "llama3_fft.py"), "--tiny", "--max_steps", "6", "--report_to",
            "wandb", "--hub_token", "hf_argsecret_456", "--record_rank_reports", "true",
            "--output_dir", str(tmp_path / "out")]  # fmt: skip
    result = check(run_cmd(argv, cwd=tmp_path, env=env))
    assert "W&B: no API key found, logging offline" in result.stdout
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    raw = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert b"hf_argsecret_456" not in raw and b"hf_envsecret_123" not in raw

    run = read_offline_run(run_dir)
    trainer_losses = json.loads((tmp_path / "out" / "rank_reports" / "rank0.json").read_text())["losses"]
    logged = [row["train/loss"] for row in run["history"] if "train/loss" in row]
    assert logged == pytest.approx(trainer_losses, rel=1e-6)
    assert [row["train/tokens_per_second"] > 0 for row in run["history"] if "train/loss" in row] == [True] * 6
    assert run["config"]["toolkit"]["recipe"] == "llama3_fft"
    assert run["config"]["strategy"]["distributed_type"] == "NO"
    assert run["config"]["parameters"]["trainable"] > 0
    assert run["config"]["memory_plan"]["device"]["parameters"] == 4 * run["config"]["parameters"]["total"]
    assert set(run["tags"]) >= {"llama3_fft", "NO", "world-1", "cpu"}


def test_redact_argv():
    from toolkit.wandb_run import redact_argv

    argv = ["x.py", "--hub_token", "hf_a", "--lr", "1", "--wandb_api_key=k", "--learning_rate", "2"]
    redact_argv(argv)
    assert argv == [
        "x.py",
        "--hub_token",
        "<redacted>",
        "--lr",
        "1",
        "--wandb_api_key=<redacted>",
        "--learning_rate",
        "2",
    ]


def test_unknown_gpu_type_fails_before_loading(tmp_path, capsys):
    from toolkit import run

    with pytest.raises(SystemExit) as exit_info:
        run(BERT, ["--tiny", "--gpu_type", "B300", "--output_dir", str(tmp_path / "run")], name="bert")
    assert exit_info.value.code == 2
    assert "Unknown GPU type 'B300'. Known: RTX-3090" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
