"""FSDP1 resumes where it stopped: its fp32 weights and its optimizer state, which accelerate 1.15 loads wrong.

accelerate upcasts a bf16 model's flat parameters to fp32 after wrapping, but the original parameters (what
`state_dict`, `load_state_dict` and the optimizer see) stay the bf16 tensors they were until FSDP's first forward
points them at the flat parameters. A resume loads before any forward: the checkpoint's fp32 weights went into those
bf16 tensors (rounded; the first forward writes them back) and, with no forward yet, the moments would load in bf16
beside fp32 parameters. So before each load this patch writes the parameters back and points them at their flat
parameters, as FSDP's forward does: the weights load into the fp32 flat parameters, exactly.

Then the optimizer: accelerate's `load_fsdp_optimizer` builds the template that `torch.distributed.checkpoint.load`
fills from the optimizer it is given, and DCP loads only the keys a template has. A resuming Trainer hands it a
fresh optimizer with no state, so under FSDP1 with SHARDED_STATE_DICT (accelerate_configs/fsdp.yaml) no moments
loaded and AdamW restarted from zero, silently (found on an H100 by `make gpu-check`). FSDP2's path first gives the
optimizer its state with a zero-learning-rate step (torch's `_init_optim_state`); this patch does the same for FSDP1.
(Its first version pointed the parameters without writing them back first: the weights just loaded were dropped
and the run resumed from its initial weights, found on an H200 by the same check.)
tests/test_patches.py::test_fsdp1_sharded_resume_loads_weights_and_optimizer_state runs FSDP1 itself on CPU.
Delete this module the day accelerate points the parameters at the upcast flat parameters and gives the optimizer
its state itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..launch import env_flag
from .gate import Patch, Target

_originals: dict[str, Callable] = {}  # accelerate's load_fsdp_model and load_fsdp_optimizer


def point_at_flat_parameters(fsdp_plugin, model) -> None:
    """An FSDP1 model's parameters as views of its (upcast) flat parameters, any change to them written back first."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if fsdp_plugin.fsdp_version != 1:
        return
    for module in FSDP.fsdp_modules(model):
        if module._handle is not None:
            module._handle._writeback_orig_params()
            module._handle._use_sharded_views()


def load_fsdp_model(fsdp_plugin, accelerator, model, *args, **kwargs):
    """accelerate's function, into the fp32 flat parameters."""
    point_at_flat_parameters(fsdp_plugin, model)
    return _originals["load_fsdp_model"](fsdp_plugin, accelerator, model, *args, **kwargs)


def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, *args, **kwargs):
    """accelerate's function, after giving an FSDP1 optimizer the state the checkpoint holds values for."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    if fsdp_plugin.fsdp_version == 1:
        point_at_flat_parameters(fsdp_plugin, model)
        _init_optim_state(getattr(optimizer, "optimizer", optimizer))  # accelerate's wrapper steps only when synced
    return _originals["load_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, *args, **kwargs)


def needed() -> bool:
    return env_flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") == "1"


def install() -> None:
    """Before the Trainer resumes: transformers' Trainer and accelerate's load_state call the functions by name."""
    import accelerate.accelerator
    import accelerate.utils.fsdp_utils as fsdp_utils
    import transformers.trainer

    for name, function in (("load_fsdp_model", load_fsdp_model), ("load_fsdp_optimizer", load_fsdp_optimizer)):
        _originals.setdefault(name, getattr(fsdp_utils, name))
        for module in (fsdp_utils, accelerate.accelerator, transformers.trainer):
            setattr(module, name, function)


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
        Target(
            "accelerate.utils.fsdp_utils:load_fsdp_model",
            ("fsdp_plugin", "accelerator", "model", "input_dir", "model_index", "adapter_only", "use_dcp"),
        ),
        Target("accelerate.accelerator:load_fsdp_optimizer"),
        Target("accelerate.accelerator:load_fsdp_model"),
        Target("transformers.trainer:load_fsdp_model"),
        Target("transformers.trainer:load_fsdp_optimizer"),
        Target("torch.distributed.checkpoint.state_dict:_init_optim_state", ("optim",)),
        Target("torch.distributed.fsdp._flat_param:FlatParamHandle._writeback_orig_params", ("self",)),
        Target("torch.distributed.fsdp._flat_param:FlatParamHandle._use_sharded_views", ("self",)),
    ),  # fmt: skip
    needed=needed,
    install=install,
    without="an FSDP1 resume from a sharded checkpoint starts AdamW's moments from zero, its weights rounded to bf16",
    delete_when="accelerate loads FSDP1 checkpoints into the upcast flat parameters and gives the optimizer its state",
)
