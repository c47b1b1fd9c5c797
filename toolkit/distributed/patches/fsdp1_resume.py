"""FSDP1 resumes with its optimizer state: accelerate loads none of it from a sharded checkpoint.

accelerate's `load_fsdp_optimizer` builds the template that `torch.distributed.checkpoint.load` fills from the
optimizer it is given (`FSDP.optim_state_dict(model, optimizer)`), and DCP loads only the keys a template has.
A Trainer resuming a run hands it a fresh optimizer, with no state yet, so under FSDP1 with SHARDED_STATE_DICT
(accelerate_configs/fsdp.yaml) the template has no moments and none are loaded: the run goes on with AdamW's
moments reset, silently (found on an H100 by `make gpu-check`: the losses after a resume left the uninterrupted
run's from the second step). FSDP2's path asks `get_optimizer_state_dict`, which first gives the optimizer its
state with a zero-learning-rate step (torch's `_init_optim_state`); this patch does the same for FSDP1 before
accelerate builds its template. First it points the parameters at their flat parameters, as each forward does:
accelerate upcasts a bf16 model's flat parameters to fp32 after wrapping, and until the first forward the
parameters the optimizer holds are still bf16 views, so the state would load in bf16 beside fp32 parameters (seen
on the H100: "Tensors of the same index must be on the same device and the same dtype" at the first step).
tests/test_patches.py::test_fsdp1_sharded_optimizer_state_survives_a_resume runs FSDP1 itself on CPU. Delete this
module the day accelerate gives the optimizer its state itself.
"""

from __future__ import annotations

import os

from ..launch import env_flag
from .gate import Patch, Target

_original = None  # accelerate's load_fsdp_optimizer


def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, *args, **kwargs):
    """accelerate's function, after giving an FSDP1 optimizer the state the checkpoint holds values for."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if fsdp_plugin.fsdp_version == 1:
        for module in FSDP.fsdp_modules(model):
            if module._handle is not None:
                module._handle._use_sharded_views()  # fp32 views of the upcast flat parameters, as after a forward
        _init_optim_state(getattr(optimizer, "optimizer", optimizer))  # accelerate's wrapper steps only when synced
    return _original(fsdp_plugin, accelerator, optimizer, model, *args, **kwargs)


def needed() -> bool:
    return env_flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") == "1"


def install() -> None:
    """Before the Trainer resumes: transformers' Trainer and accelerate's load_state call the function by name."""
    global _original
    import accelerate.accelerator
    import accelerate.utils.fsdp_utils as fsdp_utils
    import transformers.trainer

    if _original is None:
        _original = fsdp_utils.load_fsdp_optimizer
    for module in (fsdp_utils, accelerate.accelerator, transformers.trainer):
        module.load_fsdp_optimizer = load_fsdp_optimizer


PATCH = Patch(
    name="fsdp1_resume",
    library="accelerate",
    versions=("1.15", "1.16"),
    targets=(
        Target(
            "accelerate.utils.fsdp_utils:load_fsdp_optimizer",
            (
                "fsdp_plugin",
                "accelerator",
                "optimizer",
                "model",
                "input_dir",
                "optimizer_index",
                "adapter_only",
                "use_dcp",
            ),
        ),
        Target("accelerate.accelerator:load_fsdp_optimizer"),
        Target("transformers.trainer:load_fsdp_optimizer"),
        Target("torch.distributed.checkpoint.state_dict:_init_optim_state", ("optim",)),
        Target("torch.distributed.fsdp._flat_param:FlatParamHandle._use_sharded_views", ("self",)),
    ),  # fmt: skip
    needed=needed,
    install=install,
    without="an FSDP1 run resumed from a sharded checkpoint starts AdamW's moments from zero",
    delete_when="accelerate's load_fsdp_optimizer gives an FSDP1 optimizer its state before building the template",
)
