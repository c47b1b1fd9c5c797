"""Preference tuning (task dpo) on TRL's DPOTrainer with the toolkit's parts: the learnable preference is learnt,
2 processes under DDP, ZeRO-3 (reference partitioned too) and FSDP2 train as 1 process does, LoRA scores the
reference with the adapter off, a preempted run resumes bit-identically, and bad preference data is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import check, launch, logged, preempt_at, rank_reports
from llama3_dpo import RECIPE as DPO
from llama3_dpo_lora import RECIPE as DPO_LORA
from llama3_fft import RECIPE as SFT
from safetensors.torch import load_file

from toolkit import run, train
from toolkit.errors import ConfigError, DataError
from toolkit.models import tiny


def dpo_flags(out: Path, per_device_batch: int, steps: int = 6) -> list[str]:
    model = tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "dpo")
    return ["--tiny", "--model_name_or_path", str(model), "--max_steps", str(steps), "--per_device_train_batch_size",
            str(per_device_batch), "--record_rank_reports", "true", "--report_to", "none", "--output_dir",
            str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dpo") / "one"
    train(DPO, dpo_flags(out, 8), "llama3_dpo")
    return out


def test_dpo_learns_a_learnable_preference(one_process):
    """The synthetic pairs (right sum stated against a wrong one hedged): the reward margin, measured on each new
    batch before its update, grows from 0 (policy = reference) step after step, and the loss falls from ln 2."""
    margins, losses = logged(one_process, "rewards/margins"), logged(one_process, "loss")
    assert margins[0] == 0 and losses[0] == pytest.approx(0.6931, abs=1e-4)
    assert all(later > earlier for earlier, later in zip(margins[1:], margins[2:], strict=False)), margins
    assert margins[-1] > 0.04 and logged(one_process, "rewards/accuracies")[-1] >= 0.75  # beta 0.01: small rewards
    written = json.loads((one_process / "run_summary.json").read_text())
    assert written["summary"]["status"] == "completed" and written["summary"]["steps"] == 6
    assert written["config"]["toolkit"]["beta"] == 0.01 and "reward_funcs" not in written["config"]["toolkit"]


@pytest.mark.launch
@pytest.mark.parametrize("config", ["zero3", "fsdp2"])
def test_dpo_trains_sharded_as_on_one_process(config, one_process, tmp_path):
    """Policy and reference sharded alike (ZeRO-3 partitions both; FSDP2 shards the reference read whole on every
    rank, RAM-efficient loading on): each step's loss and the exported weights equal the 1-process run's. (Under
    DDP both stay whole on every rank: the 1-process run's code, with the policy's gradients averaged.)"""
    out = tmp_path / "run"
    check(launch(config, "llama3_dpo", *dpo_flags(out, 4), cwd=tmp_path))
    assert rank_reports(out)[0]["losses"] == pytest.approx(rank_reports(one_process)[0]["losses"], rel=1e-5)
    assert logged(out, "rewards/margins") == pytest.approx(logged(one_process, "rewards/margins"), rel=1e-3, abs=1e-6)
    ours, reference = load_file(out / "model.safetensors"), load_file(one_process / "model.safetensors")
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-3, atol=5e-5, msg=name)


def test_dpo_starts_from_an_sft_runs_output(tmp_path, monkeypatch):
    """The recipes' chain: the SFT recipe's tiny run, then the DPO recipe from its output folder as the recipe
    names it (./runs/llama3_fft), which tiny mode takes as it is, ending on its held-out pairs' evaluation (which
    failed: transformers grouped them by the `input_ids` TRL's pairs have not); before the SFT run, one line
    naming it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="make finetune MODEL=llama3_fft ARGS=--tiny makes it"):
        train(DPO, ["--tiny"], "llama3_dpo")
    with pytest.raises(ConfigError, match=r"recipes/llama3_fft.py's output \(make finetune MODEL=llama3_fft makes"):
        train(DPO, [], "llama3_dpo")
    sft = train(SFT, ["--tiny", "--max_steps", "2", "--report_to", "none", "--output_dir", str(tmp_path / "runs" /
                      "llama3_fft")], "llama3_fft").trainer  # fmt: skip
    dpo = train(DPO, ["--tiny", "--max_steps", "2", "--report_to", "none", "--eval_fraction", "0.05"],
                "llama3_dpo").trainer  # fmt: skip
    assert dpo.param_counts.total == sft.param_counts.total
    # the recipe's held-out pairs (test_prefs; here 5% of the tiny ones) evaluated at the end, in their order
    assert 0 <= logged(tmp_path / "runs" / "llama3_dpo", "eval_rewards/accuracies")[-1] <= 1
    assert Path(dpo.model.name_or_path).resolve() == (tmp_path / "runs" / "llama3_fft").resolve()


def test_dpo_lora_scores_the_reference_with_the_adapter_off(tmp_path):
    """No second model: the reference is the base with the adapter off (equal to the start, the adapter's B being
    0), so the first step's margin is 0 and the loss ln 2; the preference is then learnt by the adapter alone."""
    out = tmp_path / "lora"
    trainer = train(DPO_LORA, [*dpo_flags(out, 8), "--learning_rate", "5e-3"], "llama3_dpo_lora").trainer
    assert trainer.ref_model is None
    margins = logged(out, "rewards/margins")
    assert margins[0] == 0 and all(b > a for a, b in zip(margins, margins[1:], strict=False)), margins
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()


def test_preempted_dpo_run_resumes_bit_identically(one_process, tmp_path, monkeypatch, capsys):
    """SIGTERM at step 3: checkpoint-3, exit 75; resumed, the same losses and bit-identical weights as the
    uninterrupted run (the reference, its log-probabilities and the data order all come back)."""
    from toolkit.training.stopping import PREEMPTED

    preempt_at(monkeypatch, 3)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(DPO, dpo_flags(out, 8), "llama3_dpo")
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-3"]
    train(DPO, [*dpo_flags(out, 8), "--resume", "auto"], "llama3_dpo")
    full, resumed = rank_reports(one_process)[0], rank_reports(out)[0]
    assert resumed["losses"] == full["losses"] and resumed["weights_sha256"] == full["weights_sha256"]
    assert logged(out, "rewards/margins")[-3:] == logged(one_process, "rewards/margins")[-3:]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"messages": [{"role": "user", "content": "hi"}]}], "chosen and rejected columns"),
        ([{"chosen": [{"role": "user", "content": "hi"}], "rejected": [{"role": "user", "content": "hi"}]}],
         "row 0 of the train split .* its chosen conversation: it has no assistant message"),
        ([{"chosen": "an answer", "rejected": ""}], "row 0 .* must both be conversations .* or both text"),
    ],
)  # fmt: skip
def test_bad_preference_data_is_one_line_naming_the_row(rows, message, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError, match=message):
        train(DPO, [*dpo_flags(tmp_path / "out", 8), "--dataset_name", str(data)], "llama3_dpo")
