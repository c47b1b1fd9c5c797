"""bench/mfu.py, the GPU benchmark of #18, runs end to end at toy size on CPU, so a session with a GPU spends
its time measuring, not debugging: every variant this machine can run trains and reports its row."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import mfu  # noqa: E402


@pytest.mark.parametrize("variant", ["trainer", "toolkit", "sdpa", "full_logits", "compile"])
def test_mfu_bench_variant_runs_at_toy_size(variant, tmp_path):
    row = mfu.run_variant(variant, steps=mfu.WARMUP + 2, batch=2, row_length=128, toy=True, out=tmp_path)
    assert row["tokens_per_second"] > 0 and row["device"] == "cpu"
    assert row["attention"] == "sdpa"  # auto's choice on a CPU (flex and flash attention on a GPU)
    assert row["mfu"] is None and row["peak_gib"] is None  # no datasheet peak, no CUDA allocator on a CPU
    assert (row["planned_gib"] is None) == (variant == "trainer")  # RecipeTrainer rows carry their own plan


def test_liger_variant_says_why_it_is_skipped_on_a_cpu():
    assert "Triton kernels for a GPU" in mfu.available("liger")  # not "install liger-kernel": it would not help
