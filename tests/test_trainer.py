"""RecipeTrainer: run header, learning-rate scaling, cost, and the W&B run it writes (read back from disk)."""

from __future__ import annotations

import hashlib
import json

import pytest
from bert import RECIPE as BERT
from conftest import check, launch, rank_reports
from test_strategies import tokenized_rows
from transformers import AutoConfig

from toolkit import planner, train
from toolkit.metrics.cost import CostModel, device_spec
from toolkit.metrics.wandb_run import read_offline_run, redact
from toolkit.settings.arguments import scaled_learning_rate


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
    from toolkit.metrics.memory import GIB
    from toolkit.planner import not_fitting_warning

    assert not_fitting_warning(70 * GIB, 80 * GIB) is None
    assert not_fitting_warning(70 * GIB, 0) is None  # no GPU: nothing to compare with
    message = not_fitting_warning(79 * GIB, 80 * GIB)
    assert "79.0 GiB per device" in message and "python -m toolkit plan" in message


def test_redact_masks_credentials_at_any_depth():
    cleaned = redact({"hub_token": "hf_x", "nested": {"WANDB_API_KEY": "k", "lr": 1}, "list": [{"password": "p"}]})
    assert cleaned == {"hub_token": "<redacted>", "nested": {"WANDB_API_KEY": "<redacted>", "lr": 1},
                       "list": [{"password": "<redacted>"}]}  # fmt: skip


def test_live_metrics_in_the_log_and_the_offline_wandb_run(tmp_path):
    """A 2-process DDP run with gradient accumulation 2 and padded batches, no W&B account: it goes offline by
    itself, and its .wandb file holds exact token counts, MFU and cost by their formulas, the config, the
    summary and the health alerts; no credential anywhere in it."""
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": None, "HF_TOKEN": "hf_envsecret_123", "WANDB_MODE": None,
           "WANDB_DIR": str(tmp_path)}  # fmt: skip
    out = tmp_path / "out"
    # peak 1 TFLOPS per process: far above what a tiny model reaches on CPU, so the MFU alert must fire
    flags = ["--tiny", "--max_steps", "6", "--logging_steps", "2", "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "2", "--peak_tflops", "1", "--cost_overhead", "1.3", "--packing", "false",
             "--report_to", "wandb", "--hub_token", "hf_argsecret_456", "--record_rank_reports", "true",
             "--output_dir", str(out)]  # fmt: skip
    result = check(launch("ddp", "llama3_fft", *flags, cwd=tmp_path, env=env))
    assert "W&B: no API key found, logging offline" in result.stdout
    assert "run summary   completed" in result.stdout and "x overhead 1.3" in result.stdout
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    raw = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert b"hf_argsecret_456" not in raw and b"hf_envsecret_123" not in raw

    run = read_offline_run(run_dir)
    reports = rank_reports(out)
    logged = [{k.removeprefix("train/"): v for k, v in row.items()} for row in run["history"] if "train/loss" in row]
    assert [row["loss"] for row in logged] == pytest.approx(reports[0]["losses"], rel=1e-6)

    # Tokens: exactly the non-padding tokens of the rows both ranks trained on, interval by interval
    # (2 steps x 2 micro-batches x 4 rows = 16 rows per rank per logging interval).
    rows = tokenized_rows("llama3_fft")
    length = {hashlib.sha1(json.dumps(ids).encode()).hexdigest(): len(ids) for ids in rows}
    config = AutoConfig.from_pretrained(out)
    shape = planner.Shape.of(planner.meta_model(config, "sft"), config)
    for i, row in enumerate(logged):
        seconds = row["step_seconds"] * 2
        tokens = sum(length[h] for r in reports for h in r["rows"][16 * i : 16 * (i + 1)])
        assert row["tokens_per_second"] * seconds == pytest.approx(tokens, rel=1e-6)
        assert row["tokens_per_second_per_device"] == pytest.approx(row["tokens_per_second"] / 2)
        assert row["samples_per_second"] * seconds == pytest.approx(32, rel=1e-6)
        # MFU = FLOPs per token at the mean row length x tokens/s / (2 devices x 1e12 FLOP/s)
        flops = planner.training_flops_per_token(shape, tokens / 32)
        assert row["mfu"] == pytest.approx(flops * row["tokens_per_second"] / 2e12, rel=1e-6)
        assert 0 <= row["data_wait_share"] < 1 and row["peak_memory_gib"] > 0.1
        # cost = vCPU-hours x price x overhead; the projection extends this pace to the 6 steps
        assert row["cost_usd"] == pytest.approx(row["vcpu_hours"] * device_spec("cpu")["on_demand"] * 1.3)
        assert row["usd_per_million_tokens"] == pytest.approx(row["cost_usd"] / row["num_input_tokens_seen"] * 1e6)
        assert row["cost_projected_usd"] >= row["cost_usd"]
    assert sum(length[h] for r in reports for h in r["rows"]) == reports[0]["tokens_seen"]

    summary = {k.removeprefix("summary/"): v for k, v in run["summary"].items() if k.startswith("summary/")}
    on_disk = json.loads((out / "run_summary.json").read_text())["summary"]
    assert summary == pytest.approx(on_disk) and summary["tokens"] == reports[0]["tokens_seen"]
    assert summary["status"] == "completed" and summary["strategy"] == "MULTI_CPU, none (replicated, DDP)"
    assert summary["cost_usd"] >= logged[-1]["cost_usd"] and summary["train_loss"] > 0
    assert [a["title"] for a in run["alerts"]] == ["toolkit health: mfu"]  # once, not per log line
    assert run["config"]["toolkit"]["recipe"] == "llama3_fft"
    assert run["config"]["strategy"]["distributed_type"] == "MULTI_CPU"
    assert run["config"]["pricing"]["overhead"] == 1.3
    assert run["config"]["memory_plan"]["device"]["parameters"] == 4 * run["config"]["parameters"]["total"]
    assert set(run["tags"]) >= {"llama3_fft", "MULTI_CPU", "world-2", "cpu"}


