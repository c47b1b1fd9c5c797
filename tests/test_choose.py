"""`toolkit plan MODEL --choose` (issue 67, item 4): the cheapest fitting GPU type, size and config, whose fit and
cost are the plan's own rows; a budget and a deadline narrow it; a GPU type the price table cannot plan is one
line."""

from __future__ import annotations

import json

import pytest

from toolkit.planner import cli

TYPES = "A100-80GB,H100-80GB"
SIZES = ((2, 1), (8, 1), (8, 2))  # of choose.py's: each plan takes a second or two


@pytest.fixture(autouse=True)
def fewer_sizes(monkeypatch):
    monkeypatch.setattr("toolkit.planner.choose.SIZES", SIZES)


def planned(model: str, gpu: str, gpus: int, nodes: int, capsys) -> dict:
    """The plan `toolkit plan MODEL --gpu GPU --gpus N --nodes M --json` prints."""
    assert cli.main([model, "--gpu", gpu, "--gpus", str(gpus), "--nodes", str(nodes), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def chosen(model: str, capsys, *flags: str) -> dict:
    assert cli.main([model, "--choose", "--gpu_types", TYPES, "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["llama3_fft", "qwen3_moe_fft"])
def test_the_choice_is_the_cheapest_fitting_row_of_the_plans(model, capsys):
    """Every plan of 2 types at 3 sizes, read as `toolkit plan --json` prints it: the choice is the row of
    least on-demand dollars among the configs that fit and are not refused, and it is that plan's row exactly."""
    rows = [(r["usd"], gpu, gpus, nodes, r) for gpu in TYPES.split(",") for gpus, nodes in SIZES
            for r in planned(model, gpu, gpus, nodes, capsys)["configs"]
            if r["micro_batch"] and not r["refused"] and r.get("usd") is not None]  # fmt: skip
    choice = chosen(model, capsys)
    cheapest = min(usd for usd, *_ in rows)
    # FP8's row is fsdp2's at the model's own float8 speed-up (tests/test_fp8.py: the share of FLOPs it converts)
    h100 = planned(model, "H100-80GB", 8, 1, capsys)
    fp8 = {r["config"]: r.get("samples_per_second") for r in h100["configs"]}
    assert fp8["fsdp2_fp8"] == pytest.approx(fp8["fsdp2"] * h100["fp8_speedup"]) and h100["fp8_speedup"] < 1.251
    assert choice["row"]["usd"] == cheapest and choice["weighed"] == len(rows)
    own = next(r for _, gpu, gpus, nodes, r in rows if (gpu, gpus, nodes, r["config"]) ==
               (choice["gpu"], choice["gpus"], choice["nodes"], choice["config"]))  # fmt: skip
    assert own == choice["row"] and choice["micro_batch"] == own["micro_batch"] > 0
    assert choice["wall_hours"] == pytest.approx(own["device_hours"] / (choice["gpus"] * choice["nodes"]))
    # a deadline shorter than the cheapest's wall time picks a faster, dearer row within it
    deadline = choice["wall_hours"] / 2
    faster = chosen(model, capsys, "--deadline_hours", f"{deadline}")
    assert faster["wall_hours"] <= deadline and faster["row"]["usd"] >= cheapest
    assert faster["row"]["usd"] == min(usd for usd, _, gpus, nodes, r in rows
                                       if r["device_hours"] / (gpus * nodes) <= deadline)  # fmt: skip


def test_a_budget_nothing_fits_in_and_unplannable_gpus_are_one_line(capsys):
    """Under the cheapest row's price nothing is chosen: one error line naming the cheapest and the fastest. A GPU
    type the table does not hold, or holds without a datasheet peak (the CPU entry), is one line too; so is an
    online recipe, whose step (and so its work) grows with the GPUs."""
    choice = chosen("llama3_fft", capsys)
    for model, flags, message in [
        ("llama3_fft", ["--gpu_types", TYPES, "--budget_usd", f"{choice['row']['usd'] * 0.99}"],
         "nothing fits within --budget_usd"),
        ("llama3_fft", ["--gpu_types", "H100-80GB,TPU-v5"], "Unknown GPU type 'TPU-v5'"),
        ("llama3_fft", ["--gpu_types", "cpu"], "--gpu_types cpu: the price table gives it no device memory"),
        ("qwen3_grpo", [], "--choose compares the same work on every size, and qwen3_grpo's steps"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            cli.main([model, "--choose", *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("error:") == 1 and message in err, err
