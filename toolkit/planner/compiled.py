"""What `torch.compile` (and torchao's float8 under it) saves for backward, measured: the eager fit (activations.py)
scaled inside the layers and outside them by what compiled instances save.

AOTAutograd's partitioner keeps fewer tensors than eager autograd: it recomputes cheap elementwise results in the
backward (norms' products, activations' inputs, rotary products) and saves fused outputs instead of their parts.
It decides per operator, before any backend lowers the graph, so the bytes it saves scale with the instance as eager
autograd's do, and a CPU's inductor shows what a GPU's keeps for the same operators. Measured on the instances the
eager fit uses, 1 and 2 layers at its smaller width, at one input, eager and compiled (saved-tensor hooks fire
for the compiled graph's saves too): the layers' ratio from the difference of the two depths, the rest's from what
remains. A toy Llama's compiled bytes at another depth and shape are predicted within 0.2%
(tests/test_planner.py's compile test measures the run's model itself).

The instances compile with the `aot_eager_decomp_partition` backend: inductor's decompositions and its min-cut
partitioner, which decide what is saved, without generating kernels (the same bytes as inductor's to 0.01%, in a
third of the time, and no C++ compiler needed). FP8 (fsdp2_fp8.yaml): accelerate converts the linear layers to
torchao's Float8Linear (`convert_model_to_fp8_ao`, its default filter: not the first and last) before compile, and
the partitioner then saves the float8 casts of the layers' inputs where eager float8 saves the 16-bit ones (a toy
Llama in bf16: 0.36 of eager's bytes, against compile alone's 0.51).
"""

from __future__ import annotations

from functools import cache

import torch

from .activations import (
    LAYER_TERMS,
    LAYERS,
    ActivationFit,
    cached,
    fit_key,
    measure,
    measured_activations,
    scaled,
    width_ratios,
    with_experts_kernel,
)

INPUT = (2, 128)  # (micro-batch, sequence): the partitioner's choices do not depend on it; one compile each
BACKEND = "aot_eager_decomp_partition"


def compiler(fp8: bool):
    """The run's changes to the model: float8 linears (as accelerate converts them), then torch.compile."""

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        if fp8:
            from accelerate.utils.ao import convert_model_to_fp8_ao

            convert_model_to_fp8_ao(model)
        return torch.compile(model, backend=BACKEND)

    return prepare


def float8_linears(config, task: str, ratio: float) -> int:
    """The linear layers accelerate converts to float8 in a 2-layer instance at `ratio` width (on the meta device):
    its filter keeps widths that are multiples of 16, which a narrow instance may not have."""
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers

    from ..settings.tasks import model_class

    with torch.device("meta"):
        model = model_class(task).from_config(scaled(config, ratio, 2))
    edges = list(find_first_last_linear_layers(model))
    return sum(isinstance(m, torch.nn.Linear) and filter_linear_layers(m, name, edges)
               for name, m in model.named_modules())  # fmt: skip


def measured_ratio(config, task: str, fp8: bool) -> float:
    """The eager fit's smaller width, or under FP8 the smallest that converts the layers the model's own width
    does (else the instances would measure compile alone)."""
    smallest = width_ratios(config)[0]
    if not fp8:
        return smallest
    full = float8_linears(config, task, 1.0)
    candidates = [1 / k for k in (64, 32, 16, 8, 4, 2) if 1 / k >= smallest] + [1.0]
    return next(r for r in candidates if float8_linears(config, task, r) == full)


def ratios(config, task: str, dtype: torch.dtype, attention: str | None, fused_head: bool, lora: dict | None,
           autocast: bool, fp8: bool = False) -> dict[str, float]:  # fmt: skip
    """Compiled bytes over eager ones, for the bytes that scale with the width and those that do not, inside the
    layers and outside them: eight instances (two widths, two depths, eager and compiled) at one input."""
    r1 = measured_ratio(config, task, fp8)
    r2 = min(2 * r1, 1.0) if r1 < 1 else 0.5
    bytes_at: dict = {}
    try:
        for r in (r1, r2):
            for layers in LAYERS:
                args = (config, task, dtype, attention, r, layers, [INPUT], fused_head, lora, autocast)
                bytes_at[r, layers] = (measure(*args)[0], measure(*args, prepare=compiler(fp8))[0])
                torch._dynamo.reset()  # each instance is a new module: its graphs freed, not counted against the limit
    finally:
        torch._dynamo.reset()
    out = {}
    for kind in (0, 1):  # eager, compiled
        inside = [bytes_at[r, 2][kind] - bytes_at[r, 1][kind] for r in (r1, r2)]
        outside = [2 * bytes_at[r, 1][kind] - bytes_at[r, 2][kind] for r in (r1, r2)]
        for part, (x1, x2) in (("inside", inside), ("outside", outside)):
            slope = (x2 - x1) / (r2 - r1)  # bytes = slope x width ratio + constant
            out[part, kind] = (slope, x1 - slope * r1)
    found = {}
    for part in ("inside", "outside"):
        (eager_slope, eager_constant), (slope, constant) = out[part, 0], out[part, 1]
        whole = (
            (slope * r2 + constant) / (eager_slope * r2 + eager_constant)
            if eager_slope * r2 + eager_constant > 0
            else 1.0
        )
        found[f"{part}_width"] = slope / eager_slope if eager_slope > 0 else whole
        found[f"{part}_fixed"] = constant / eager_constant if eager_constant > 0 else whole
    return {k: max(v, 0.0) for k, v in found.items()}


