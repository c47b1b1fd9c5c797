"""`--per_device_train_batch_size auto`: the largest micro-batch that fits, the global batch kept.

The recipe's micro-batch x its gradient accumulation is what a device trains on per optimizer step; the finder keeps
that, and so the global batch, the schedule and the learning rate, and picks how it is split: the micro-batch is a
divisor of those rows and the accumulation the rest.

  1. The plan's start: the largest divisor whose planned peak (planner/memory.py, the run's own workload) fits the
     budget: the device's memory less a tenth, or TOOLKIT_MEMORY_LIMIT_GIB.
  2. The probe: a forward and backward of the real model on that many of the longest training rows, collated as
     training collates them, its peak measured by torch's MemTracker (the live tensors on the device: weights,
     gradients, activations), plus what the step has and the probe does not (the optimizer's states and master
     weights, a GPU's CUDA context: the plan's figures). Over the budget, or a real out-of-memory on the way, and
     accelerate's `find_executable_batch_size` halves: the next divisor at most half as large. On a CPU, where an
     out-of-memory is the kernel's OOM killer and not an error, the measurement is the only guard. The gradients
     are dropped and the random state restored: the run trains as if it had been given the number.
  3. Every rank probes its own device; the smallest choice wins.

The probe needs the whole model on each device: single device and DDP. Under sharding (FSDP, ZeRO, tensor, pipeline
or sequence parallelism) it is refused with the planner's command instead.
"""

from __future__ import annotations

import gc
import inspect
import math
import os
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from ..metrics.memory import GIB, device_memory, human_bytes
from ..planner.layout import Layout
from ..planner.memory import plan_memory
from ..planner.workload import Workload
from ..settings.mesh import launch_mesh, model_parallel_size, pipeline_stages
from ..settings.tasks import task
from .run_plan import measured_shape

LIMIT = "TOOLKIT_MEMORY_LIMIT_GIB"  # the memory a device may use, in place of its own (a shared GPU; tests)
HEADROOM = 0.1  # of the device's memory left free, as `toolkit plan` leaves it
# The step's memory the probe does not allocate: the optimizer's (at its first step) and the CUDA context's
NOT_PROBED = ("master_weights", "optimizer_states", "fp32_gradients", "cuda_context")


@dataclass(frozen=True)
class BatchChoice:
    rows: int  # per device and optimizer step, kept
    micro_batch: int
    planned: int  # the plan's largest fitting divisor, where the probe started
    tried: tuple[tuple[int, int | None], ...]  # (micro-batch, bytes needed; None: a real out-of-memory), in order
    budget: int
    source: str

    @property
    def accumulation(self) -> int:
        return self.rows // self.micro_batch

    def note(self) -> str:
        """The header's line: what it chose and why."""
        needs = [f"{b} needs {human_bytes(n) if n is not None else 'more (out of memory)'}" for b, n in self.tried]
        probe = "probed: " + ", ".join(needs) + f": {self.micro_batch} fits"
        return (f"auto: {self.rows} rows a device a step kept; the plan's largest fitting micro-batch is "
                f"{self.planned} in {human_bytes(self.budget)} ({self.source}); {probe}")  # fmt: skip


def check_batch_finder(args, engine: str) -> None:
    """A LAUNCH check: the finder where its probe is the run's step (the whole model on a device, a trainer that
    collates rows): else one line with what to pass."""
    if args.batch_rows is None:
        return
    memory_limit()  # the budget the probe will read, before the weights load
    sharded = engine != "replicated" or model_parallel_size() > 1 or pipeline_stages() > 1
    if sharded or launch_mesh().get("sp", 1) > 1 or launch_mesh().get("cp", 1) > 1:
        raise ConfigError(f"per_device_train_batch_size auto probes the whole model on one device (single device, "
                          f"DDP), and this launch shards it: pass the micro-batch `python -m toolkit plan recipes/"
                          f"{args.recipe_name}.py` gives for this config.")  # fmt: skip
    if task(args.data.task).tokenized_by_trainer:  # dpo, kto, grpo, rloo, reward
        raise ConfigError(f"per_device_train_batch_size auto probes rows as the collator batches them, and task "
                          f"{args.data.task} batches in TRL's own trainer: pass a number.")  # fmt: skip


