"""DeepSpeed's ZeRO start-up without importing its Muon optimizer, and with it torch's compiler, for a type check.

Before wrapping the optimizer, DeepSpeed asks `is_zero_supported_optimizer`, which first imports its Muon optimizer
to add that class to the supported list; that module compiles a kernel as it loads, importing torch._inductor:
~3 s of CPU on every rank, whatever the optimizer. An optimizer made from the Muon class has imported its module
already, so while that module is not imported the optimizer cannot be one, and the list without it gives the same
answer; once it is imported, DeepSpeed's own check runs. A 2-rank ZeRO-3 launch of the tiny Llama: 24.4 -> 20.6
CPU-s, 15.7 -> 13.4 s (2-core Zen 4). ZeRO-1/2 still import it, at their first gradient reduction (DeepSpeed's
second site, `DeepSpeedZeroOptimizer.average_tensor`, left as it is).
"""

from __future__ import annotations

import sys

from ..launch import env_flag
from .gate import Patch, Target

MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def install() -> None:
    from deepspeed.runtime import engine
    from deepspeed.runtime.zero import utils

    original = utils.is_zero_supported_optimizer
    if engine.is_zero_supported_optimizer is not original:  # installed already (the engine's name is replaced)
        return

    def is_zero_supported_optimizer(optimizer) -> bool:
        if MUON in sys.modules:  # a Muon optimizer may exist: DeepSpeed's own check
            return original(optimizer)
        return type(optimizer) in utils.ZERO_SUPPORTED_OPTIMIZERS

    engine.is_zero_supported_optimizer = is_zero_supported_optimizer  # the name the engine calls


PATCH = Patch(
    name="zero_muon",
    library="deepspeed",
    versions=("0.19", "0.20"),
    targets=(
        Target("deepspeed.runtime.engine:is_zero_supported_optimizer", ("optimizer",)),
        Target("deepspeed.runtime.zero.utils:ZERO_SUPPORTED_OPTIMIZERS"),
    ),
    needed=lambda: env_flag("ACCELERATE_USE_DEEPSPEED"),
    install=install,
    without="every ZeRO rank imports torch's compiler before its first step (~3 s of CPU)",
    delete_when="DeepSpeed imports its Muon optimizer only for a Muon run",
)
