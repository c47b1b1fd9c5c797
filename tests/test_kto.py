"""Preference tuning from labelled completions (task kto) on TRL's KTOTrainer with the toolkit's parts: the tiny
labelled completions are learnt (desirable above undesirable), `toolkit eval` scores both models on the held-out
ones, a preempted run resumes bit-identically, 2 processes under DDP and ZeRO-3 train as one (the KL estimate's
mismatched rows paired as one process pairs them), and bad data or settings are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import check, launch, logged, preempt_at, rank_reports, reference_run
from qwen3_kto import RECIPE as KTO
from safetensors.torch import load_file

from toolkit import run, train
from toolkit.errors import ConfigError, DataError
from toolkit.models.tiny_data import labelled_rows
from toolkit.results.evaluation import evaluate_run
from toolkit.results.record import RunRecord

NAME = "qwen3_kto"


def kto_flags(out: Path, steps: int = 6, *extra: str) -> list[str]:
    return ["--tiny", "--max_steps", str(steps), "--record_rank_reports", "true", "--report_to", "none",
            "--output_dir", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kto") / "one"
    train(KTO, kto_flags(out, 6, "--eval_fraction", "0.05", "--save_strategy", "steps", "--save_steps", "3"), NAME)
    return out


def test_kto_learns_labelled_completions(one_process):
    """The tiny rows (a right sum stated, desirable; a wrong one hedged, not), one completion a prompt: at the first
    step the policy is the reference, so every row's loss is 1 - sigmoid(0) = 0.5; then the desirable completions'
    reward (beta x log-ratio) rises above the undesirable ones', and the held-out loss is below 0.5."""
    losses, margins = logged(one_process, "loss"), logged(one_process, "rewards/margins")
    assert losses[0] == pytest.approx(0.5, abs=1e-6) and margins[0] == 0
    assert 0 < margins[1] < margins[-1] and margins[-1] > 0.3 and losses[-1] < 0.47, margins
    assert logged(one_process, "eval_loss")[-1] < 0.5
    record = RunRecord.read(one_process)
    assert record.task == "kto" and record.settings["beta"] == 0.1 and record.settings["loss_type"] == "kto"
    assert record.settings["desirable_weight"] == record.settings["undesirable_weight"] == 1
    summary = json.loads((one_process / "run_summary.json").read_text())["summary"]
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert (one_process / "model.safetensors").is_file() and (one_process / "README.md").is_file()


def test_eval_scores_both_models_likelihoods_by_label(one_process):
    """`toolkit eval`: each model's mean per-token log-probability of the held-out desirable and undesirable
    completions; the tuned model widens the gap between them."""
    result = evaluate_run(one_process)
    metrics = {row["metric"]: row for row in result["results"]}
    assert result["tasks"] == ["held-out"] and set(metrics) == {"desirable_logp", "undesirable_logp", "gap"}
    for which in ("base", "tuned"):
        figures = {name: row[which] for name, row in metrics.items()}
        assert figures["desirable_logp"] < 0 and figures["undesirable_logp"] < 0
        assert figures["gap"] == pytest.approx(figures["desirable_logp"] - figures["undesirable_logp"])
    assert metrics["gap"]["tuned"] > metrics["gap"]["base"] + 0.05


def test_preempted_kto_run_resumes_bit_identically(one_process, tmp_path, monkeypatch):
    from toolkit.training.stopping import PREEMPTED

    preempt_at(monkeypatch, 3)
    out = tmp_path / "run"
    flags = kto_flags(out, 6, "--eval_fraction", "0.05", "--save_strategy", "steps", "--save_steps", "3")
    with pytest.raises(SystemExit) as exit_info:
        run(KTO, flags, NAME)
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED
    train(KTO, [*flags, "--resume", "auto"], NAME)
    full, resumed = rank_reports(one_process)[0], rank_reports(out)[0]
    assert resumed["losses"] == full["losses"] and resumed["weights_sha256"] == full["weights_sha256"]


@pytest.fixture(scope="module")
def mostly_desirable(tmp_path_factory) -> Path:
    """Labelled rows 7 in 8 desirable: the policy then raises completions' likelihood in general, so the KL
    estimate (mismatched rows' log-ratio, clamped at 0) is above 0 and moves the loss (on the balanced rows it stays
    0: mismatched answers become less likely)."""
    path = tmp_path_factory.mktemp("kto") / "mostly_desirable.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in labelled_rows(undesirable_every=8)))
    return path


