"""A model's dropout, as its config names it: what `--dropout` sets (models/loading.py) and tiny mode keeps."""

from __future__ import annotations

from transformers import PretrainedConfig


def dropout_names(config: PretrainedConfig) -> list[str]:
    """The config's dropout probabilities that are set (BERT's hidden_dropout_prob, GPT-2's resid_pdrop, ...)."""
    return sorted(k for k, v in config.to_dict().items()
                  if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and v > 0)  # fmt: skip
