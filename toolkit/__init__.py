"""Fine-tuning recipes for Hugging Face Transformers."""

import logging
import warnings

from .startup import heavy_imports

__all__ = ["run", "train"]

# bitsandbytes (QLoRA) warns on import, on any CPU with AVX-512 BF16, that an optional kernel package is missing,
# then uses its own kernel: nothing for a user to act on, printed before every command.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# torchao (FP8) warns on import that its CUDA kernel libraries fail to load on a machine without CUDA, and torch
# that torchao registers enums the old way: nothing for a user to act on (torchao's float8 needs none of them on a
# CPU; on a GPU the libraries load), printed before every command that imports transformers.
logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "is an Enum subclass" not in record.getMessage())
# Deprecations inside the libraries the toolkit drives, for their maintainers rather than a user: DeepSpeed's ZeRO
# gathers and reduces through torch's all_gather_into_tensor and reduce_scatter_tensor (deprecated in torch 2.13),
# warning on every call (1,452 warnings in a 2-step ZeRO-3 run of SmolLM2-135M); peft and TRL read transformers'
# is_gradient_checkpointing.
for _message in (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                 r"`is_gradient_checkpointing` is deprecated"):  # fmt: skip
    warnings.filterwarnings("ignore", message=_message, category=FutureWarning)


def run(recipe: dict, argv: list[str] | None = None, name: str | None = None) -> None:
    """A recipe script's entry point (runner.run). The Trainer stack is imported when a recipe runs, not when its
    file is read: `toolkit plan`, `check` and `launch` read recipes (`from toolkit import run`) in a fraction of the
    ~10 s that importing transformers' Trainer, peft and datasets takes."""
    with heavy_imports():
        from .runner import run as run_recipe

    run_recipe(recipe, argv, name)


def __getattr__(name: str):
    if name == "train":  # lazy, as run: the Trainer stack
        with heavy_imports():
            from .runner import train

        return train
    raise AttributeError(f"module 'toolkit' has no attribute '{name}'")