def test_redact_argv():
    from toolkit.metrics.wandb_run import redact_argv

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


def test_health_warnings_are_one_line_each_and_skip_the_warm_up(capsys):
    from toolkit.metrics.health import Health

    health = Health(expected_mfu=0.4, is_main=True)
    slow = {"mfu": 0.05, "data_wait_share": 0.5}
    health.check(slow, memory_fraction=0.5)  # first interval: start-up, not judged
    assert capsys.readouterr().err == ""
    for _ in range(3):
        health.check(slow, memory_fraction=0.97)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and set(health.raised) == {"mfu", "data", "memory"}
    assert any("50% of the step is spent waiting for data" in line for line in lines)
    assert any("MFU 5.0%, below half of the 40%" in line for line in lines)
    health.check({"mfu": 0.3, "data_wait_share": 0.1}, memory_fraction=0.5)  # healthy: nothing more
    assert capsys.readouterr().err == ""


def test_tracking_reads_the_device_only_when_it_logs_or_saves(tmp_path, monkeypatch):
    """On a GPU every tensor read on the host (item, bool, int, float, tolist) waits for the device, and every
    gather is a collective. RecipeTrainer, with all its tracking (tokens counted exactly), health checks, the NaN
    check and the budget guard, reads no tensor of its own and gathers nothing in an optimizer step that neither
    logs nor saves, 4 micro-batches accumulated: what it reads is the model's own (BERT's mask check, one per
    micro-batch), which a plain transformers.Trainer with its real defaults reads too, beside two per micro-batch
    of its NaN filter."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from toolkit.models import tiny
    from toolkit.training.trainer import RecipeTrainer

    reads = [0]

    def counting(original):
        def counted(self, *args, **kwargs):
            reads[0] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    monkeypatch.setattr(Accelerator, "gather", counting(Accelerator.gather))

    class ReadsPerStep(TrainerCallback):  # between the ends of steps 2 and 7: no log or save step in between
        def __init__(self):
            self.marks = []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (2, 7):
                self.marks.append(reads[0])

        def value(self) -> float:
            return (self.marks[1] - self.marks[0]) / 5

    recipe_counter, plain_counter = ReadsPerStep(), ReadsPerStep()
    init = RecipeTrainer.__init__

    def init_with_counter(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(recipe_counter)

    monkeypatch.setattr(RecipeTrainer, "__init__", init_with_counter)
    flags = ["--tiny", "--report_to", "none", "--max_steps", "8", "--logging_steps", "1000",
             "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
             "--train_sampling_strategy", "random", "--output_dir", str(tmp_path / "recipe")]  # fmt: skip
    recipe = train(BERT, flags, "bert").trainer

    model = AutoModelForSequenceClassification.from_pretrained(
        tiny.tiny_checkpoint("google-bert/bert-base-cased", "classification"), num_labels=2
    )
    plain_args = TrainingArguments(output_dir=str(tmp_path / "plain"), per_device_train_batch_size=2, max_steps=8,
                                   gradient_accumulation_steps=4, logging_steps=1000, report_to="none", use_cpu=True,
                                   save_strategy="no")  # fmt: skip
    Trainer(model=model, args=plain_args, train_dataset=recipe.train_dataset, data_collator=recipe.data_collator,
            callbacks=[plain_counter]).train()  # fmt: skip
    model_reads = 4  # BertModel's padding_mask.all(), per micro-batch
    assert plain_counter.value() == model_reads + 2 * 4  # the counter sees the Trainer's isnan and isinf
    assert recipe_counter.value() == model_reads, recipe_counter.value()


def test_figures_after_a_resume_count_only_the_resumed_segment(tmp_path):
    """A 10-step run saved at step 10 and resumed to 20: the first logging interval after resuming, the segment's
    summary and the budget guard's cost per step count steps 11-20 and their tokens, not the 10 before."""
    from test_strategies import tokenized_rows

    out = tmp_path / "run"
    flags = ["--tiny", "--report_to", "none", "--logging_steps", "5", "--save_strategy", "steps", "--save_steps",
             "10", "--record_rank_reports", "true", "--output_dir", str(out)]  # fmt: skip
    train(BERT, [*flags, "--max_steps", "10"], "bert")
    resumed = train(BERT, [*flags, "--max_steps", "20", "--resume", "auto"], "bert").trainer

    length = {hashlib.sha1(json.dumps(ids).encode()).hexdigest(): len(ids) for ids in tokenized_rows("bert")}
    rows = rank_reports(out)[0]["rows"]  # the resumed segment's: 10 steps of 8
    assert len(rows) == 80
    (at_15,) = [line for line in resumed.state.log_history if line.get("step") == 15 and "loss" in line]
    first_five = sum(length[h] for h in rows[:40])
    assert at_15["tokens_per_second"] * at_15["step_seconds"] * 5 == pytest.approx(first_five, rel=1e-6)
    assert at_15["samples_per_second"] * at_15["step_seconds"] * 5 == pytest.approx(40, rel=1e-6)
    summary = json.loads((out / "run_summary.json").read_text())["summary"]
    segment = sum(length[h] for h in rows)
    assert summary["tokens_per_second"] * summary["training_seconds"] == pytest.approx(segment, rel=1e-6)
    assert summary["tokens"] == resumed.state.num_input_tokens_seen > segment  # the run's, resumes included
    tracker = resumed.tracker
    assert tracker.step_usd(resumed.state) * 10 == pytest.approx(tracker.cost.usd(tracker.elapsed), rel=1e-2)


