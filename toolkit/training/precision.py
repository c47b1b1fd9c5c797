"""fp32 master weights for 16-bit trainable weights: the standard of mixed-precision training (Micikevicius et al.
2018, "Mixed Precision Training"): compute in 16 bits, keep and update the weights in fp32. An AdamW update at a
fine-tuning learning rate (2e-5) is below bf16's resolution for most weights (8 bits of mantissa: a weight of 0.02
moves in steps of 1.2e-4), so 16-bit weights updated in place lose most updates (measured on SmolLM2-135M:
docs/recipes.md).

Who keeps them, as each engine does:
  DeepSpeed   its bf16/fp16 optimizer: 16-bit weights, fp32 masters and gradients in the optimizer's partition.
  FSDP        accelerate upcasts the trainable weights to fp32 at preparation; the mixed-precision policy
              gathers them in 16 bits for compute (fp32 shards are the masters).
  single/DDP  (and tensor parallelism) no engine: the trainer, here. bf16: the weights stay bf16 for compute (no
              per-forward casts, a bf16 residual stream) and `MasterWeights` gives the optimizer fp32 copies: each
              step takes the bf16 gradients in fp32, updates the masters and writes them back rounded to bf16, as
              FSDP2's policy computes (a bf16 copy of fp32 masters). The masters travel in the optimizer's state
              dict, so a resume continues from them exactly. fp16: torch's automatic mixed precision (fp32 weights,
              fp16 autocast), since its GradScaler unscales fp32 gradients only.
torchao's optimizers round bf16 weights stochastically instead of keeping masters, and DeepSpeed's bf16 optimizer
runs inside its engine only: neither serves a model the Trainer steps itself.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import warn

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
STATE_KEY = "toolkit_master_weights"  # the optimizer state dict's entry: the fp32 masters, in parameter order


class MasterWeights:
    """Trainer part: fp32 copies of the trainable bf16 weights, held by the optimizer in their place. `attach`
    (when the Trainer has made its optimizer) swaps each weight for its master in the optimizer's parameter groups
    and hooks its step and its state dict."""

    def __init__(self, weights: list[torch.Tensor]):
        self.weights = weights  # the compute weights, then (attached) in the masters' order
        self.masters: list[torch.Tensor] = []
        self.loaded: list[torch.Tensor] | None = None  # masters read from a state dict, until restored

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        mastered = {id(w) for w in self.weights}
        self.weights, self.masters, self.loaded = [], [], None
        for group in optimizer.param_groups:
            for i, weight in enumerate(group["params"]):
                if id(weight) in mastered:  # DTensor shards (tensor parallelism) stay DTensors, in fp32
                    group["params"][i] = master = weight.detach().to(torch.float32)
                    self.weights.append(weight)
                    self.masters.append(master)
        optimizer.register_step_pre_hook(lambda *_: self.take_gradients())
        optimizer.register_step_post_hook(lambda *_: self.write_back())
        optimizer.register_state_dict_post_hook(self.add_to_state_dict)
        optimizer.register_load_state_dict_pre_hook(self.take_from_state_dict)
        optimizer.register_load_state_dict_post_hook(lambda *_: self.restore())

    def take_gradients(self) -> None:
        """Before clipping (the trainer's _clip_grad_norm) and the step: each bf16 gradient as its master's fp32
        gradient, the bf16 one freed as it goes (the step holds fp32 gradients where backward held bf16 ones), so
        the norm and the clipping are computed in fp32, as under FSDP2. A second call finds nothing left to take."""
        for weight, master in zip(self.weights, self.masters, strict=True):
            if weight.grad is not None:
                master.grad = weight.grad.to(torch.float32)
                weight.grad = None

    def write_back(self) -> None:
        """After the step: the updated masters, rounded to bf16, are the weights the next forward computes with."""
        copy(self.weights, self.masters)
        for master in self.masters:
            master.grad = None

    def add_to_state_dict(self, optimizer, state_dict: dict) -> dict:
        state_dict[STATE_KEY] = [m.detach() for m in self.masters]
        return state_dict

    def take_from_state_dict(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        self.loaded = state_dict.pop(STATE_KEY, None)
        return state_dict

    def restore(self) -> None:
        """A resumed optimizer continues from the saved masters; a state dict without them (another tool's) from
        the weights as loaded."""
        copy(self.masters, self.loaded if self.loaded is not None else self.weights)
        copy(self.weights, self.masters)
        self.loaded = None


@torch.no_grad()
def copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i] = sources[i], cast to the target's dtype: one fused call for plain tensors, one at a time for
    tensor subclasses (tensor parallelism's DTensor shards, torchao's float8 weights)."""
    sources = [s.to(t.device) for t, s in zip(targets, sources, strict=True)]
    if all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in targets + sources):
        torch._foreach_copy_(targets, sources)
    else:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)


