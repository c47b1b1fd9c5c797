"""The model's settings (`ModelArguments`): the weights and their dtype, the attention and expert kernels, the
load-balancing loss, dropout, LoRA and QLoRA, which parts of an image-text model train; each checked where it is
declared, against the library's own list of valid values where there is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..project import check_local_path
from .values import at_least, optional_fields_unset

# What people type for a dtype, and the name torch and transformers use.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


DTYPES = ("auto", "float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """A dtype setting as torch names it; "auto" stays "auto" (the checkpoint's own, for from_pretrained)."""
    if name == "auto":
        return "auto"
    import torch

    return getattr(torch, name)


def check_attention_name(name: str) -> None:
    """--attn_implementation: `auto` (the toolkit's choice), or a name transformers takes: eager, one in its registry
    of attention functions (AttentionInterface, custom ones registered included), or a Hub kernel (org/name)."""
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["auto", "eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if name not in known and not is_kernel(name):
        raise ConfigError(f"attn_implementation '{name}' is not one of {', '.join(known)}, nor a Hub kernel "
                          "(org/name): pass --attn_implementation sdpa, for example.")  # fmt: skip


def check_experts_name(name: str) -> None:
    """--experts_implementation: eager, or one in transformers' registry of expert kernels (ExpertsInterface)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    known = ["eager", *ALL_EXPERTS_FUNCTIONS.keys()]
    if name not in known:
        raise ConfigError(f"experts_implementation '{name}' is not one of {', '.join(known)}: pass "
                          "--experts_implementation grouped_mm, for example.")  # fmt: skip


QAT_SCHEMES = ("int4",)  # --qat's names; models/qat.py holds torchao's config of each


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Hub id, local folder, or package:<module>/<path>."})
    dtype: str = field(default="auto", metadata={"help": "Weights dtype: auto, float32, bfloat16, float16."})
    attn_implementation: str | None = field(
        default="auto",
        metadata={
            "help": "auto, eager, sdpa, flex_attention, flash_attention_2 (3, 4), a Hub kernel (org/name). auto: "
            "packed rows on a GPU get flash-attn's varlen path where installed, else flex attention; other runs "
            "sdpa (docs/recipes.md)."
        },
    )
    attention_note: str = field(default="", init=False, repr=False)  # why auto chose: the run's header
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "A mixture of experts' load-balancing loss (its family's, added to the training loss): its "
            "coefficient, 0.001-0.02 is usual; 0 turns it off. Default: the model's config (Mixtral's: off)."
        },
    )
    dropout: float | None = field(
        default=None,
        metadata={
            "help": "Every dropout probability of the model's config (attention, hidden, classifier) set to this: "
            "0 turns dropout off, as for runs compared number for number across process counts (dropout's random "
            "masks fall on other rows there). Default: the model's own."
        },
    )
    experts_implementation: str = field(
        default="auto",
        metadata={
            "help": "A mixture of experts' expert kernel, as transformers names them: eager (one expert after "
            "another), batched_mm, grouped_mm (one grouped matmul for all experts), or a kernel it registers. "
            "auto: transformers' choice, grouped_mm where this device can run it, else eager."
        },
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code from the Hub repo."})
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "distill: the teacher, a Hub id or folder sharing the student's vocabulary."}
    )
    fused_loss: bool | None = field(
        default=None,
        metadata={
            "help": "sft: score the loss with TRL's fused log-prob head, in tiles, never holding the full "
            "logits. Default: on with a GPU, off on CPU (docs/planner.md)."
        },
    )
    use_lora: bool = field(default=False, metadata={"help": "Train a PEFT LoRA adapter instead of all weights."})
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Comma-separated module names, or all-linear (every linear but the head)."},
    )
    merge_lora: bool = field(
        default=False,
        metadata={"help": "LoRA: also save base + adapter merged into one standalone model in OUTPUT_DIR/merged."},
    )
    fp32_master_weights: bool | None = field(
        default=None,
        metadata={
            "help": "16-bit weights (--dtype bfloat16): keep the trainable ones in fp32, computing in 16 bits, so "
            "that updates below bf16's resolution are not lost. Default: on under mixed precision (--bf16/--fp16); "
            "single_gpu/DDP get the toolkit's, FSDP accelerate's, DeepSpeed its own (docs/recipes.md)."
        },
    )
    train_parts: str = field(
        default="projector,language",
        metadata={
            "help": "vlm_sft, full fine-tuning: the parts of an image-text model that train, of vision (the image "
            "encoder), projector, language; the others stay frozen. LoRA adapts the language model's linear layers."
        },
    )
    parts_note: str = field(default="", init=False, repr=False)  # what trains, for the header (models/vision.py)
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: the base's linear layers in 4-bit NF4 with double quantization (bitsandbytes), "
            "the LoRA adapter trained over them. Needs --use_lora true."
        },
    )

    qat: str | None = field(
        default=None,
        metadata={
            "help": "Quantization-aware training, a full fine-tune: int4 (torchao) trains every linear layer but the "
            "head through torchao's 4-bit rounding in groups of 32, and saves plain weights that torchao's int4 then "
            "loses less of (llama.cpp's Q4_0 rounds by another rule: docs/after-training.md).",
            "choices": list(QAT_SCHEMES),
        },
    )

    def __post_init__(self) -> None:
        optional_fields_unset(self)
        self.dtype = DTYPE_ALIASES.get(self.dtype.lower(), self.dtype.lower())
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype '{self.dtype}' is not one of {', '.join(DTYPES)} (bf16, fp16 and fp32 work too): "
                              "pass --dtype bfloat16, for example.")  # fmt: skip
        if self.attn_implementation not in (None, "auto"):
            check_attention_name(self.attn_implementation)
        if self.experts_implementation != "auto":
            check_experts_name(self.experts_implementation)
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ConfigError(f"router_aux_loss_coef must be 0 (off) or positive, got {self.router_aux_loss_coef:g}: "
                              "pass 0.001, say.")  # fmt: skip
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout is a probability below 1, got {self.dropout:g}: pass 0 (off) or 0.1, say.")
        at_least("lora_r", self.lora_r, 1, " (the adapter's rank; 8-64 is usual)")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be positive, got {self.lora_alpha} (twice lora_r is usual).")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout is a probability below 1, got {self.lora_dropout}: pass 0.05, say.")
        if not self.lora_target_modules.replace(",", " ").strip():
            raise ConfigError("lora_target_modules is empty: pass all-linear, or module names like q_proj,v_proj.")
        check_local_path(self.model_name_or_path, "model", "--model_name_or_path", "config.json")
        if self.teacher_model_name_or_path:
            check_local_path(self.teacher_model_name_or_path, "teacher", "--teacher_model_name_or_path", "config.json")
        if self.load_in_4bit:
            check_qlora(self)
        if self.qat:
            check_qat(self)

    def quantization(self):
        """transformers' BitsAndBytesConfig for QLoRA (the QLoRA paper's NF4 with double quantization), computing
        in the weights' dtype (bf16 for auto); None without --load_in_4bit."""
        if not self.load_in_4bit:
            return None
        import torch
        from transformers import BitsAndBytesConfig

        compute = getattr(torch, self.dtype) if self.dtype != "auto" else torch.bfloat16
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute)  # fmt: skip

    def lora_settings(self) -> dict[str, Any] | None:
        """The peft LoraConfig arguments that decide the adapter's shape (dropout aside), or None without LoRA."""
        if not self.use_lora:
            return None
        targets = lora_targets(self.lora_target_modules)
        return {"r": self.lora_r, "lora_alpha": self.lora_alpha, "target_modules": targets}