@pytest.fixture(scope="module")
def reference(mostly_desirable, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kto") / "reference"
    return reference_run(NAME, kto_flags(out, 4, "--dataset_name", str(mostly_desirable)), out)


@pytest.mark.launch
@pytest.mark.parametrize("config", ["ddp", "zero3"])
def test_two_processes_train_as_one(config, mostly_desirable, reference, tmp_path):
    """2 processes of 4 rows against 1 of 8, the same global batch: the same KL estimate, losses, reward margins and
    weights. TRL pairs a row's prompt with its neighbour's completion within blocks of the per-device batch, which
    on 2 processes would pair within 4 rows, not 8: another KL (1.6824 against 1.6883 at step 2, measured with
    TRL's pairing), another loss; the toolkit's trainer pairs within the micro-step's rows over all ranks
    (training/kto.py)."""
    out = tmp_path / "run"
    flags = kto_flags(out, 4, "--dataset_name", str(mostly_desirable), "--per_device_train_batch_size", "4")
    check(launch(config, NAME, *flags, cwd=tmp_path))
    assert max(logged(reference, "kl")) > 0.5
    for key in ("kl", "loss", "rewards/margins"):
        assert logged(out, key) == pytest.approx(logged(reference, key), rel=1e-4, abs=1e-6), key
    ours, theirs = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():  # AdamW's sign-like steps: apart by at most 1% of lr x steps an element
        apart = float((ours[name] - value).norm())
        assert apart <= 0.01 * 2e-3 * 4 * value.numel() ** 0.5, (name, apart)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


GOOD = {"prompt": [{"role": "user", "content": "What is 2 plus 2?"}],
        "completion": [{"role": "assistant", "content": "2 plus 2 is 4."}], "label": True}  # fmt: skip


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(GOOD, label="yes"), r"row 3 .*: its label is 'yes' \(str\): true \(a desirable completion\) or false"),
        (dict(GOOD, completion=[{"role": "user", "content": "4"}]), r"row 3 .*: its completion has the roles \["),
        (dict(GOOD, prompt="What is 2 plus 2?"), "row 3 .*: prompt and completion must both be text or both"),
        (dict(GOOD, prompt=[{"role": "assistant", "content": "Hi"}]), "row 3 .*: its prompt ends on a assistant"),
    ],
)
def test_bad_labelled_rows_are_one_line_naming_the_row(bad, message, tmp_path):
    data = write_rows(tmp_path / "data.jsonl", [GOOD] * 3 + [bad] + [GOOD] * 4)
    with pytest.raises(DataError, match=message):
        train(KTO, kto_flags(tmp_path / "run", 1, "--dataset_name", str(data)), NAME)


def test_preference_pairs_under_kto_are_one_line(tmp_path):
    pair = {"chosen": GOOD["prompt"] + GOOD["completion"], "rejected": GOOD["prompt"] + GOOD["completion"]}
    data = write_rows(tmp_path / "pairs.jsonl", [pair] * 8)
    with pytest.raises(DataError, match=r"task kto trains on labelled completions.*pairs \(chosen, rejected\) "
                                        r"train with --task dpo"):  # fmt: skip
        train(KTO, kto_flags(tmp_path / "run", 1, "--dataset_name", str(data)), NAME)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--loss_type", "sigmoid"], r"loss_type 'sigmoid' is not among TRL's KTO losses \(kto, apo_zero_unpaired\)"),
        (["--beta", "0"], r"beta \(0\), desirable_weight \(1\) and undesirable_weight \(1\) must be positive"),
        (["--per_device_train_batch_size", "1"], "kto: per_device_train_batch_size 1: KTO's KL estimate pairs"),
        (["--per_device_train_batch_size", "auto"], "task kto batches in TRL's own trainer: pass a number"),
    ],
)
def test_settings_kto_cannot_take_are_one_line(flags, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        train(KTO, kto_flags(tmp_path / "run", 1, *flags), NAME)


def test_a_kto_steps_flops_are_the_plans(tmp_path):
    """The FLOPs of one KTO micro-batch, as torch's FlopCounterMode counts the matmuls really run (eager attention,
    whose matmuls it sees), against the run's plan: training on each row (6 per weight and token) plus 3 forwards
    without gradients as long (the reference on the row; the policy and the reference on its KL row), less what
    TRL's fused head skips (it projects onto the vocabulary only the positions that predict a completion token: 8
    FLOPs per vocabulary x hidden weight for the row's other positions, 4 for the KL row's). Counting 2 forwards
    or 4 instead of 3 moves the plan by 15% here."""
    from torch.utils.flop_counter import FlopCounterMode

    rows = [{"prompt": "Q", "completion": r["completion"][0]["content"], "label": r["label"]} for r in labelled_rows()]
    data = write_rows(tmp_path / "text.jsonl", rows)  # text rows, a one-token prompt: most positions are scored
    trainer = train(KTO, kto_flags(tmp_path / "run", 1, "--dataset_name", str(data), "--attn_implementation",
                                   "eager"), NAME).trainer  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    with FlopCounterMode(display=False) as counter:
        trainer.training_step(trainer.model, batch)
    config = trainer.model.config
    head = config.vocab_size * config.hidden_size
    unscored = [
        mask.numel() - int(mask[:, 1:].sum()) for mask in (batch["completion_mask"], batch["KL_completion_mask"])
    ]
    rows, width = batch["input_ids"].shape
    planned = trainer.plan.flops_per_token(width) * rows * width - head * (8 * unscored[0] + 4 * unscored[1])
    assert batch["KL_input_ids"].shape == batch["input_ids"].shape  # equal lengths: the plan's one width holds
    assert counter.get_total_flops() == pytest.approx(planned, rel=0.03)
