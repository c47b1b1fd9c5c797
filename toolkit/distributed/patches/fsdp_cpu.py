"""FSDP on a machine without GPUs: make accelerate really shard instead of quietly running DDP.

accelerate maps every CPU job to `MULTI_CPU` (`PartialState._prepare_backend`) and `AcceleratorState` only
turns a job into FSDP when its type is a GPU-style multi-device one, so an FSDP config trains as plain DDP on
CPU. FSDP2 itself (`torch.distributed.fsdp.fully_shard`) runs on CPU over gloo, so we finish the decision
accelerate skipped: when the launch asked for FSDP, the job is multi-process, and no accelerator exists, the
state becomes FSDP with the plugin accelerate built from the config. That is all; everything else (wrapping,
sharded and full state dicts) is accelerate's and torch's own code. What cannot run on CPU runs as the nearest
real thing, with one warning line: FSDP1 configs as their FSDP2 equivalent, parameter offload switched off.

This is for tests and dry runs of a GPU config on a laptop; TOOLKIT_CPU_FSDP=0 turns it off. It is guarded by
tests/test_launch.py::test_fsdp_fallback_to_ddp_is_refused, which runs with it off and fails the day
accelerate handles FSDP on CPU itself (then delete this module).
"""

from __future__ import annotations

import os
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from .arguments import has_accelerator
from .strategy import StrategyMismatch, env_flag

_ORIGINAL_INIT = AcceleratorState.__init__


def needed() -> bool:
    enabled = os.environ.get("TOOLKIT_CPU_FSDP", "1") != "0"
    return enabled and env_flag("ACCELERATE_USE_FSDP") and not has_accelerator()


def enable() -> None:
    """Call before the Trainer builds its Accelerator. A no-op unless an FSDP launch runs without a GPU."""
    if not needed() or AcceleratorState.__init__ is not _ORIGINAL_INIT:
        return
    if os.environ.get("FSDP_VERSION", "1") != "2":
        _run_fsdp1_as_fsdp2()
    if env_flag("FSDP_OFFLOAD_PARAMS"):
        # Offloading pins host memory, which needs an accelerator; on CPU the parameters already live in RAM.
        _warn("fsdp_offload_params needs an accelerator: on CPU running the same FSDP config without offload.")
        os.environ["FSDP_OFFLOAD_PARAMS"] = "false"
    AcceleratorState.__init__ = _init_with_cpu_fsdp


def _warn(message: str) -> None:
    """One line per job, not per rank, and without a warnings-module source excerpt."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


# FSDP1 sharding strategies and the FSDP2 setting that does the same (reshard_after_forward).
_FSDP2_EQUIVALENT = {"FULL_SHARD": "true", "SHARD_GRAD_OP": "false"}


def _run_fsdp1_as_fsdp2() -> None:
    """FSDP1 over gloo needs device_id and no module-state sync, and its full-state-dict gather crashed on CPU:
    run the FSDP2 equivalent (same sharding, same checkpoints through accelerate), saying so."""
    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    if strategy not in _FSDP2_EQUIVALENT:
        nearest = "fsdp_hybrid.yaml (FSDP2 with a replicate x shard mesh)" if "HYBRID" in strategy else "ddp.yaml"
        raise StrategyMismatch(
            f"FSDP1 {strategy} needs GPUs and has no FSDP2 equivalent the toolkit can run on CPU; "
            f"use accelerate_configs/{nearest}."
        )
    _warn(f"FSDP1 needs a GPU: on CPU running its FSDP2 equivalent ({strategy}, same wrapping and checkpoints).")
    os.environ["FSDP_VERSION"] = "2"
    os.environ["FSDP_RESHARD_AFTER_FORWARD"] = _FSDP2_EQUIVALENT[strategy]
    for fsdp1_only in ("FSDP_SHARDING_STRATEGY", "FSDP_BACKWARD_PREFETCH", "FSDP_FORWARD_PREFETCH",
                       "FSDP_USE_ORIG_PARAMS", "FSDP_SYNC_MODULE_STATES"):  # fmt: skip
        os.environ.pop(fsdp1_only, None)  # else accelerate warns about each, or refuses (forward prefetch)


def _init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _ORIGINAL_INIT(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
        # What AcceleratorState.__init__ does for GPU-style types when ACCELERATE_USE_FSDP is set.
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        self.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
