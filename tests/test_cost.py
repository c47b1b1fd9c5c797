"""Cost: the price table is dated and sourced, and the arithmetic is hours x units x price."""

from __future__ import annotations

import json
import re

import pytest

from toolkit.metrics.cost import CostModel, UnknownHardware, device_spec, price_table


def test_table_is_dated_and_has_the_published_peaks():
    table = price_table()
    assert table["prices_date"]
    # NVIDIA datasheets, dense: A100 312 BF16 / 19.5 FP32; H100 SXM 989 BF16 / 67 FP32.
    assert device_spec("A100-80GB")["peak_tflops"] == {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}
    assert device_spec("H100-80GB")["peak_tflops"]["bf16"] == 989.0
    for name, spec in table["devices"].items():
        assert spec["spot"] < spec["on_demand"], name


def test_gpu_cost_is_hours_times_gpus_times_price():
    cost = CostModel.for_job(num_processes=8, num_machines=1, device="A100-80GB")
    assert cost.unit == "GPU" and cost.units == 8
    assert cost.usd(3600) == pytest.approx(8 * device_spec("A100-80GB")["on_demand"])
    spot = CostModel.for_job(8, 1, device="A100-80GB", pricing="spot")
    assert spot.usd(1800) == pytest.approx(0.5 * 8 * device_spec("A100-80GB")["spot"])
    custom = CostModel.for_job(2, 1, device="A100-80GB", hourly_usd=1.5, overhead=1.3)
    assert custom.usd(7200) == pytest.approx(2 * 2 * 1.5 * 1.3)


def test_cpu_is_priced_per_vcpu_of_every_node(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cost = CostModel.for_job(num_processes=4, num_machines=2, device="cpu")
    assert cost.unit == "vCPU" and cost.units == 4
    assert cost.usd(3600) == pytest.approx(4 * device_spec("cpu")["on_demand"])
    assert "vCPU-hours" in cost.summary(3600)


def test_unknown_gpu_type_lists_the_known_ones():
    with pytest.raises(UnknownHardware, match="Unknown GPU type 'A100-90GB'. Known: .*A100-80GB"):
        CostModel.for_job(1, 1, device="A100-90GB")
    # with an explicit price any name will do
    assert CostModel.for_job(1, 1, device="A100-90GB", hourly_usd=2.0).usd(3600) == pytest.approx(2.0)


# --------------------------------------------------------------------------- the budget guard, on real runs
def bert_run(tmp_path, *flags):
    from bert import RECIPE

    from toolkit import train

    return train(RECIPE, ["--tiny", "--report_to", "none", "--output_dir", str(tmp_path / "run"), *flags], "bert")


def test_budget_stops_with_a_checkpoint_that_resumes_and_carries_the_cost(tmp_path, capsys):
    from toolkit.training.stopping import BudgetSpent

    # $72,000 per vCPU-hour, $20 per vCPU-second: $5 is spent within an eighth of a second of training, long
    # before the 40 steps end, however fast this machine
    flags = ["--max_steps", "40", "--logging_steps", "2", "--hourly_usd", "72000"]
    with pytest.raises(BudgetSpent, match=r"stopped after step (\d+) of 40 with .*checkpoint-\1 written") as info:
        bert_run(tmp_path, *flags, "--budget_usd", "5")
    step = int(re.search(r"after step (\d+)", str(info.value)).group(1))
    # the 80% warning at most once: the run stops as soon as the next step would pass $5, which on a fast machine
    # comes before the spend reaches 80% (step 1 ended with $2.5-4 spent: a stop, no warning); its timing is
    # test_budget_warns_once_at_80_percent_and_stops_before_the_step_that_would_pass_it's
    assert capsys.readouterr().err.count("budget: $") <= 1
    checkpoint = tmp_path / "run" / f"checkpoint-{step}"
    spent = json.loads((checkpoint / "toolkit_cost.json").read_text())
    # training stopped before the next step (at the mean step cost so far, start-up included) would pass $5;
    # the checkpoint's save then adds its own seconds
    logged = [json.loads(line) for line in (tmp_path / "run" / "run_log.jsonl").read_text().splitlines()]
    assert all(line["cost_usd"] <= 5 for line in logged if "loss" in line) and spent["usd"] > 0
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())["summary"]
    assert summary["status"] == "budget" and summary["steps"] == step

    resumed = bert_run(tmp_path, *flags, "--budget_usd", "1e9", "--resume", "auto")
    assert resumed.trainer.state.global_step == 40
    out = capsys.readouterr().out
    assert "of it before resuming" in out and f"checkpoint-{step}" in out
    final = json.loads((tmp_path / "run" / "run_summary.json").read_text())["summary"]
    assert final["cost_usd"] > spent["usd"] and final["status"] == "completed"


