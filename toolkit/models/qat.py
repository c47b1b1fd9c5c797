"""--qat int4: quantization-aware training with torchao. Every linear layer but the output head trains through a
fake quantizer (its weights rounded to the scheme's grid in the forward pass, the gradient passed straight through),
so that the weights learn to stand the rounding that quantizing them after training will do. The fake quantizers
hold no state of their own (a FakeQuantizedLinear's state dict is a Linear's), so every checkpoint and the final
save are plain weights in the run's usual layout, what torchao's convert step without a base config would leave:
any 4-bit quantizer takes them, `toolkit export --quant q4_0` (llama.cpp's blocks of 32) or torchao's own, and a
resumed run puts the fake quantizers back on at load.

int4 is torchao's IntxWeightOnlyConfig: symmetric 4-bit integers in groups of 32 weights along a row, a scale each
group (the absolute maximum over 7.5), the CPU-friendly scheme torchao's QAT supports on any device. llama.cpp's
Q4_0 has the same blocks but another scale (the signed maximum over -8): measured, QAT helps the first and not the
second (docs/after-training.md). The output head stays as it is (GGUF's 4-bit types keep it at 6 bits or more).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GROUP = 32


def int4_config():
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(GROUP))


SCHEMES: dict[str, Callable] = {"int4": int4_config}  # torchao's base PTQ config of each of QAT_SCHEMES


def prepare(model: torch.nn.Module, scheme: str) -> int:
    """Fake quantizers on every linear layer but the output head (a weight whose rows are not whole groups
    stays as it is); returns how many layers train quantized."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def chosen(module: torch.nn.Module, name: str) -> bool:
        return type(module) is torch.nn.Linear and module is not head and module.in_features % GROUP == 0

    count = sum(chosen(m, n) for n, m in model.named_modules())
    quantize_(model, QATConfig(SCHEMES[scheme](), step="prepare"), filter_fn=chosen)
    return count
