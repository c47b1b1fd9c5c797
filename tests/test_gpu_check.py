"""`make gpu-check` (bench/gpu_check.py) on a CPU: its dry mode lists, for any number of GPUs, the launches it would
make, each one the toolkit's own checks accept; and one of its rows runs for real (ddp over gloo: train,
checkpoint, resume, reload, generate), so the command a GPU session relies on cannot rot."""

from __future__ import annotations

import sys

import pytest
import yaml
from conftest import ROOT

from toolkit.distributed.launch_check import check_mesh
from toolkit.project import strategy_files

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_dry_run_lists_every_shipped_config(gpus, capsys):
    assert gpu_check.main(["--dry_run", "--gpus", str(gpus)]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines()[:-1]}
    assert listed == {p.stem for p in strategy_files()}
    rows = gpu_check.plan_rows(gpus, fp8=True)
    launched = {r.config for r in rows if not r.skip}
    if gpus == 8:  # every config, mesh configs included, launches somewhere
        assert launched == {p.stem for p in strategy_files()}
    assert f"{sum(not r.skip for r in rows)} launches planned for {gpus} GPU(s)" in out
    assert all(r.resume for r in rows if r.recipe == "llama3_fft" and not r.skip)


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_each_planned_launch_passes_the_toolkits_mesh_checks(gpus):
    """The mesh flags and process count of every planned row, applied to its config, pass `toolkit check`'s mesh
    checks with its recipe: gpu-check spends no GPU time on a launch the toolkit would refuse."""
    for row in gpu_check.plan_rows(gpus, fp8=True):
        if row.skip:
            continue
        path = ROOT / "accelerate_configs" / f"{row.config}.yaml"
        config = yaml.safe_load(path.read_text())
        config["num_processes"] = row.processes
        for flag in row.launch_flags:
            key, value = flag.removeprefix("--").split("=")
            config.setdefault("parallelism_config", {})[key] = int(value)
        # the recipe's own model where its real heads are the tiny one's concern too (Llama 3: 32 and 8 heads
        # split as its 4 and 1 do); SmolLM2's real 9 heads are not its tiny 4
        check_mesh(config, path, row.recipe if row.recipe.startswith("llama3") and not row.recipe_flags else None)


def test_qlora_and_fp8_rows_follow_the_toolkits_refusals():
    rows = {(r.config, r.recipe): r for r in gpu_check.plan_rows(1, fp8=False)}
    assert not rows[("single_gpu", "llama3_qlora")].skip
    assert "QLoRA trains under single_gpu.yaml or ddp.yaml" in rows[("fsdp2", "llama3_qlora")].skip
    assert "FP8 tensor cores" in rows[("fsdp2_fp8", "llama3_fft")].skip


@pytest.mark.launch
def test_a_row_runs_for_real(tmp_path):
    """One row as a GPU runs it, on 2 CPU processes: trained with a checkpoint, resumed from a copy of it to the
    same losses, and the export answering a prompt through `toolkit generate`."""
    row = gpu_check.Row("ddp", "llama3_fft", 2, resume=True)
    gpu_check.run_row(row, tmp_path)
    assert row.status == "ok", row.error
    assert len(row.losses) == gpu_check.STEPS and row.resumed_losses == row.losses[gpu_check.SAVE_AT :]
    assert row.answer
    table = gpu_check.table([row])
    assert "| ddp | llama3_fft | 2 | ok |" in table and "same losses" in table