def lora_targets(modules: str) -> str | list[str]:
    """--lora_target_modules as peft takes it: "all-linear" (every linear layer but the output head, found by peft),
    or the comma-separated names as a list."""
    return modules if modules == "all-linear" else [t.strip() for t in modules.split(",")]


def check_qat(model: ModelArguments) -> None:
    """--qat: a known scheme, on weights that train (not an adapter's frozen base), with torchao installed."""
    import importlib.util

    if model.qat not in QAT_SCHEMES:
        raise ConfigError(f"--qat {model.qat}: one of {', '.join(QAT_SCHEMES)}.")
    if model.use_lora or model.load_in_4bit:
        raise ConfigError("--qat trains the weights through 4-bit rounding, and under LoRA the base weights do not "
                          "train: drop --use_lora (a full fine-tune), or drop --qat.")  # fmt: skip
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("--qat needs torchao: pip install torchao (make install does).")


def check_qlora(model: ModelArguments) -> None:
    """--load_in_4bit: an adapter over frozen 4-bit weights, with bitsandbytes installed."""
    import importlib.util

    if not model.use_lora:
        raise ConfigError("--load_in_4bit freezes the base in 4-bit, which cannot be trained directly: add --use_lora "
                          "true (QLoRA), or drop --load_in_4bit.")  # fmt: skip
    if model.merge_lora:
        raise ConfigError("--merge_lora would merge the adapter into 4-bit rounded weights: drop it, and merge the "
                          "saved adapter into the 16-bit base (peft's merge_and_unload on the base loaded without "
                          "4-bit).")  # fmt: skip
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--load_in_4bit needs bitsandbytes: pip install bitsandbytes (make install does).")
