"""Fine-tuning recipes for Hugging Face Transformers."""

__all__ = ["run", "train"]


def __getattr__(name: str):
    # Lazy: `python -m toolkit plan` should not import the Trainer stack.
    if name in __all__:
        from .pipeline import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'toolkit' has no attribute '{name}'")
