"""Tiny vision processors, built offline: transformers' own processor and image processor classes (their expansion
of each image placeholder is what the tests exercise), a byte-level BPE tokenizer trained in a second with the
family's special tokens, and chat templates written in each family's format (the Hub's are not reachable here)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

from toolkit.models.tiny import train_tokenizer

TEXT = "What colour is the square? It is red. And the circle? Blue, on a green ground. Describe the picture. " * 20

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


def tokenizer(named: dict[str, str], more: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    base = train_tokenizer(False, [TEXT])
    base.add_special_tokens({"additional_special_tokens": [*named.values(), *more]})
    specials = {"bos_token": base.bos_token, "eos_token": base.eos_token, "pad_token": base.pad_token}
    return PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, extra_special_tokens=named, **specials)


def gemma3():
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = tokenizer(named, ("<start_of_turn>", "<end_of_turn>"))
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=GEMMA3, image_seq_length=4)


def idefics3():
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tiles = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
    tok = tokenizer({"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                     "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"},
                    ("<|im_start|>", *tiles))  # fmt: skip
    images = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    return Idefics3Processor(image_processor=images, tokenizer=tok, chat_template=IDEFICS3, image_seq_len=4)


def llava():
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tok = tokenizer({"image_token": "<image>"}, ("</s>",))
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        chat_template=LLAVA,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )  # CLIP's CLS dropped


QWEN2_VL = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
            "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
            "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
            "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")  # fmt: skip


def qwen_vl(processor_class):
    """A Qwen2-VL-style processor for images only: transformers 5.24 builds these processors only with a video
    processor, which needs torchvision (not installable beside this CPU build of torch)."""
    from transformers import Qwen2VLImageProcessorPil

    attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
    images_only = type("ImagesOnly", (processor_class,), {"get_attributes": attributes})
    tok = tokenizer({"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                     "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
                    ("<|im_start|>", "<|im_end|>"))  # fmt: skip
    pixels = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    return images_only(image_processor=pixels, tokenizer=tok, chat_template=QWEN2_VL)


def qwen2_vl():
    from transformers import Qwen2VLProcessor

    return qwen_vl(Qwen2VLProcessor)


def qwen2_5_vl():
    from transformers import Qwen2_5_VLProcessor

    return qwen_vl(Qwen2_5_VLProcessor)


PROCESSORS = {"gemma3": gemma3, "idefics3": idefics3, "llava": llava, "qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl}


def picture(seed: int, size: tuple[int, int] = (56, 84)) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


def tiny_model(family: str, processor):
    """The family's image-text model at toy size, random init, its image token ids the processor's: a SigLIP
    (Gemma 3, Idefics3) or CLIP (LLaVA) tower of 28-pixel images in 14-pixel patches, a 2-layer decoder."""
    from transformers import (
        AutoModelForImageTextToText,
        Gemma3Config,
        Idefics3Config,
        LlavaConfig,
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
    )

    tok = processor.tokenizer
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                  patch_size=14)  # fmt: skip
    if family == "gemma3":  # 2x2 patches pooled to the processor's 4 soft tokens
        config = Gemma3Config(text_config={"model_type": "gemma3_text", **text},
                              vision_config={"model_type": "siglip_vision_model", **vision}, mm_tokens_per_image=4,
                              image_token_id=tok.image_token_id, boi_token_index=tok.boi_token_id,
                              eoi_token_index=tok.eoi_token_id)  # fmt: skip
    elif family == "llava":  # CLIP's class token dropped ("default"), as the processor counts
        config = LlavaConfig(text_config={"model_type": "llama", **text},
                             vision_config={"model_type": "clip_vision_model", "projection_dim": 32, **vision},
                             image_token_id=tok.image_token_id, vision_feature_select_strategy="default",
                             vision_feature_layer=-1)  # fmt: skip
    elif family == "idefics3":  # each 28-pixel tile's 4 patches kept (no pixel shuffle), as image_seq_len=4 says
        config = Idefics3Config(text_config={"model_type": "llama", **text}, vision_config=vision,
                                image_token_id=tok.image_token_id, scale_factor=1)  # fmt: skip
    else:  # Qwen2-VL, Qwen2.5-VL: 14-pixel patches merged 2x2 into a token, M-RoPE over (time, height, width)
        qwen = {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5_VLConfig}[family]
        tower = {"depth": 2, "hidden_size": 32, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
                 "temporal_patch_size": 2, **({"embed_dim": 32, "mlp_ratio": 2} if family == "qwen2_vl" else
                                              {"intermediate_size": 64, "out_hidden_size": 32,
                                               "fullatt_block_indexes": [1], "window_size": 56})}  # fmt: skip
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 2]}
        config = qwen(text_config=text, vision_config=tower, image_token_id=tok.image_token_id,
                      vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                      video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"))  # fmt: skip
    model = AutoModelForImageTextToText.from_config(config)
    if family == "gemma3":  # its projection starts at zero (a checkpoint's is trained): images would not count yet
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    return model


def trained_text(tokenizer, batch: dict, row: int) -> str:
    """The text a row's labels train."""
    from toolkit.data.conversations import IGNORE_INDEX

    labels = batch["labels"][row]
    return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())