def find_micro_batch(args, model: torch.nn.Module, train_rows, collator, work: Workload) -> BatchChoice:
    """Choose the micro-batch (see the module's docstring) and set it, with the accumulation, in the settings."""
    from accelerate.utils import find_executable_batch_size
    from accelerate.utils.memory import clear_device_cache

    training, rows = args.training, args.batch_rows
    sizes = [b for b in range(rows, 0, -1) if rows % b == 0]
    budget, source = memory_budget(training.world_size)
    planned = planner(args, model, work)
    start = next((b for b in sizes if planned(b).device_total <= budget), 1)
    device = training.device
    if next(model.parameters()).device != device:
        model.to(device)  # where the Trainer puts a whole model
    longest = sorted(range(len(train_rows)), key=lambda i: -len(train_rows[i]["input_ids"]))
    tried: list[tuple[int, int | None]] = []

    def halved() -> int:
        return next((b for b in sizes if b <= tried[-1][0] // 2), 0)

    def check(batch_size: int) -> int:
        tried.append((batch_size, None))
        not_probed = sum(planned(batch_size).device.get(k, 0) for k in NOT_PROBED)
        batch = collator(model_inputs(model, [train_rows[longest[i % len(longest)]] for i in range(batch_size)]))
        need = step_peak(model, batch, training) + not_probed
        tried[-1] = (batch_size, need)
        if need > budget:  # as the allocator words it: accelerate's find_executable_batch_size halves
            raise torch.OutOfMemoryError(f"the step at micro-batch {batch_size} needs {human_bytes(need)} of "
                                         f"{human_bytes(budget)}: out of memory.")  # fmt: skip
        return batch_size

    def fits(batch_size: int) -> bool:
        try:
            return check(batch_size) == batch_size
        except torch.OutOfMemoryError:
            clear_device_cache(garbage_collection=True)
            return False

    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            micro_batch = find_executable_batch_size(check, start, halved)()
            # Up again from a start that fits (a plan above the measured need): the divisors below the
            # smallest that did not fit, while they fit
            failed = min((b for b, need in tried if need is None or need > budget), default=rows + 1)
            for larger in sorted(b for b in sizes if micro_batch < b < failed):
                if not fits(larger):
                    break
                micro_batch = larger
            micro_batch = agreed(micro_batch)
    except RuntimeError as error:
        if "No executable batch size" not in str(error):
            raise
        raise ConfigError(
            f"per_device_train_batch_size auto: not even a micro-batch of 1 fits in "
            f"{human_bytes(budget)} ({source}): shorten --max_seq_length, turn on "
            "--activation_checkpointing, or pick a sharding config (`toolkit plan`)."
        ) from None
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
    choice = BatchChoice(rows, micro_batch, start, tuple(tried), budget, source)
    training.per_device_train_batch_size, training.gradient_accumulation_steps = micro_batch, choice.accumulation
    args.batch_choice = choice
    return choice


def memory_budget(processes: int) -> tuple[int, str]:
    """Bytes a device may use: TOOLKIT_MEMORY_LIMIT_GIB, or the device's memory less the headroom (a CPU's RAM
    shared by this node's processes)."""
    if (limit := memory_limit()) is not None:
        return limit, LIMIT
    if torch.cuda.is_available():
        return int(device_memory() * (1 - HEADROOM)), "the GPU's memory less a tenth"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    return int(device_memory() * (1 - HEADROOM) / max(local, 1)), "the host's RAM less a tenth, per process"


def memory_limit() -> int | None:
    """TOOLKIT_MEMORY_LIMIT_GIB in bytes, or None where it is unset; a value that is not a positive, finite number
    of GiB (`inf`, `nan`, `-1`, `70GB`) is one line."""
    if not (limit := os.environ.get(LIMIT, "").strip()):
        return None
    try:
        gib = float(limit)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ConfigError(f"{LIMIT}={limit!r} is not a positive number of GiB: unset it (the device's own memory), or "
                          "give one (say 70).")  # fmt: skip
    return int(gib * GIB)


def planner(args, model: torch.nn.Module, work: Workload):
    """The planned memory of this run at a micro-batch (the accumulation the rest of the rows)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    shape, _ = measured_shape(args, base.config, work)
    processes = args.training.world_size
    layout = Layout.replicated("ddp" if processes > 1 else "single", processes)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", processes))

    def planned(micro_batch: int):
        sized = replace(work, micro_batch=micro_batch, micro_batches=args.batch_rows // micro_batch)
        return plan_memory(shape, layout, sized, per_node, max(processes // per_node, 1))

    return planned


def model_inputs(model: torch.nn.Module, rows: list[dict]) -> list[dict]:
    """The rows with the columns the model takes, as the Trainer keeps them (its remove_unused_columns)."""
    forward = model.get_base_model().forward if hasattr(model, "get_base_model") else model.forward
    kept = set(inspect.signature(forward).parameters) | {"label", "labels", "label_ids"}
    return [{k: v for k, v in row.items() if k in kept} for row in rows]


def step_peak(model: torch.nn.Module, batch: dict, training) -> int:
    """The peak bytes of live tensors on the device over the training step's forward and backward, run as the
    Trainer runs them (autocast under mixed precision), the model's own tensors counted in."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.train()
    batch = {k: v.to(training.device) if hasattr(v, "to") else v for k, v in batch.items()}
    dtype = torch.bfloat16 if training.bf16 else torch.float16
    tracker = MemTracker()
    tracker.track_external(model)
    try:
        with tracker, torch.autocast(training.device.type, dtype=dtype, enabled=bool(training.bf16 or training.fp16)):
            model(**batch).loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
    peaks = tracker.get_tracker_snapshot("peak")
    return max((v.get("Total", 0) for d, v in peaks.items() if torch.device(d).type == training.device.type),
               default=0)  # fmt: skip


def agreed(micro_batch: int) -> int:
    """The smallest of the ranks' choices (each probed its own device)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return micro_batch
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([micro_batch], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())
