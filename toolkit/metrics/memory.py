"""Memory as measured: the bytes of a tensor this rank really holds, this process's peak host RAM (split into
what it allocated and what it maps), the device's peak, and how full the device is. The planner's predictions
(planner/memory.py) are checked against these figures.
"""

from __future__ import annotations

import re
import resource
import threading
import time
from pathlib import Path
from typing import Any

import torch

GIB = 2**30


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A weight wrapper (torchao's float8 training weights, WeightWithDynamicFloat8CastTensor: a tensor subclass
    holding the real weight, which safetensors cannot address) as the tensor it wraps. DTensors and subclasses
    that are not a plain wrapper (a quantized tensor's data and scales) are left as they are."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor) and not isinstance(tensor, DTensor):
        names, _ = tensor.__tensor_flatten__()
        inner = getattr(tensor, names[0]) if len(names) == 1 else None
        if inner is None or inner.shape != tensor.shape or inner.dtype != tensor.dtype:
            break
        tensor = inner
    return tensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a parameter or state tensor that this rank stores, as a plain tensor."""
    if hasattr(t, "ds_tensor"):  # DeepSpeed ZeRO-3: the partition lives beside an empty placeholder
        return t.ds_tensor
    return plain_tensor(t.to_local() if hasattr(t, "to_local") else t)  # FSDP2: a DTensor's local shard


def nbytes(t: torch.Tensor) -> int:
    """Bytes this rank really holds for `t`: its shard where sharded, nothing for a meta-device placeholder."""
    local = local_tensor(t)
    return 0 if local.device.type == "meta" else local.numel() * local.element_size()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def peak_host_bytes() -> int:
    """This process's peak resident set so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class HostMemoryPeak:
    """Peak host RAM of this process above a starting point, sampled every few milliseconds by a thread, split
    into anonymous memory (what the process allocated: tensors, copies) and file-backed pages (a memory-mapped
    checkpoint: page cache, shared between ranks that map the same file and reclaimable by the kernel). RSS lumps
    the two together and counts shared pages in every rank; PSS (proportional set size) splits each shared page
    between the processes mapping it, so PSS summed over ranks is the physical memory they use together.
    Linux only (/proc/self/smaps_rollup); elsewhere the peaks stay None. `series` keeps (unix time, anon, file)
    at every change of a MiB or more, so peaks summed over ranks at the same moment can be computed afterwards."""

    FIELDS = ("Pss_Anon", "Pss_File")

    def __init__(self, interval_s: float = 0.005):
        self.peaks: dict[str, int] | None = None
        self.series: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._base = self._read()
        if self._base is None:
            return
        self.peaks = dict.fromkeys(self.FIELDS, 0)
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True)
        self._thread.start()

    @classmethod
    def _read(cls) -> dict[str, int] | None:
        try:
            text = Path("/proc/self/smaps_rollup").read_text()
        except OSError:
            return None
        found = dict(re.findall(r"^(\w+):\s+(\d+) kB", text, flags=re.MULTILINE))
        return {field: int(found.get(field, 0)) * 1024 for field in cls.FIELDS}

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._update()

    def _update(self) -> None:
        now = self._read()
        if now is None:
            return
        added = [now[field] - self._base[field] for field in self.FIELDS]
        for field, value in zip(self.FIELDS, added, strict=True):
            self.peaks[field] = max(self.peaks[field], value)
        if not self.series or max(abs(a - b) for a, b in zip(added, self.series[-1][1:], strict=True)) >= 2**20:
            self.series.append((time.time(), *added))

    def current(self) -> dict[str, int] | None:
        """The peaks so far above the start, in bytes: {"anon": ..., "file": ...}."""
        if self.peaks is None:
            return None
        self._update()
        return {"anon": self.peaks["Pss_Anon"], "file": self.peaks["Pss_File"]}

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling; the peaks above the start, and the series."""
        if self.peaks is None:
            return None
        self._stop.set()
        self._thread.join()
        return {**self.current(), "series": self.series}


def peak_over_ranks(series: list[list[tuple[float, int, int]]], field: int) -> int:
    """The most that several processes held at one moment, from their HostMemoryPeak series (field 1: anonymous,
    2: file-backed); each process holds its last sample until the next."""
    events = sorted((point[0], rank, point[field]) for rank, points in enumerate(series) for point in points)
    held = [0] * len(series)
    most = 0
    for _, rank, value in events:
        held[rank] = value
        most = max(most, sum(held))
    return most


def peak_memory_bytes() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else peak_host_bytes()


def memory_fraction() -> float:
    """How full the device is: reserved / total on a GPU, the host's RAM in use on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / device_memory()
    import psutil

    return psutil.virtual_memory().percent / 100


def device_memory() -> int:
    """Bytes the run's device holds: the GPU's total, the host's RAM on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    import psutil

    return psutil.virtual_memory().total
