"""What tiny mode needs to know of each image-text family, offline: the special tokens its processor writes for an
image, a chat template in its format (the Hub's are not reachable), its processor built from transformers' own
classes at toy size (the placeholder's expansion is the family's), and its config's vision side shrunk to match:
a 2-layer tower of 28-pixel images in 14-pixel patches. tiny.py builds the checkpoint; the tiny data is colour
squares and the question what colour each is (image_rows).

The Qwen2-VL family's processors are built for images alone (processors.py: their video processor needs
torchvision). Tiny mode names the families it builds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

GEMMA3 = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% else %}{{ part['text'] | trim }}{% endif %}{% endfor %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
IDEFICS3 = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
LLAVA = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{{ '</s>' if message['role'] == 'assistant' else ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}"
)
QWEN2_VL = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
ONEVISION = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INTERNVL = ONEVISION.replace("<image>", "<IMG_CONTEXT>")
IDEFICS3_TILES = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
# A tower's sizes at toy scale: 28-pixel images, 14-pixel patches (2 x 2 of them), 2 layers.
TINY_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "image_size": 28, "patch_size": 14}  # fmt: skip


@dataclass(frozen=True)
class Family:
    named: dict[str, str]  # the tokenizer's named special tokens (image_token, ...): the processor reads them
    more: tuple[str, ...]  # its other special tokens (turn markers, tiles)
    template: str
    processor: Callable[[Any], Any]  # tokenizer -> the family's processor at toy size
    adapt: Callable[[Any, Any], None]  # (config, tokenizer): the config's image side made to agree, in place


def _gemma3_processor(tokenizer):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=GEMMA3, image_seq_length=4)


def _gemma3_config(config, tokenizer) -> None:  # 2 x 2 patches pooled to the processor's 4 soft tokens
    config.mm_tokens_per_image = 4
    config.image_token_id = tokenizer.image_token_id
    config.boi_token_index, config.eoi_token_index = tokenizer.boi_token_id, tokenizer.eoi_token_id


def _idefics3_processor(tokenizer):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    images = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, chat_template=IDEFICS3, image_seq_len=4)


def _idefics3_config(config, tokenizer) -> None:  # each 28-pixel tile's 4 patches kept (no pixel shuffle)
    config.scale_factor, config.image_token_id = 1, tokenizer.image_token_id


def _llava_processor(tokenizer):
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=LLAVA, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)  # fmt: skip


def _llava_config(config, tokenizer) -> None:  # CLIP's class token dropped ("default"), as the processor counts
    config.image_token_id = tokenizer.image_token_id
    config.vision_feature_select_strategy, config.vision_feature_layer = "default", -1


# LLaVA-OneVision's AnyRes at toy size: a 28-pixel base image and up to 2 x 2 tiles of it
ONEVISION_GRID = [[28, 28], [28, 56], [56, 28], [56, 56]]


def _onevision_processor(tokenizer):
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

    from .processors import images_only_class

    images = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, crop_size={"height": 28, "width": 28},
                                             image_grid_pinpoints=ONEVISION_GRID)  # fmt: skip
    return images_only_class(LlavaOnevisionProcessor)(image_processor=images, tokenizer=tokenizer,
                                                      chat_template=ONEVISION, num_image_tokens=4,
                                                      vision_feature_select_strategy="full")  # fmt: skip


def _onevision_config(config, tokenizer) -> None:  # every patch kept ("full"), the processor's tiles
    config.image_token_id, config.video_token_id = tokenizer.image_token_id, tokenizer.video_token_id
    config.image_grid_pinpoints, config.vision_feature_select_strategy = ONEVISION_GRID, "full"


def _internvl_processor(tokenizer):  # a 56-pixel tile: 4 x 4 patches, pixel-shuffled 2 x 2 into 4 tokens
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor

    from .processors import images_only_class

    images = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=False)
    return images_only_class(InternVLProcessor)(image_processor=images, tokenizer=tokenizer, chat_template=INTERNVL,
                                                image_seq_length=4)  # fmt: skip


def _internvl_config(config, tokenizer) -> None:
    config.image_token_id, config.image_seq_length, config.downsample_ratio = tokenizer.context_image_token_id, 4, 0.5
    config.vision_config.image_size, config.vision_config.patch_size = [56, 56], [14, 14]


def _qwen_processor(class_name: str, patch: int = 14):
    def build(tokenizer):  # pictures made 4 x 4 patches (of 14 pixels; Qwen3-VL's of 16), merged 2 x 2: 4 tokens
        from transformers import Qwen2VLImageProcessorPil
        from transformers.models.auto.processing_auto import processor_class_from_name

        from .processors import images_only_class

        side = 4 * patch
        images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=side * side,
                                          max_pixels=side * side)  # fmt: skip
        processor = images_only_class(processor_class_from_name(class_name))
        return processor(image_processor=images, tokenizer=tokenizer, chat_template=QWEN2_VL)

    return build


def _qwen3_config(config, tokenizer) -> None:  # 16-pixel patches; a learnt 4 x 4 position grid; one deepstack layer
    _qwen_config(config, tokenizer)
    vision = config.vision_config
    vision.patch_size, vision.num_position_embeddings, vision.deepstack_visual_indexes = 16, 16, [0]


def _qwen_config(config, tokenizer) -> None:  # the tower 2 blocks deep, its merger into the text width
    config.image_token_id, config.video_token_id = tokenizer.image_token_id, tokenizer.video_token_id
    config.vision_start_token_id = tokenizer.vision_bos_token_id
    config.vision_end_token_id = tokenizer.vision_eos_token_id
    vision, text = config.vision_config, config.text_config
    vision.depth, vision.num_heads = 2, 4
    for key in ("out_hidden_size", "embed_dim"):  # Qwen2.5-VL's merger output, Qwen2-VL's tower width
        if hasattr(vision, key):
            setattr(vision, key, text.hidden_size if key == "out_hidden_size" else TINY_VISION["hidden_size"])
    if hasattr(vision, "fullatt_block_indexes"):
        vision.fullatt_block_indexes = [1]
    half = (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) // 2
    rope = text.rope_parameters  # M-RoPE's sections (time, height, width) cover half the head, as 16/24/24 of 64
    rope["mrope_section"] = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]


QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
               "vision_eos_token": "<|vision_end|>"}  # fmt: skip
FAMILIES = {
    "gemma3": Family({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                      "image_token": "<image_soft_token>"}, ("<start_of_turn>", "<end_of_turn>"), GEMMA3,
                     _gemma3_processor, _gemma3_config),
    "idefics3": Family({"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                        "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"},
                       ("<|im_start|>", *IDEFICS3_TILES), IDEFICS3, _idefics3_processor, _idefics3_config),
    "llava": Family({"image_token": "<image>"}, ("</s>",), LLAVA, _llava_processor, _llava_config),
    "llava_onevision": Family({"image_token": "<image>", "video_token": "<video>"}, ("<|im_start|>", "<|im_end|>"),
                              ONEVISION, _onevision_processor, _onevision_config),
    "internvl": Family({"start_image_token": "<img>", "end_image_token": "</img>",
                        "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
                       ("<|im_start|>", "<|im_end|>"), INTERNVL, _internvl_processor, _internvl_config),
    "qwen2_vl": Family(QWEN_TOKENS, ("<|im_start|>", "<|im_end|>"), QWEN2_VL, _qwen_processor("Qwen2VLProcessor"),
                       _qwen_config),
    "qwen2_5_vl": Family(QWEN_TOKENS, ("<|im_start|>", "<|im_end|>"), QWEN2_VL,
                         _qwen_processor("Qwen2_5_VLProcessor"), _qwen_config),
    "qwen3_vl": Family(QWEN_TOKENS, ("<|im_start|>", "<|im_end|>"), QWEN2_VL, _qwen_processor("Qwen3VLProcessor", 16),
                       _qwen3_config),
}  # fmt: skip


def family(config) -> Family:
    """The tiny-mode knowledge of a config's family; one line naming those tiny mode builds otherwise."""
    if config.model_type not in FAMILIES:
        raise ConfigError(f"tiny mode builds image-text models of the {', '.join(FAMILIES)} families, not "
                          f"{config.model_type}: run this recipe on its real model, or a local folder of a small "
                          "one (--model_name_or_path).")  # fmt: skip
    return FAMILIES[config.model_type]