@contextlib.contextmanager
def fp32_kept(model: torch.nn.Module, cast: bool):
    """Around a step of TRL's that casts the whole model to the run's 16-bit dtype (`cast`: its continuous-batching
    sampler, `unwrapped_model.to(torch.bfloat16)` in GRPOTrainer and RLOOTrainer): the trainable fp32 weights (a LoRA
    adapter, which peft keeps in fp32: the masters of its updates) get their own fp32 tensors back afterwards,
    unrounded; the sampling computed with the 16-bit copy. Without it every update after the first sampling was a
    bf16 one, and the export bf16."""
    kept = [(p, p.data, None if p.grad is None else p.grad.data) for p in model.parameters()
            if cast and p.requires_grad and p.dtype == torch.float32]  # fmt: skip
    try:
        yield
    finally:
        for weight, data, grad in kept:
            if weight.dtype != data.dtype:
                weight.data = data
                if grad is not None and weight.grad is not None:
                    weight.grad.data = grad


def keep_master_weights(trainer, setting: bool | None) -> tuple[MasterWeights | None, str]:
    """Master weights for trainable 16-bit weights where no engine keeps them (`setting`: --fp32_master_weights,
    None for the default): the part that keeps them (None where nothing is left to do here), and what is in
    effect, for the run header."""
    from accelerate.utils import DistributedType

    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    sixteen = [p for p in trainable if p.dtype in SIXTEEN_BIT]
    if not sixteen:
        return None, ""
    kind = trainer.accelerator.distributed_type
    args = trainer.args
    mixed = args.bf16 or args.fp16
    if kind == DistributedType.DEEPSPEED:
        return None, "fp32 master weights in DeepSpeed's optimizer"
    if kind == DistributedType.FSDP and mixed:
        if getattr(args, "mixed_precision", None) == "fp8":
            # Upcast now, while the weights are plain tensors: accelerate first wraps the float8 layers' weights
            # (torchao's WeightWithDynamicFloat8CastTensor), and its upcast (`param.data = param.data.to(fp32)`)
            # then changes only the wrapper's dtype, not the weight inside; FSDP2 fails on the mixed dtypes.
            for p in sixteen:
                p.data = p.data.float()
        return None, "fp32 master weights (FSDP: accelerate upcasts the shards, compute in 16 bits)"
    if kind != DistributedType.FSDP and mixed and setting is not False:
        if args.fp16:  # GradScaler unscales fp32 gradients only: automatic mixed precision's fp32 weights
            for p in sixteen:
                p.data = p.data.float()
            return None, "fp32 master weights, fp16 compute (autocast)"
        return MasterWeights(sixteen), "bf16 weights and compute, fp32 master weights in the optimizer step"
    warn(f"{sum(p.numel() for p in sixteen):,} trainable weights train in {sixteen[0].dtype} without fp32 master "
         "weights: updates below its resolution are lost (most of them at a fine-tuning learning rate). Pass --bf16 "
         "true to keep fp32 masters and compute in bf16.")  # fmt: skip
    return None, "no master weights: 16-bit updates"
