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


@pytest.mark.parametrize("variant", [v for v in mfu.VARIANTS if "liger" not in v])
def test_mfu_bench_variant_runs_at_toy_size(variant, tmp_path, monkeypatch):
    """Every variant of the GPU table but Liger's (Triton kernels: a GPU only), FP8 ones too (torchao's float8
    runs on a CPU; TOOLKIT_FP8_ON_CPU=1 passes the capability check), compiled ones compiled (dynamo and
    AOTAutograd; inductor's CPU kernels are not what a GPU builds)."""
    monkeypatch.setenv("TOOLKIT_FP8_ON_CPU", "1")
    if reason := mfu.available(variant):
        pytest.skip(reason)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    row = mfu.run_variant(variant, steps=mfu.WARMUP + 2, batch=2, row_length=128, toy=True, out=tmp_path)
    assert (counters["stats"]["unique_graphs"] > graphs) == row["compile"]  # traced by dynamo (aot_eager on a CPU)
    assert row["tokens_per_second"] > 0 and row["device"] == "cpu"
    assert row["attention"] == "sdpa"  # auto's choice on a CPU (flex and flash attention on a GPU)
    assert row["mfu"] is None and row["peak_gib"] is None  # no datasheet peak, no CUDA allocator on a CPU
    assert (row["planned_gib"] is None) == (variant in mfu.PLAIN)  # RecipeTrainer rows carry their own plan
    assert row["compile"] == (variant in ("trainer_compile", "fp8_compile"))  # auto: off on a CPU, but for FP8
    if variant.startswith("moe"):  # the kernel asked for ran (the model's own: transformers' default for moe)
        assert row["experts"] == mfu.OPTIONS[variant].get("experts_implementation", "grouped_mm")
    if variant in mfu.PLAIN or variant == "qlora":
        return
    assert row["masters"] == ("no master weights: 16-bit updates" if variant == "no_masters" else
                              "bf16 weights and compute, fp32 master weights in the optimizer step")  # fmt: skip


def test_the_plain_trainer_does_the_same_work():
    """The baseline's batches reach the model as the toolkit's do: position ids restarting per conversation and no
    attention mask, so each conversation attends only to itself (its logits in the packed row are those it has
    alone); the collator's all-ones mask, which the baseline used to get, lets them attend across."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.data.packing import PackedCollator

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mfu.model_config(toy=True), attn_implementation="sdpa").eval()
    first, second = list(range(3, 40)), list(range(50, 90))
    row = {"input_ids": first + second, "labels": first + second, "position_ids": [*range(37), *range(40)]}
    batch = mfu.plain_collator(PackedCollator(0))([row])
    assert "attention_mask" not in batch and "num_sequences" not in batch
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0, 37:]
        alone = model(torch.tensor([second])).logits[0]
        masked = model(batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=torch.ones_like(batch["input_ids"])).logits[0, 37:]  # fmt: skip
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(masked, alone, rtol=1e-2, atol=1e-2)


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


def test_an_interrupted_bench_prints_what_it_measured(tmp_path, monkeypatch, capsys):
    """A device call's time limit sends SIGINT mid-variant: the table of the variants measured so far, exit 130 (it
    was a traceback, the measured rows only on disk)."""
    measured = {"tokens_per_second": 1000.0, "mfu": None, "peak_gib": None, "planned_gib": None,
                "attention": "sdpa", "compile": False, "device": "cpu"}  # fmt: skip

    def run(cmd, **kwargs):
        if "trainer" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout="BENCH " + json.dumps(measured), stderr="")
        raise KeyboardInterrupt

    monkeypatch.setattr(mfu.subprocess, "run", run)
    assert mfu.main(["--toy", "--variants", "trainer,toolkit", "--output", str(tmp_path)]) == 130
    captured = capsys.readouterr()
    assert "| trainer | sdpa | off | 1,000 | 1.00x |" in captured.out and "| toolkit |" not in captured.out
    assert "interrupted" in captured.err


def test_without_a_gpu_the_full_size_bench_is_one_error_line(monkeypatch, capsys):
    """`make bench-gpu` on a CPU ran the 1B model there, each variant out of memory after a minute or more."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        mfu.main(["--repeats", "1", "--variants", "trainer"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line: argparse's usage printed above it before
    assert len(err) == 1 and err[0].startswith("error: no GPU here (torch sees none): this measures a GPU; pass --toy")
