"""Cost: what a run costs, from the dated price table in `hardware.yaml`, and the budget guard.

cost_usd = wall_seconds / 3600 x billed units x price per unit-hour x overhead
where the billed units are the GPUs of the job (one per process), or on CPU the vCPUs of every node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from ..errors import ToolkitError

TABLE = Path(__file__).parent / "hardware.yaml"


def dollars(usd: float, digits: int = 3) -> str:
    """A cost a person reads: $0.0598, $12.3, $2,361 (not $2.36e+03); only a toy run's, under $0.0001, keeps the
    exponent, which a budget refusal compares exactly."""
    return f"${usd:,.0f}" if usd >= 10 ** (digits - 1) else f"${usd:.{digits}g}"


def hours(seconds: float) -> str:
    """A planned duration a person reads: 5,240 h, 3.5 h, 12 min, 40 s, "under 1 s"."""
    if seconds >= 100 * 3600:
        return f"{seconds / 3600:,.0f} h"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.2g} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s" if seconds >= 1 else "under 1 s"


class UnknownHardware(ToolkitError, ValueError):
    """A GPU type that is not in the price table."""


@cache
def price_table() -> dict[str, Any]:
    return yaml.safe_load(TABLE.read_text())


def device_spec(name: str, fix: str = "or pass --hourly_usd, its price per device-hour") -> dict[str, Any]:
    """The table's entry for a device; `fix`: what the command that names it accepts instead."""
    devices = price_table()["devices"]
    if name not in devices:
        raise UnknownHardware(f"Unknown GPU type '{name}'. Known: {', '.join(devices)} ({fix}).")
    return devices[name]


def detect_device() -> str:
    """The price-table entry for this machine's accelerator (the first GPU), or 'cpu'."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return device_named(torch.cuda.get_device_name(0))


def device_named(gpu: str) -> str:
    """The price-table entry whose `match` names this GPU (the longest match: "H100 PCIe" before a plain "H100"),
    or the name itself: not in the table, priced only with --hourly_usd."""
    found = [(len(m), name) for name, spec in price_table()["devices"].items() for m in spec.get("match", [])
             if m.lower() in gpu.lower()]  # fmt: skip
    return max(found)[1] if found else gpu


def peak_tflops(device: str, precision: str) -> float | None:
    """Dense datasheet peak of one device for MFU (fp32, or bf16/fp16 tensor cores); None where the table has
    none (CPUs, GPUs not in the table)."""
    spec = price_table()["devices"].get(device) or {}
    return (spec.get("peak_tflops") or {}).get(precision)


def memory_tbs(device: str) -> float | None:
    """Datasheet memory bandwidth of one device, TB/s; None where the table has none."""
    return (price_table()["devices"].get(device) or {}).get("memory_tbs")


def check_device_name(device: str | None, hourly_usd: float | None) -> None:
    """A GPU type given by name must be in the table, unless its price is given too."""
    if device is not None and hourly_usd is None:
        device_spec(device)  # the error lists the known names


@dataclass(frozen=True)
class CostModel:
    device: str
    unit: str  # "GPU" or "vCPU": what the price is per
    units: int  # billed units in the whole job
    usd_per_unit_hour: float | None  # None: unknown device and no --hourly_usd
    pricing: str
    overhead: float = 1.0

    @classmethod
    def for_job(
        cls,
        num_processes: int,
        num_machines: int,
        device: str | None = None,
        hourly_usd: float | None = None,
        pricing: str = "on_demand",
        overhead: float = 1.0,
    ) -> CostModel:
        check_device_name(device, hourly_usd)
        device = device or detect_device()
        spec = price_table()["devices"].get(device)
        per_vcpu = spec is not None and spec.get("per") == "vcpu"
        units = (os.cpu_count() or 1) * num_machines if per_vcpu else num_processes
        price = hourly_usd if hourly_usd is not None else (spec[pricing] if spec else None)
        return cls(device, "vCPU" if per_vcpu else "GPU", units, price, pricing, overhead)

    def unit_hours(self, seconds: float) -> float:
        return seconds / 3600 * self.units

    def usd(self, seconds: float) -> float | None:
        if self.usd_per_unit_hour is None:
            return None
        return self.unit_hours(seconds) * self.usd_per_unit_hour * self.overhead

    def summary(self, seconds: float, before: dict[str, float] | None = None) -> str:
        """The cost line printed at the end; `before`: what earlier segments of a resumed run spent."""
        used = self.unit_hours(seconds) + (before or {}).get("unit_hours", 0.0)
        if self.usd_per_unit_hour is None:
            return f"cost: {used:.4f} {self.unit}-hours on {self.device} (not in the price table: pass --hourly_usd)"
        usd = self.usd(seconds) + (before or {}).get("usd", 0.0)
        resumed = f", {dollars(before['usd'], 4)} of it before resuming" if before and before.get("usd") else ""
        overhead = f" x overhead {self.overhead:g}" if self.overhead != 1 else ""
        rate = f"${self.usd_per_unit_hour}/{self.unit}-hour{overhead}"
        return (
            f"cost: {dollars(usd, 4)} = {used:.4g} {self.unit}-hours x {rate} "
            f"({self.device}, {self.pricing.replace('_', '-')}, prices of {price_table()['prices_date']}{resumed})"
        )


class Budget:
    """`--budget_usd`: one warning at 80%; a stop (the caller checkpoints) when the next step would pass it."""

    WARN_AT = 0.8

    def __init__(self, usd: float):
        self.usd = usd
        self.warned = False

    def check(self, spent: float, step_usd: float) -> tuple[bool, str | None]:
        """(stop now?, a warning to print once) for `spent` so far and a step costing `step_usd`."""
        warning = None
        if not self.warned and spent >= self.WARN_AT * self.usd:
            self.warned = True
            warning = f"budget: {dollars(spent, 4)} spent, {100 * spent / self.usd:.0f}% of --budget_usd {self.usd:g}"
        return spent + step_usd > self.usd, warning
