"""An image-text model's image path: what its vision tower and projector cost per image, measured on the
architecture itself at full size without computing anything.

The tower runs once per image, before the decoder, over the image's patches: its weights are passed through by
patches, not by the text tokens the rest of the plan counts per token. The run's model (its parts trained or frozen,
its LoRA adapters) is built on the meta device, made fake tensors (torch's FakeTensorMode: shapes and dtypes, no
storage, no arithmetic; the CPU's kernels are chosen, sdpa's fused one among them), and one image goes through
`get_image_features` as a training forward sends it:
  - the bytes autograd saves for backward: none in a frozen tower, the input of a trained projector, every layer's
    tensors in a trained tower, or with activation checkpointing each tower layer's input instead;
  - the FLOPs of that forward and of its backward (torch's FlopCounterMode; the backward is run, so only the
    gradients the run computes are counted).
One image is one input at the tower's own size (vision_config.image_size, square, as SigLIP's, CLIP's and
InternViT's processors resize to). A tower that takes images of any size (the Qwen2-VL family's) is not measured,
and the plan says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from ..models.meta import meta_model
from ..models.vision import image_encoder, model_parts
from .activations import cached, mixed, saved_bytes

VERSION = 5  # bump when the measurement changes: the cache key includes it


@dataclass(frozen=True)
class ImageCost:
    """Per image: bytes saved for backward (without and with activation checkpointing) and FLOPs; the image
    path's parameters (tower and projector), which FLOPs per text token leave out."""

    saved_bytes: int
    checkpointed_bytes: int
    layer_bytes: int  # the largest tower layer's, recomputed in its backward under activation checkpointing
    forward_flops: int
    backward_flops: int
    parameters: int
    trainable: int
    image: str  # the image measured, "896x896"
    per_sample: float = 1.0  # images a training row holds, on average

    def saved(self, checkpointing: bool) -> int:
        return self.checkpointed_bytes if checkpointing else self.saved_bytes

    @property
    def flops_per_sample(self) -> float:
        return self.per_sample * (self.forward_flops + self.backward_flops)

    @property
    def note(self) -> str:
        trained = ("frozen: forward only" if not self.trainable else "trained" if self.trainable == self.parameters
                   else f"{self.trainable:,} of its {self.parameters:,} parameters trained")  # fmt: skip
        return (f"measured per {self.image} image ({self.per_sample:g} a row): "
                f"{self.forward_flops / 1e12:.3g} TFLOP forward, image path {trained}")  # fmt: skip


def _tensors(output) -> list[torch.Tensor]:
    """The image features `get_image_features` returns, as a list: a tensor, a list of them (one per image), or a
    model output whose pooled features are the projected ones."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    pooled = getattr(output, "pooler_output", None)
    return _tensors(pooled if pooled is not None else output[0])


def _features(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    """One image through the image path: a batch of one image, else (Idefics3) a batch of one row of images."""
    try:
        return _tensors(model.get_image_features(**inputs))
    except (RuntimeError, ValueError, TypeError, IndexError):
        return _tensors(model.get_image_features(pixel_values=inputs["pixel_values"].unsqueeze(0)))


def image_inputs(config, dtype: torch.dtype) -> tuple[dict, str]:
    """One image as the tower takes it, and its size in words: a square at the tower's image_size (SigLIP, CLIP,
    InternViT). A tower that takes any size (the Qwen2-VL family's patches with their grid, whose values it reads
    to lay them out, which fake tensors cannot) has no one image to plan: ValueError."""
    channels = getattr(config, "num_channels", None) or getattr(config, "in_channels", None) or 3
    size = getattr(config, "image_size", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    if not isinstance(size, int):
        raise ValueError(f"{type(config).__name__} takes images of any size, no one image to plan")
    return {"pixel_values": torch.empty(1, channels, size, size, dtype=dtype)}, f"{size}x{size}"


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """sdpa's FLOPs in the CPU's fused kernel, which FlopCounterMode does not count (its CUDA kernels it does)."""
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def measure(model: torch.nn.Module, dtype: torch.dtype, autocast: bool) -> ImageCost:
    """One image through `model`'s image path (a meta-device model, made fake tensors in place): ImageCost at
    per_sample 1."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs, image = image_inputs(base.config.vision_config, dtype if not autocast else torch.float32)
    parts = model_parts(base)
    names = set(parts["vision"] + parts["projector"])
    parameters = sum(p.numel() for name, p in base.named_parameters() if name in names)
    trainable = sum(p.numel() for name, p in base.named_parameters() if name in names and p.requires_grad)
    base.to(torch.float32 if autocast else dtype)  # the weights as the run holds them (not the config's dtype)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = base.to_empty(device="cpu")
        fake.train()
        inputs["pixel_values"] = mode.from_tensor(inputs["pixel_values"])
        saved, layer_inputs = _saved_by_layer(fake, inputs, dtype, autocast)
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
            with mixed(dtype, autocast):
                features = _features(fake, inputs)
            forward = counter.get_total_flops()
            trained = [f.float().sum() for f in features if f.requires_grad]
            if trained:
                sum(trained).backward()
            backward = counter.get_total_flops() - forward
    outside = saved.pop(None, 0)
    checkpointed = outside + sum(layer_inputs[i] for i, size in saved.items() if size)
    return ImageCost(saved_bytes=outside + sum(saved.values()), checkpointed_bytes=checkpointed,
                     layer_bytes=max(saved.values(), default=0), forward_flops=forward, backward_flops=backward,
                     parameters=parameters, trainable=trainable, image=image)  # fmt: skip


def _saved_by_layer(model, inputs: dict, dtype, autocast) -> tuple[dict, dict]:
    """Bytes saved for backward by each tower layer (None: outside them), once per storage (saved_bytes); and each
    layer's input's bytes (what activation checkpointing keeps of it)."""
    layers = max((m for m in image_encoder(model).modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    running: list = [None]
    sizes: dict[int, int] = {}

    def entering(index, module, args, kwargs):
        running[0] = index
        hidden = args[0] if args else next(iter(kwargs.values()))
        sizes[index] = hidden.untyped_storage().nbytes() if isinstance(hidden, torch.Tensor) else 0

    hooks = [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda m, a, k, i=i: entering(i, m, a, k), with_kwargs=True),
        layer.register_forward_hook(lambda m, a, o: running.__setitem__(0, None)))]  # fmt: skip
    try:
        with mixed(dtype, autocast):
            saved = saved_bytes(model, inputs, owner=lambda: running[0], forward=lambda: _features(model, inputs))
    finally:
        for hook in hooks:
            hook.remove()
    return saved, sizes


def measured_image_cost(config, task: str, lora: dict | None, parts: str, precision: str, autocast: bool,
                        per_sample: float = 1.0) -> tuple[ImageCost | None, str]:  # fmt: skip
    """The image path's cost for the run's model (its parts trained, or its LoRA adapters, as the run trains
    them), from the cache or measured now; (None, why) where it cannot be."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    lora = {**lora, "lora_dropout": 0.0} if lora else None
    key = [config.to_dict(), task, lora, parts, precision, autocast, VERSION]
    try:
        stored = cached(key, "image-", lambda: asdict(measure(meta_model(config, task, lora, parts), dtype, autocast)))
    except Exception as error:  # noqa: BLE001 - a family whose tower takes other inputs: say so, plan the rest
        said = str(error).splitlines()[0][:120] if str(error) else ""
        return None, f"not measured: {said if isinstance(error, ValueError) else f'{type(error).__name__}: {said}'}"
    cost = ImageCost(**{**stored, "per_sample": per_sample})
    return cost, cost.note