def test_evaluation_time_is_not_training_time(tmp_path, monkeypatch):
    """An evaluation before the first step (eval_on_start) made to take 3 s: the first interval's tokens/s and step
    time are training's alone; the bill still counts the evaluation. W&B disabled (WANDB_MODE): the summary names
    no W&B run (wandb's stand-in run has an id and an entity that name nothing)."""
    import time

    from transformers import Trainer

    evaluate = Trainer.evaluate

    def slow(self, *args, **kwargs):
        time.sleep(3)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", slow)
    printed = []  # the seconds the cost line is printed for
    cost_line = CostModel.summary
    monkeypatch.setattr(CostModel, "summary", lambda self, seconds, *a: printed.append(seconds) or
                        cost_line(self, seconds, *a))  # fmt: skip
    monkeypatch.setenv("WANDB_MODE", "disabled")
    flags = ["--tiny", "--report_to", "wandb", "--max_steps", "4", "--logging_steps", "2", "--eval_on_start", "true",
             "--eval_strategy", "steps", "--eval_steps", "1000", "--eval_fraction", "0.1",
             "--output_dir", str(tmp_path)]  # fmt: skip
    trainer = train(BERT, flags, "bert").trainer
    first = [line for line in trainer.state.log_history if "loss" in line][0]
    assert first["step"] == 2 and first["step_seconds"] * 2 < 1.5  # 3 s of evaluation left out: tiny steps
    summary = json.loads((tmp_path / "run_summary.json").read_text())["summary"]
    assert summary["training_seconds"] < summary["wall_seconds"] - 3 * 2  # the start and final evaluations billed
    assert not [key for key in summary if key.startswith("wandb")]
    assert printed == [summary["wall_seconds"]]  # the cost line's dollars are the summary's (a later clock read: not)
