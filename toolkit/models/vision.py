"""An image-text model's three parts, and which of them train.

  vision     the image encoder: transformers' `get_encoder(modality="image")` (vision_tower, visual, vision_model)
  projector  what maps its features into the language model's embeddings: the parameters outside the other two
             (multi_modal_projector, Idefics3's connector), and a merger a tower holds itself (Qwen2-VL's)
  language   the decoder (`get_decoder()`) and its output head

By default the language model and the projector train and the vision tower stays frozen, as LLaVA's second stage,
Qwen2-VL's fine-tuning guides and LLaMA-Factory's defaults have it. No family names: a model transformers
implements is split by its own accessors, and one without an image encoder is refused in one line.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..errors import ConfigError
from ..settings.model_arguments import ModelArguments

PARTS = ("vision", "projector", "language")
TRAINED_BY_DEFAULT = ("projector", "language")
LORA_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def image_encoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """An image-text model's vision tower (transformers' `get_encoder(modality="image")`); None for a model without
    one (a text model's get_encoder gives itself or its base)."""
    vision = model.get_encoder(modality="image") if hasattr(model, "get_encoder") else model
    inside = any(vision is module for module in model.modules())
    return None if vision is model or not inside or vision is getattr(model, "base_model", None) else vision


def _prefixes(model: torch.nn.Module) -> tuple[str, str, str]:
    """The qualified names of the vision encoder, the decoder and the output head."""
    names = {id(module): name for name, module in model.named_modules()}
    vision = image_encoder(model)
    if vision is None:
        raise ConfigError(f"{type(model).__name__} has no image encoder transformers can find (vision_tower, visual, "
                          "vision_model): a text-only model cannot take images. Use an image-text model "
                          "(AutoModelForImageTextToText), or drop the images from the data.")  # fmt: skip
    head = model.get_output_embeddings()
    return names[id(vision)], names[id(model.get_decoder())], names.get(id(head), "") if head is not None else ""


def part_of(name: str, prefixes: tuple[str, str, str]) -> str:
    """The part a parameter's qualified name belongs to."""
    vision, language, head = prefixes
    if name.startswith(vision + "."):  # a merger inside the tower maps into the decoder (Qwen3-VL's deepstack ones too)
        return "projector" if any("merger" in piece for piece in name.split(".")) else "vision"
    if name.startswith(language + ".") or (head and name.startswith(head + ".")):
        return "language"
    return "projector"


def model_parts(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each part's parameter names, in the model's order."""
    prefixes = _prefixes(model)
    parts: dict[str, list[str]] = {part: [] for part in PARTS}
    for name, _ in model.named_parameters():
        parts[part_of(name, prefixes)].append(name)
    return parts


def train_parts(model: torch.nn.Module, trained: tuple[str, ...] = TRAINED_BY_DEFAULT) -> dict[str, tuple[int, bool]]:
    """Freeze every part not in `trained`; each part's parameter count and whether it trains (the header's line)."""
    check_parts(",".join(trained))
    prefixes = _prefixes(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(part_of(name, prefixes) in trained)
    counts = part_sizes(model, prefixes)
    return {part: (counts[part], part in trained) for part in PARTS}


def part_sizes(model: torch.nn.Module, prefixes: tuple[str, str, str] | None = None) -> Counter[str]:
    """Each part's parameters, counted."""
    prefixes = prefixes or _prefixes(model)
    counts = Counter({part: 0 for part in PARTS})
    for name, parameter in model.named_parameters():
        counts[part_of(name, prefixes)] += parameter.numel()
    return counts


def check_parts(setting: str) -> tuple[str, ...]:
    """--train_parts as parts, refused in one line before any weight loads."""
    trained = tuple(part.strip() for part in setting.split(",") if part.strip())
    unknown = [part for part in trained if part not in PARTS]
    if unknown or not trained:
        raise ConfigError(f"--train_parts {setting!r}: pick one or more of {','.join(PARTS)} (comma-separated).")
    return trained


def choose_trained(model: torch.nn.Module, args: ModelArguments) -> str | list[str] | None:
    """What trains in an image-text model, and the header's line for it (args.parts_note). A full fine-tune freezes
    the parts --train_parts leaves out; LoRA adapts what --lora_target_modules names, the language model's linear
    layers for all-linear (the return value: the adapter's targets, None without LoRA)."""
    counts = part_sizes(model)
    said = lambda parts: ", ".join(f"{part} {counts[part]:,}" for part in parts)  # noqa: E731
    if args.use_lora:
        targets = args.lora_settings()["target_modules"]
        where = "the language model's linear layers" if targets == "all-linear" else ", ".join(targets)
        args.parts_note = f"LoRA on {where}; the weights of {said(PARTS)} frozen"
        return adapter_targets(model, targets)
    trained = check_parts(args.train_parts)
    train_parts(model, trained)
    frozen = [part for part in PARTS if part not in trained]
    args.parts_note = f"{said(trained)}" + (f"; {said(frozen)} frozen (--train_parts)" if frozen else "")
    return None


def adapter_targets(model: torch.nn.Module, targets: str | list[str]) -> str | list[str]:
    """LoRA's targets for `model`: --lora_target_modules, but all-linear on an image-text model means the language
    model's linear layers (the planner's meta model takes the same as the run)."""
    return language_lora_targets(model) if targets == "all-linear" and image_encoder(model) is not None else targets


def language_lora_targets(model: torch.nn.Module) -> str:
    """peft's `target_modules` for LoRA on the language model's linear layers alone (a regex peft matches whole
    names with): peft's "all-linear" would adapt the vision tower's too."""
    _, language, _ = _prefixes(model)
    return rf"{language}\..*\.({'|'.join(LORA_LAYERS)})"