def planned_activations(config, task: str, precision: str, flash_attention: bool, fused_head: bool = False,
                        lora: dict | None = None, autocast: bool = False, compiled: bool = False,
                        fp8: bool = False, experts: str | None = None) -> tuple[ActivationFit | None, str]:  # fmt: skip
    """activations.py's measured fit and its note (a mixture of experts' with the run's `experts` kernel), scaled for
    a run that compiles the model (`fp8`: with torchao's float8 linears)."""
    config = with_experts_kernel(config, experts)
    fit, note = measured_activations(config, task, precision, flash_attention, fused_head, lora, autocast)
    if not compiled or fit is None:
        return fit, note
    key, dtype, attention, lora = fit_key(config, task, precision, flash_attention, fused_head, lora, autocast)
    return under_compile(fit, key, config, task, dtype, attention, fused_head, lora, autocast, fp8)


def under_compile(fit: ActivationFit, key: list, config, task: str, dtype: torch.dtype, attention: str | None,
                  fused_head: bool, lora: dict | None, autocast: bool,
                  fp8: bool = False) -> tuple[ActivationFit, str]:  # fmt: skip
    """The eager fit scaled by the compiled instances' ratios (cached), and its note; the eager fit, with why,
    where they cannot be measured (an upper bound: compile saves less)."""
    if fit.largest_layer:
        return fit, f"{fit.note}; compile's savings not measured for layers that differ (an upper bound)"
    try:
        found = cached([*key, "compiled", BACKEND, fp8, 2], "compiled-",
                       lambda: ratios(config, task, dtype, attention, fused_head, lora, autocast, fp8))  # fmt: skip
    except Exception as error:  # noqa: BLE001 - no compiler, an operator dynamo cannot trace: the eager bound
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}" if str(error) else type(error).__name__
        return fit, f"{fit.note}; compile's savings not measured ({why}: an upper bound)"
    # features' order (activations.py): per part [r s, s, r s², s², r, 1] (outside: per sample, then shared)
    scale = [found["inside_width" if i % 2 == 0 else "inside_fixed"] for i in range(LAYER_TERMS)]
    scale += [
        found["outside_width" if i % 2 == 0 else "outside_fixed"] for i in range(len(fit.coefficients) - LAYER_TERMS)
    ]
    coefficients = tuple(c * k for c, k in zip(fit.coefficients, scale, strict=True))
    inside, outside = found["inside_width"], found["outside_width"]
    under = "torch.compile with float8 linears" if fp8 else "torch.compile"
    note = (f"{fit.note}; under {under} x{inside:.2f} inside the layers and x{outside:.2f} outside them, "
            "measured on compiled instances")  # fmt: skip
    return ActivationFit(coefficients, fit.ratios, fit.largest_layer, compiled=True), note


REFERENCE_FP8_MODEL = "meta-llama/Meta-Llama-3-8B"  # the dense 8B model torchao's published speed-up was measured on


def float8_share(config, task: str) -> float:
    """The share of a token's matmul FLOPs that run in the linears accelerate converts to float8 (its default
    filter, on a meta-device instance of the model's own size): a dense model's are nearly all of them; a mixture
    of experts' fused experts are 3-D parameters, not linear layers, so they stay in 16 bits, and experts held as a
    list of linears count by the share of tokens routed to each."""
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers

    from ..settings.tasks import model_class
    from .shape import Shape

    with torch.device("meta"):
        model = model_class(task).from_config(config)
    shape = Shape.of(model, config)
    text = config.get_text_config()
    routed = (getattr(text, "num_experts_per_tok", None) or 1) / (shape.experts_per_layer or 1)
    edges = list(find_first_last_linear_layers(model))
    converted = sum(m.weight.numel() * (routed if ".experts." in f".{name}." else 1)
                    for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and filter_linear_layers(m, name, edges))  # fmt: skip
    return converted / max(shape.active - shape.lookups, 1)


def float8_speedup(share: float, end_to_end: float) -> float:
    """The FP8 run's throughput over bf16 for a model whose float8 linears run `share` of its FLOPs: `end_to_end`
    (torchao's published figure) holds for the reference dense 8B model, whose share sets the gain on a converted
    FLOP (Amdahl); the model's own share then gives its speed-up (a mixture of experts, its experts unconverted,
    gains far less)."""
    return 1 / ((1 - share) + share / converted_flop_gain(end_to_end))


@cache
def converted_flop_gain(end_to_end: float) -> float:
    """The gain on a FLOP in a float8 linear that gives the reference model `end_to_end` (Amdahl's law)."""
    from ..data.sources import stored_config

    reference = float8_share(stored_config(REFERENCE_FP8_MODEL), "sft")
    return reference / (1 / end_to_end - (1 - reference))
