"""Tiny vision processors, built offline: transformers' own processor and image processor classes (their expansion
of each image placeholder is what the tests exercise), a byte-level BPE tokenizer trained in a second with the
family's special tokens, and chat templates written in each family's format (the Hub's are not reachable here):
tiny mode's for its families (toolkit/models/tiny_vision.py; the Qwen2-VL family's for images only)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

from toolkit.models.tiny import train_tokenizer
from toolkit.models.tiny_vision import FAMILIES, ONEVISION_GRID, with_special_tokens

TEXT = "What colour is the square? It is red. And the circle? Blue, on a green ground. Describe the picture. " * 20


def tokenizer(named: dict[str, str], more: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    return with_special_tokens(train_tokenizer(False, [TEXT]), named, more)


def tiny_mode_processor(family: str):
    """The processor tiny mode builds for the family (toolkit/models/tiny_vision.py), its tokenizer trained here."""
    spec = FAMILIES[family]
    return spec.processor(tokenizer(spec.named, spec.more))


PROCESSORS = {name: partial(tiny_mode_processor, name) for name in FAMILIES}


def picture(seed: int, size: tuple[int, int] = (56, 84)) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


def tiny_model(family: str, processor):
    """The family's image-text model at toy size, random init, its image token ids the processor's: a SigLIP
    (Gemma 3, Idefics3) or CLIP (LLaVA) tower of 28-pixel images in 14-pixel patches, a 2-layer decoder."""
    from transformers import (
        AutoModelForImageTextToText,
        Gemma3Config,
        Idefics3Config,
        InternVLConfig,
        LlavaConfig,
        LlavaOnevisionConfig,
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
        Qwen3VLConfig,
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
    elif family == "llava_onevision":  # AnyRes: the base image and its tiles, every patch kept ("full")
        config = LlavaOnevisionConfig(text_config={"model_type": "qwen2", **text},
                                      vision_config={"model_type": "siglip_vision_model", **vision},
                                      image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
                                      image_grid_pinpoints=ONEVISION_GRID, vision_feature_select_strategy="full",
                                      vision_feature_layer=-1)  # fmt: skip
    elif family == "internvl":  # 56-pixel tiles, 4 x 4 patches pixel-shuffled 2 x 2 into 4 tokens
        tower = {**vision, "image_size": [56, 56], "patch_size": [14, 14]}
        config = InternVLConfig(text_config={"model_type": "qwen2", **text}, vision_config=tower,
                                image_token_id=tok.context_image_token_id, image_seq_length=4,
                                downsample_ratio=0.5)  # fmt: skip
    elif family == "qwen3_vl":  # 16-pixel patches merged 2x2, a learnt position grid, interleaved M-RoPE
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True,
                                   "rope_theta": 10000.0}  # fmt: skip
        tower = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 32,
                 "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
                 "deepstack_visual_indexes": [0]}  # fmt: skip
        config = Qwen3VLConfig(text_config=text, vision_config=tower, image_token_id=tok.image_token_id,
                               video_token_id=tok.video_token_id, vision_start_token_id=tok.vision_bos_token_id,
                               vision_end_token_id=tok.vision_eos_token_id)  # fmt: skip
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
