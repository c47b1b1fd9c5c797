"""Online RL by RLOO (task rloo) on TRL's RLOOTrainer with the toolkit's parts, as GRPO's are (test_rl.py): a tiny
run samples, scores, keeps its KL to the reference and exports the adapter alone; `toolkit eval` compares base and
tuned; a preempted run resumes bit-identically; 2 processes under DDP and ZeRO-3 train as one on the same
completions; what RLOO cannot take is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, check, launch, logged, preempt_at, rank_reports, reference_run
from safetensors.torch import load_file
from smollm2_rloo import RECIPE as RLOO
from test_rl import grpo_flags as flags_for

from toolkit import run, train
from toolkit.errors import ConfigError
from toolkit.results.evaluation import evaluate_run
from toolkit.results.record import RunRecord

NAME = "smollm2_rloo"
REPLAY = str(ROOT / "tests" / "grpo_replay.py") + ":replay"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rloo") / "one"
    train(RLOO, flags_for(out, 4, "--eval_fraction", "0.02", "--save_steps", "2", "--peak_tflops", "0.1",
                          "--memory_tbs", "0.01"), NAME)  # fmt: skip
    return out


def test_a_tiny_rloo_run_samples_scores_trains_and_exports(one_process):
    """Each step: 2 prompts x 4 completions sampled and scored, the KL to the reference (TRL's RLOO default, beta
    0.05: under LoRA the adapter's frozen starting copy) logged, the adapter moved and exported alone, on TRL's
    RLOOTrainer; the held-out prompts are not evaluated by the trainer (their figure is `toolkit eval`'s)."""
    for key in ("rewards/accuracy/mean", "rewards/format/std", "reward", "kl", "completions/mean_length"):
        assert len(logged(one_process, key)) == 4, key
    assert any(norm > 0 for norm in logged(one_process, "grad_norm"))
    assert not logged(one_process, "eval_loss")
    record = RunRecord.read(one_process)
    assert record.task == "rloo" and record.settings["beta"] == 0.05 and record.settings["loss_type"] is None
    assert (one_process / "checkpoint-2" / "ref").is_dir() and not (one_process / "ref").exists()
    assert (one_process / "adapter_model.safetensors").is_file()
    # the plan times each step's sampling (a floor) beside its training, as GRPO's
    summary = json.loads((one_process / "run_summary.json").read_text())
    assert summary["summary"]["status"] == "completed" and 0 < summary["config"]["cost_plan"]["sampling_seconds"]
    shares, seconds = logged(one_process, "sampling_share"), logged(one_process, "step_seconds")
    sampled = min(share * s for share, s in zip(shares, seconds, strict=True))
    assert summary["config"]["cost_plan"]["sampling_seconds"] < sampled


def test_the_trainer_is_trls_rloo_and_its_header_says_so(tmp_path, capsys):
    from trl import RLOOTrainer

    trainer = train(RLOO, flags_for(tmp_path / "run", 1, "--save_strategy", "no"), NAME).trainer
    assert isinstance(trainer, RLOOTrainer) and trainer.beta == 0.05
    out = capsys.readouterr().out
    assert "loss          RLOO's (TRL's): each completion's reward less its siblings' mean" in out
    assert "KL to the reference, beta 0.05" in out


def test_eval_scores_base_and_tuned_by_the_runs_rewards(one_process):
    result = evaluate_run(one_process)
    metrics = {row["metric"]: row for row in result["results"]}
    assert result["tasks"] == ["held-out"] and set(metrics) == {"accuracy", "format", "reward", "finished"}
    assert result["inputs"]["base"] == result["inputs"]["tuned"]


def test_preempted_rloo_run_resumes_bit_identically(one_process, tmp_path, monkeypatch):
    from toolkit.training.stopping import PREEMPTED

    preempt_at(monkeypatch, 2)
    out = tmp_path / "run"
    flags = flags_for(out, 4, "--eval_fraction", "0.02", "--save_steps", "2")
    with pytest.raises(SystemExit) as exit_info:
        run(RLOO, flags, NAME)
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED
    train(RLOO, [*flags, "--resume", "auto"], NAME)
    full, resumed = rank_reports(one_process)[0], rank_reports(out)[0]
    assert resumed["losses"] == full["losses"] and resumed["weights_sha256"] == full["weights_sha256"]
    assert logged(out, "kl")[-2:] == logged(one_process, "kl")[-2:]


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--loss_type", "dapo"], "loss_type 'dapo' is read only by tasks dpo, kto and grpo, and this run's"),
        (["--num_generations", "1"], "num_generations must be at least 2, got 1: the RLOO advantage"),
        (["--reward_funcs", ""], "a rloo recipe needs rewards"),
        (["--per_device_train_batch_size", "6"], r"rloo: generation_batch_size \(6\) must be divisible by"),
    ],
)
def test_settings_rloo_cannot_take_are_one_line(flags, key, tmp_path):
    with pytest.raises(ConfigError, match=key):
        train(RLOO, flags_for(tmp_path / "run", 2, *flags), NAME)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> Path:
    """The 1-process run on replayed completions (tests/grpo_replay.py, which RecipeRLOOTrainer takes as GRPO's
    rollout_func), every weight trained against a frozen reference model (beta 0.05)."""
    out = tmp_path_factory.mktemp("rloo") / "replayed"
    return reference_run(NAME, flags_for(out, 3, "--rollout_func", REPLAY, "--use_lora", "false"), out)


@pytest.mark.launch
@pytest.mark.parametrize("config", ["ddp", "zero3"])
def test_two_processes_train_as_one_on_the_same_completions(config, replayed, tmp_path):
    """2 processes, a prompt's group on each rank, the same completions as the 1-process run: the same rewards,
    KL, losses and exported weights (the reference model a frozen copy: under ZeRO-3 sharded as the policy is).
    RLOO's loss is a mean over a micro-batch's completions, as many on each rank: the ranks' mean is the one
    process's."""
    out = tmp_path / "run"
    check(launch(config, NAME, *flags_for(out, 3, "--rollout_func", REPLAY, "--use_lora", "false",
                                          "--per_device_train_batch_size", "4"), cwd=tmp_path))  # fmt: skip
    reports = rank_reports(out)
    assert len(reports) == 2 and not set(reports[0]["rows"]) & set(reports[1]["rows"])
    assert sorted(reports[0]["rows"] + reports[1]["rows"]) == sorted(rank_reports(replayed)[0]["rows"])
    assert any(kl > 0.1 for kl in logged(replayed, "kl"))  # the policy moved off its reference: a KL to compare
    # RLOO's loss is ~0 at each step (one pass a sampling: the ratio is 1 and a group's advantages sum to 0): its
    # gradient is what the processes must agree on
    for key in ("reward", "kl", "grad_norm", "loss"):
        assert logged(out, key) == pytest.approx(logged(replayed, key), rel=1e-4, abs=1e-6), key
    ours, reference = load_file(out / "model.safetensors"), load_file(replayed / "model.safetensors")
    assert sorted(ours) == sorted(reference)
    step_size = RunRecord.read(replayed).settings["learning_rate"] * 3  # as test_rl.py's: AdamW's sign-like steps
    for name, value in reference.items():
        apart = float((ours[name] - value).norm())
        assert apart <= 0.01 * step_size * value.numel() ** 0.5, (name, apart)
