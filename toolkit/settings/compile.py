"""`--torch_compile auto` (the default): torch.compile where it was measured faster and proven to train, off
elsewhere, and why, for the run's header. Measured on one H100 (../shared/gpu/README.md, 2026-11-25, Llama-3.2-1B
shape, packed 4,096-token rows): the toolkit's defaults 37,759 tokens/s, with compile 47,756-50,777 (1.27x);
FP8 (torchao) without compile 17,312 (0.46x of bf16), with it 58,499-59,961 (1.26x of bf16 compile); Liger's
kernels on top of compile 46,550, slower than compile alone. Re-measured with these defaults on an H100
(docs/benchmarks.md, 2026-11-27): 53,114 tokens/s, 48.5% MFU, 1.59x the plain Trainer on the same work.
`bench/mfu.py` measures single-GPU settings; a setting it proves faster moves into `choose_compile`.
"""

from __future__ import annotations

from ..errors import ConfigError

AUTO = "auto"

FP8_WITHOUT_COMPILE = ("mixed_precision fp8 with --torch_compile false: torchao's float8 casts run as separate "
                       "kernels, measured at 0.46x of bf16's speed on an H100 (1.26x with compile): leave "
                       "--torch_compile at auto (or true), or train in bf16 with fsdp2.yaml.")  # fmt: skip


def choose_compile(setting: bool | str, *, fp8: bool, on_gpu: bool, processes: int, replicated: bool, lora: bool,
                   attention: str | None, liger: bool) -> tuple[bool, str]:  # fmt: skip
    """Whether to compile the model, and why. `setting`: --torch_compile (True, False, or "auto"); `replicated`:
    no sharding engine (single_gpu/DDP); `attention`: the kernel the run resolved. An explicit False under FP8 on
    a GPU is refused (FP8_WITHOUT_COMPILE)."""
    if setting != AUTO:
        if fp8 and on_gpu and not setting:
            raise ConfigError(FP8_WITHOUT_COMPILE)
        return bool(setting), ""
    if fp8:
        return True, "auto: FP8's float8 casts fuse only when compiled (H100: 0.46x of bf16 without, 1.26x with)"
    if not on_gpu:
        return False, "auto: no GPU (compile's speed-up is measured on GPUs)"
    if liger:
        return False, "auto: with Liger's kernels (compile + Liger measured slower than compile alone on an H100)"
    if processes == 1 and replicated and not lora and attention == "flex_attention":
        return True, "auto: single-GPU full fine-tune with flex attention, measured 1.27x on an H100"
    return False, "auto: not yet measured faster for this setting (--torch_compile true tries it)"


def asks_for_compile(setting: bool | str, backend: str | None, mode: str | None) -> bool | str:
    """--torch_compile as asked: a backend or a mode given beside `auto` asks for compile (transformers' rule), which
    auto would otherwise turn off on a CPU."""
    return True if setting == AUTO and (backend is not None or mode is not None) else setting


def check_backend_and_mode(backend: str | None, mode: str | None) -> None:
    """--torch_compile_backend and --torch_compile_mode, which fail only once the Trainer builds accelerate's plugin or
    compiles the model: the backend one that accelerate passes on (DynamoBackend) and torch registers here, the mode
    one of inductor's."""
    if backend is not None:
        import torch._dynamo
        from accelerate.utils import DynamoBackend

        registered = set(torch._dynamo.list_backends(exclude_tags=None))
        known = [b.value.lower() for b in DynamoBackend if b.value.lower() in registered]
        if backend not in known:
            raise ConfigError(f"torch_compile_backend '{backend}' is not one torch.compile has here through accelerate "
                              f"({', '.join(known)}): pass --torch_compile_backend inductor, or leave it "
                              "unset.")  # fmt: skip
    if mode is not None:
        from torch._inductor import list_mode_options

        if mode not in list_mode_options():
            raise ConfigError(f"torch_compile_mode '{mode}' is not one of torch.compile's modes "
                              f"({', '.join(list_mode_options())}): pass --torch_compile_mode default, or leave it "
                              "unset.")  # fmt: skip


def set_compile(training, on: bool) -> None:
    """TrainingArguments' compile switch after its __post_init__: the backend it would have defaulted to; off, no
    backend or mode either (the Trainer hands a backend to accelerate, which compiles with it whatever torch_compile
    says)."""
    training.torch_compile = on
    if on and training.torch_compile_backend is None:
        training.torch_compile_backend = "inductor"
    if not on:
        training.torch_compile_backend = training.torch_compile_mode = None
