"""FSDP on a machine without GPUs: make accelerate really shard instead of quietly running DDP.

accelerate maps every CPU job to `MULTI_CPU` (`PartialState._prepare_backend`) and `AcceleratorState` only
turns a job into FSDP when its type is a GPU-style multi-device one, so an FSDP config trains as plain DDP on
CPU. FSDP2 itself (`torch.distributed.fsdp.fully_shard`) runs on CPU over gloo, so we finish the decision
accelerate skipped: when the launch asked for FSDP, the job is multi-process, and no accelerator exists, the
state becomes FSDP with the plugin accelerate built from the config. That is all; everything else (wrapping,
sharded and full state dicts) is accelerate's and torch's own code. What cannot run on CPU runs as the nearest
real thing, with one warning line: FSDP1 configs as their FSDP2 equivalent, parameter offload switched off.

This is for tests and dry runs of a GPU config on a laptop; TOOLKIT_CPU_FSDP=0 turns it off.
tests/test_launch.py::test_fsdp_fallback_to_ddp_is_refused runs with it off and fails the day accelerate
handles FSDP on CPU itself (then delete this module).
"""

from __future__ import annotations

import os

from ...errors import warn
from ...settings.parser import has_accelerator
from ..launch import env_flag
from .gate import Patch, Target

_original_init = None  # AcceleratorState.__init__ as accelerate defines it, once installed


def needed() -> bool:
    enabled = os.environ.get("TOOLKIT_CPU_FSDP", "1") != "0"
    return enabled and env_flag("ACCELERATE_USE_FSDP") and not has_accelerator()


def install() -> None:
    """Before the Trainer builds its Accelerator: the state it builds becomes FSDP on CPU."""
    global _original_init
    from accelerate.state import AcceleratorState

    if _original_init is not None:
        return
    if os.environ.get("FSDP_VERSION", "1") != "2":
        _run_fsdp1_as_fsdp2()
    if env_flag("FSDP_OFFLOAD_PARAMS"):
        # Offloading pins host memory, which needs an accelerator; on CPU the parameters already live in RAM.
        warn("fsdp_offload_params needs an accelerator: on CPU running the same FSDP config without offload.")
        os.environ["FSDP_OFFLOAD_PARAMS"] = "false"
    _original_init = AcceleratorState.__init__
    AcceleratorState.__init__ = _init_with_cpu_fsdp


# FSDP1 sharding strategies and the FSDP2 setting that does the same (reshard_after_forward).
_FSDP2_EQUIVALENT = {"FULL_SHARD": "true", "SHARD_GRAD_OP": "false"}


def _run_fsdp1_as_fsdp2() -> None:
    """FSDP1 over gloo needs device_id and no module-state sync, and its full-state-dict gather crashed on CPU:
    run the FSDP2 equivalent (same sharding, same checkpoints through accelerate), saying so."""
    from ..strategy import StrategyMismatch

    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    if strategy not in _FSDP2_EQUIVALENT:
        nearest = "fsdp_hybrid.yaml (FSDP2 with a replicate x shard mesh)" if "HYBRID" in strategy else "ddp.yaml"
        raise StrategyMismatch(
            f"FSDP1 {strategy} needs GPUs and has no FSDP2 equivalent the toolkit can run on CPU; "
            f"use accelerate_configs/{nearest}."
        )
    warn(f"FSDP1 needs a GPU: on CPU running its FSDP2 equivalent ({strategy}, same wrapping and checkpoints).")
    os.environ["FSDP_VERSION"] = "2"
    os.environ["FSDP_RESHARD_AFTER_FORWARD"] = _FSDP2_EQUIVALENT[strategy]
    for fsdp1_only in ("FSDP_SHARDING_STRATEGY", "FSDP_BACKWARD_PREFETCH", "FSDP_FORWARD_PREFETCH",
                       "FSDP_USE_ORIG_PARAMS", "FSDP_SYNC_MODULE_STATES"):  # fmt: skip
        os.environ.pop(fsdp1_only, None)  # else accelerate warns about each, or refuses (forward prefetch)


def _init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
        # What AcceleratorState.__init__ does for GPU-style types when ACCELERATE_USE_FSDP is set.
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        self.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


PATCH = Patch(
    name="fsdp_cpu",
    library="accelerate",
    versions=("1.15", "1.16"),
    targets=(
        Target("accelerate.state:AcceleratorState.__init__",
               ("self", "mixed_precision", "cpu", "dynamo_plugin", "deepspeed_plugin", "fsdp_plugin",
                "torch_tp_plugin", "megatron_lm_plugin", "parallelism_config", "_from_accelerator", "kwargs")),
        Target("accelerate.state:PartialState._shared_state"),
        Target("accelerate.utils:FullyShardedDataParallelPlugin.set_mixed_precision",
               ("self", "mixed_precision", "buffer_autocast", "override")),
    ),
    needed=needed,
    install=install,
    without="FSDP configs cannot shard on a machine without GPUs (the launch is refused, see strategy.py)",
    delete_when="accelerate runs FSDP on CPU itself",
)  # fmt: skip
