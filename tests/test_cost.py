"""Cost: the price table is dated and sourced, and the arithmetic is hours x units x price."""

from __future__ import annotations

import pytest

from toolkit.cost import CostModel, UnknownHardware, device_spec, price_table


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
