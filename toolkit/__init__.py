"""Fine-tuning recipes for Hugging Face Transformers."""

import logging

__all__ = ["run", "train"]

# bitsandbytes (QLoRA) warns on import, on any CPU with AVX-512 BF16, that an optional kernel package is missing,
# then uses its own kernel: nothing for a user to act on, printed before every command.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def __getattr__(name: str):
    # Lazy: `python -m toolkit plan` should not import the Trainer stack.
    if name in __all__:
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'toolkit' has no attribute '{name}'")