def with_special_tokens(base, named: dict[str, str], more: tuple[str, ...] = ()):
    """A fast tokenizer over `base`'s vocabulary with a family's special tokens: `named` as its processor reads them
    (image_token, ...), and `more` (turn markers, tiles)."""
    from transformers import PreTrainedTokenizerFast

    base.add_special_tokens({"additional_special_tokens": [*named.values(), *more]})
    specials = {"bos_token": base.bos_token, "eos_token": base.eos_token, "pad_token": base.pad_token}
    return PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, extra_special_tokens=named, **specials)


def shrink_vision(config) -> None:
    """The config's vision tower at toy size, in place (its text side is tiny.py's shrunk_config's)."""
    vision = config.vision_config
    for key, value in TINY_VISION.items():
        if hasattr(vision, key):
            setattr(vision, key, value)
    if getattr(vision, "projection_dim", None):
        vision.projection_dim = TINY_VISION["hidden_size"]


# ---------------------------------------------------------------------------------------------- data

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 30),
    "blue": (30, 60, 220),
    "yellow": (230, 210, 40),
    "purple": (140, 40, 170),
    "orange": (240, 140, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
QUESTION = "What colour is the square?"


def image_rows(folder: Path, n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations about generated pictures, the images written into `folder/images`: a square of one colour on
    a grey ground, somewhere in the picture, and the question what colour it is. Learnable only from the image."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(n):
        name = rng.choice(list(COLOURS))
        pixels = np.full((28, 28, 3), 128, dtype="uint8")
        size = rng.randint(10, 20)
        top, left = rng.randint(0, 28 - size), rng.randint(0, 28 - size)
        pixels[top : top + size, left : left + size] = COLOURS[name]
        path = f"images/{k}.png"
        Image.fromarray(pixels).save(folder / path)
        question = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        answer = [{"type": "text", "text": f"It is {name}."}]
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                     "images": [path]})  # fmt: skip
    return rows


def image_texts() -> list[str]:
    """The tiny image data's text, to train its tokenizer on."""
    return [QUESTION] + [f"It is {name}." for name in COLOURS]
