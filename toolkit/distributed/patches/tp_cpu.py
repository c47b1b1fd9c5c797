"""Tensor (and expert) parallelism on a machine without GPUs: let accelerate accept a model-parallel mesh over gloo.

A model sharded at load by transformers (`from_pretrained(distributed_config=DistributedConfig(tp_size=N))`)
owns its placement and gradient reduction; the Trainer then only asks accelerate for autocast, the optimizer and
the data loaders, which accelerate shards by the mesh's data-parallel ranks. accelerate's
`ParallelismConfig._validate_accelerator` refuses any mesh unless the job's type is a GPU-style multi-device
one, and a CPU job is `MULTI_CPU`: the check is all that stands between a CPU and a real TP run. On CPU only,
the check runs as if the job were multi-device; everything else is accelerate's, transformers' and torch's own.

For tests and dry runs of a GPU config on a laptop; TOOLKIT_CPU_TP=0 turns it off.
"""

from __future__ import annotations

import os

from ...settings.mesh import launch_mesh, model_parallel_size
from ...settings.parser import has_accelerator
from .gate import Patch, Target

_original = None  # ParallelismConfig._validate_accelerator as accelerate defines it, once installed


def needed() -> bool:
    sharded_at_load = model_parallel_size() > 1 or "ep" in launch_mesh()  # EP: accelerate is given dp_shard alone
    return os.environ.get("TOOLKIT_CPU_TP", "1") != "0" and sharded_at_load and not has_accelerator()


class _AsMultiDevice:
    """The accelerator as the check sees it: a multi-device job (gloo instead of NCCL)."""

    multi_device = True

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def install() -> None:
    global _original
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    if _original is not None:
        return
    _original = ParallelismConfig._validate_accelerator

    def validate(self, accelerator):
        if accelerator.distributed_type == DistributedType.MULTI_CPU:
            accelerator = _AsMultiDevice(accelerator)
        return _original(self, accelerator)

    ParallelismConfig._validate_accelerator = validate


PATCH = Patch(
    name="tp_cpu",
    library="accelerate",
    versions=("1.15", "1.16"),
    targets=(Target("accelerate.parallelism_config:ParallelismConfig._validate_accelerator", ("self", "accelerator")),),
    needed=needed,
    install=install,
    without="tensor-parallel configs cannot run on a machine without GPUs (accelerate refuses MULTI_CPU)",
    delete_when="accelerate accepts a model-parallel mesh on MULTI_CPU",
)
