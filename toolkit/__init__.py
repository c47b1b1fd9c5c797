"""Fine-tuning recipes for Hugging Face Transformers."""

from .runner import run, train

__all__ = ["run", "train"]