def test_a_budget_below_the_plan_is_refused_before_training(tmp_path, capsys):
    """Priced as an A100, the run's cost plan is the planner's: samples/s at the assumed MFU, x hours x price."""
    from test_strategies import tokenized_rows
    from transformers import AutoConfig

    from toolkit import planner, run
    from toolkit.models import tiny

    rows = tokenized_rows("bert")
    mean_length = sum(map(len, rows)) / len(rows)
    config = AutoConfig.from_pretrained(tiny.tiny_checkpoint("google-bert/bert-base-cased", "classification"))
    shape = planner.Shape.of(planner.meta_model(config, "classification"), config)
    a100 = device_spec("A100-80GB")
    rate = planner.samples_per_second_at_mfu(shape, mean_length, 0.40, 1, a100["peak_tflops"]["fp32"])
    planned = planner.cost_from_throughput(1000 * 8, 1, rate, 1, a100["on_demand"], 1.0).usd

    from bert import RECIPE

    base = ["--tiny", "--report_to", "none", "--gpu_type", "A100-80GB", "--max_steps", "1000"]
    for budget, message in [(planned / 10, rf"the planned cost of this run, \${planned:.3g} for 1000 steps at an "
                             r"assumed 40% MFU on A100-80GB, is above --budget_usd .*--force_budget true"),
                            (planned / 5000, r"is below the cost of one optimizer step")]:  # fmt: skip
        out = tmp_path / f"run-{budget}"
        with pytest.raises(SystemExit) as exit_info:
            run(RECIPE, [*base, "--budget_usd", str(budget), "--output_dir", str(out)], name="bert")
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err)
        assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()


def test_budget_warns_once_at_80_percent_and_stops_before_the_step_that_would_pass_it():
    from toolkit.metrics.cost import Budget

    budget = Budget(10.0)
    assert budget.check(7.0, 1.0) == (False, None)
    stop, warning = budget.check(8.0, 1.0)
    assert not stop and "80% of --budget_usd 10" in warning
    assert budget.check(8.5, 1.0) == (False, None)  # said once
    assert budget.check(9.5, 1.0) == (True, None)  # 9.5 + 1 > 10: stop now, checkpoint, exit


def test_an_h100_is_priced_and_peaked_as_the_part_it_is():
    """torch's names for the two H100 parts: the PCIe card (756 dense BF16 TFLOPS, NVIDIA's datasheet) is not
    the SXM5 one (989); an unknown part is named, not guessed (it was priced and peaked as SXM5). The H200's two
    parts, from their datasheet: SXM 989, NVL 835; the L40S and B200 the FP8 refusal names as FP8 GPUs."""
    from toolkit.metrics.cost import device_named, peak_tflops

    assert device_named("NVIDIA H100 80GB HBM3") == "H100-80GB" and peak_tflops("H100-80GB", "bf16") == 989.0
    assert device_named("NVIDIA H100 PCIe") == "H100-PCIe-80GB" and peak_tflops("H100-PCIe-80GB", "bf16") == 756.0
    assert device_named("NVIDIA H100 NVL") == "NVIDIA H100 NVL"  # not in the table: --hourly_usd and --peak_tflops
    assert device_named("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert device_named("NVIDIA H200") == "H200-141GB" and peak_tflops("H200-141GB", "bf16") == 989.0  # the H100's
    assert device_named("NVIDIA H200 NVL") == "H200-NVL-141GB" and peak_tflops("H200-NVL-141GB", "bf16") == 835.0
    assert device_named("NVIDIA L40S") == "L40S-48GB" and peak_tflops("L40S-48GB", "fp8") == 733.0
    assert peak_tflops(device_named("NVIDIA B200"), "bf16") == 36_000 / 8 / 2  # HGX B200: 8 GPUs, with sparsity


def test_costs_and_durations_read_as_a_person_writes_them():
    """The header's plan and the cost lines: no exponent where a real run lands (a Llama-8B run's plan read
    "$2.36e+03 for 5000 steps (2.36e+03 h ...)", a tiny run's "(5.25e-09 h ...)")."""
    from toolkit.metrics.cost import dollars, hours

    assert [dollars(x) for x in (2360.5, 12.34, 0.0598, 0.000123, 2.36e-8, 0)] == [
        "$2,360", "$12.3", "$0.0598", "$0.000123", "$2.36e-08", "$0"]  # fmt: skip
    assert [dollars(x, 4) for x in (0.02046, 1234.56, 98765.4)] == ["$0.02046", "$1,235", "$98,765"]
    assert [hours(s) for s in (1.9e-5, 40, 720, 3.5 * 3600, 5240 * 3600)] == [
        "under 1 s", "40 s", "12 min", "3.5 h", "5,240 h"]  # fmt: skip
