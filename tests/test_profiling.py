"""--profile: a few steps' trace and top operators, per rank; off by default, and then nothing is made."""

from __future__ import annotations

import json

import pytest
from conftest import check, launch
from test_bad_input import assert_one_clear_line

from toolkit import run, train
from toolkit.project import load_recipe

FLAGS = ["--tiny", "--max_steps", "4", "--report_to", "none", "--save_strategy", "no"]


def test_a_profiled_run_writes_a_trace_and_its_top_operators(tmp_path):
    """Steps 2-3 recorded: a Chrome/Perfetto trace (JSON with traceEvents) whose events hold the matrix products
    the steps ran, the operators by self time (shares of the recorded time, the most first) beside it and in the
    run's summary; a run without --profile makes no profiler at all."""
    out = tmp_path / "on"
    result = train(load_recipe("llama3_fft"), [*FLAGS, "--profile", "2-3", "--output_dir", str(out)], "llama3_fft")
    trace = json.loads((out / "profile" / "rank0.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names
    top = json.loads((out / "profile" / "rank0.top.json").read_text())
    assert top and [t["self_ms"] for t in top] == sorted((t["self_ms"] for t in top), reverse=True)
    assert 0 < sum(t["share"] for t in top) <= 1 + 1e-9
    summary = json.loads((out / "run_summary.json").read_text())["summary"]
    assert summary["profile_top_ops"] == top and result.trainer.profiler.profile is None  # stopped after step 3
    split = json.loads((out / "profile" / "rank0.split.json").read_text())
    assert summary["profile_split"] == split and {"toolkit: forward", "toolkit: micro-batch"} <= names
    assert list(split) == ["data wait", "forward", "backward", "optimizer", "other", "communication"]
    assert sum(part["share"] for name, part in split.items() if name != "communication") == pytest.approx(1)
    assert split["forward"]["ms"] > 0 and split["backward"]["ms"] > 0 and split["communication"]["ms"] == 0

    off = train(load_recipe("llama3_fft"), [*FLAGS, "--output_dir", str(tmp_path / "off")], "llama3_fft")
    assert off.trainer.profiler is None and not (tmp_path / "off" / "profile").exists()
    assert "profile_top_ops" not in json.loads((tmp_path / "off" / "run_summary.json").read_text())["summary"]


def test_the_split_puts_each_phases_time_in_its_row(tmp_path, monkeypatch):
    """A known delay in the data fetch, the forward and the optimizer's step each lands in its own row, and not in
    the backward, which is the micro-batch's step less its forward: the rows are where the time went."""
    import functools
    import time

    import torch
    import transformers

    delay = 0.25  # against the scheduling noise of a loaded 2-core machine (+46 ms seen on an 80 ms delay)
    unslowed = train(load_recipe("llama3_fft"), [*FLAGS, "--profile", "2-3", "--output_dir", str(tmp_path / "b")],
                     "llama3_fft").trainer.profiler.split  # fmt: skip

    def slowed(function):
        @functools.wraps(function)  # the toolkit checks the signatures it builds on
        def slow(*args, **kwargs):
            time.sleep(delay)
            return function(*args, **kwargs)

        return slow

    monkeypatch.setattr(transformers.Trainer, "get_batch_samples", slowed(transformers.Trainer.get_batch_samples))
    monkeypatch.setattr(transformers.Trainer, "compute_loss", slowed(transformers.Trainer.compute_loss))
    monkeypatch.setattr(torch.optim.AdamW, "step", slowed(torch.optim.AdamW.step))
    out = tmp_path / "run"
    train(load_recipe("llama3_fft"), [*FLAGS, "--profile", "2-3", "--output_dir", str(out)], "llama3_fft")
    split = json.loads((out / "profile" / "rank0.split.json").read_text())
    for name in ("data wait", "forward", "optimizer"):  # one micro-batch a step: the delay once a step
        assert split[name]["ms"] - unslowed[name]["ms"] == pytest.approx(1e3 * delay, abs=1e3 * delay / 2), name
    assert abs(split["backward"]["ms"] - unslowed["backward"]["ms"]) < 1e3 * delay / 2


@pytest.mark.parametrize("value", ["8-5", "0-2", "five"])
def test_a_profile_that_names_no_steps_is_one_line(value, capsys):
    with pytest.raises(SystemExit):
        run(load_recipe("llama3_fft"), ["--tiny", "--profile", value], "llama3_fft")
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, f"profile names the optimizer steps to record, FIRST-LAST "
                          f"counted from 1, got '{value}'")  # fmt: skip


@pytest.mark.launch
def test_every_rank_writes_its_own_trace(tmp_path):
    out = tmp_path / "run"
    check(launch("ddp", "llama3_fft", *FLAGS, "--profile", "2", "--output_dir", str(out), cwd=tmp_path))
    for rank in (0, 1):
        assert json.loads((out / "profile" / f"rank{rank}.trace.json").read_text())["traceEvents"]
        assert json.loads((out / "profile" / f"rank{rank}.top.json").read_text())
        split = json.loads((out / "profile" / f"rank{rank}.split.json").read_text())
        assert split["communication"]["ms"] > 0  # DDP's gradient all-reduce, on gloo's threads
