"""bench/mfu.py, the GPU benchmark of #18, runs end to end at toy size on CPU, so a session with a GPU spends
its time measuring, not debugging: every variant this machine can run trains and reports its row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import mfu  # noqa: E402


@pytest.mark.parametrize("variant", ["trainer", "toolkit", "sdpa", "full_logits", "compile", "qlora"])
def test_mfu_bench_variant_runs_at_toy_size(variant, tmp_path):
    if reason := mfu.available(variant):
        pytest.skip(reason)
    row = mfu.run_variant(variant, steps=mfu.WARMUP + 2, batch=2, row_length=128, toy=True, out=tmp_path)
    assert row["tokens_per_second"] > 0 and row["device"] == "cpu"
    assert row["attention"] == "sdpa"  # auto's choice on a CPU (flex and flash attention on a GPU)
    assert row["mfu"] is None and row["peak_gib"] is None  # no datasheet peak, no CUDA allocator on a CPU
    assert (row["planned_gib"] is None) == (variant == "trainer")  # RecipeTrainer rows carry their own plan


def test_liger_variant_says_why_it_is_skipped_on_a_cpu():
    assert "Triton kernels for a GPU" in mfu.available("liger")  # not "install liger-kernel": it would not help


def test_bench_keeps_every_row_and_reports_a_failed_variant(tmp_path, monkeypatch, capsys):
    """What a GPU session relies on: rows on disk as they finish (a call cut short keeps them), and a variant that
    fails there (a kernel, a compiler) reported in the table while the others are still measured."""
    launch = subprocess.run

    def run(cmd, **kwargs):
        if "toolkit" in cmd:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback ...\nRuntimeError: boom\n")
        return launch(cmd, **kwargs)

    monkeypatch.setattr(mfu.subprocess, "run", run)
    argv = ["--toy", "--repeats", "2", "--steps", str(mfu.WARMUP + 2), "--variants", "trainer,toolkit,liger"]
    assert mfu.main([*argv, "--output", str(tmp_path)]) == 1
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["repeat"]) for r in rows] == [("trainer", 0), ("toolkit", 0), ("trainer", 1)]
    assert rows[0]["tokens_per_second"] > 0 and rows[1]["error"] == "exit 1: RuntimeError: boom"
    table = capsys.readouterr().out
    assert "| trainer | sdpa |" in table and "| 1.00x |" in table
    assert "| toolkit | failed: exit 1: RuntimeError: boom |" in table and "| liger | not run: " in table
    with pytest.raises(SystemExit):  # a typo in --variants, before anything runs
        mfu.main(["--toy", "--variants", "trainer,toolkti", "--output", str(tmp_path)])
