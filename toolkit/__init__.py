"""Fine-tuning recipes for Hugging Face Transformers."""

import logging

__all__ = ["run", "train"]

# bitsandbytes (QLoRA) warns on import, on any CPU with AVX-512 BF16, that an optional kernel package is missing,
# then uses its own kernel: nothing for a user to act on, printed before every command.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# torchao (FP8) warns on import that its CUDA kernel libraries fail to load on a machine without CUDA, and torch
# that torchao registers enums the old way: nothing for a user to act on (torchao's float8 needs none of them on a
# CPU; on a GPU the libraries load), printed before every command that imports transformers.
logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "is an Enum subclass" not in record.getMessage())


def __getattr__(name: str):
    # Lazy: `python -m toolkit plan` should not import the Trainer stack.
    if name in __all__:
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'toolkit' has no attribute '{name}'")
