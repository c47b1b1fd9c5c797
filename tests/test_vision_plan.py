"""The plan of an image-text run against a real step: Gemma 3's architecture, narrowed, with images whose tower
saves as much for backward as the decoder does, measured as the text steps in test_planner.py are (the most bytes
malloc holds after any op); and the image path's measured FLOPs against a hand count."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch
from test_planner import _glibc_mallinfo2, _PeakLiveBytes, alone, layout, live_heap_bytes

from toolkit.data.sources import stored_config
from toolkit.models.vision import train_parts
from toolkit.planner import Shape, Workload, plan_memory
from toolkit.planner.activations import measured_activations
from toolkit.planner.estimate import training_flops_per_token
from toolkit.planner.vision import measured_image_cost

GEMMA3 = "google/gemma-3-4b-it"
IMAGE_TOKENS = 64  # the projector pools 32 x 32 patches to 8 x 8 soft tokens


def narrow_gemma3():
    """Gemma-3-4b-it's architecture at 256 wide, 4 decoder layers, a 4-layer tower of 448-pixel images (1,024
    patches); the image's tokens inside the narrowed vocabulary."""
    config = stored_config(GEMMA3)
    text, vision = config.text_config, config.vision_config
    for key, value in dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=64, vocab_size=8192).items():  # fmt: skip
        setattr(text, key, value)
    text.layer_types = text.layer_types[:4]
    for key, value in dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                           image_size=448).items():  # fmt: skip
        setattr(vision, key, value)
    config.mm_tokens_per_image = IMAGE_TOKENS
    config.image_token_id, config.boi_token_index, config.eoi_token_index = 8189, 8190, 8191
    return config


def batch(config, rows: int, length: int) -> dict:
    """Rows of text with one image's tokens in each, labelled but for those, as the collator labels them."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 8000, (rows, length), generator=generator)
    image = torch.zeros(rows, length, dtype=torch.long)
    image[:, 16 : 16 + IMAGE_TOKENS] = 1
    ids[image.bool()] = config.image_token_id
    pixels = torch.randn(rows, 3, 448, 448, generator=generator)
    return dict(input_ids=ids, token_type_ids=image, pixel_values=pixels, labels=ids.masked_fill(image.bool(), -100))


# (parts trained, activation checkpointing, (rows, tokens) of each step measured)
STEPS = [("vision,projector,language", False, [(2, 192), (1, 384)]), ("vision,projector,language", True, [(2, 192)]),
         ("projector,language", False, [(2, 192)])]  # fmt: skip


@pytest.mark.skipif(not _glibc_mallinfo2(), reason="measures through glibc 2.33+'s mallinfo2")
def test_a_vlm_step_peaks_where_the_plan_says_with_its_tower(request):
    """A whole step (forward with the images, loss, backward), the tower trained or frozen, with and without
    activation checkpointing: the plan's components at the peak within 5% of what malloc held (10% checkpointed).
    Without checkpointing the peak is at backward's start: the step's components less the gradients, made after
    it. With it, a trained tower moves the peak to its own backward: every other gradient made, the image path's
    layer inputs and one tower layer recomputed. Planned without the images, the trained tower's step would be
    well under: the image path is over a quarter of it here."""
    if alone(request):
        return
    from transformers import AutoModelForImageTextToText

    config = narrow_gemma3()
    fit, _ = measured_activations(config, "vlm_sft", "fp32", True)
    for parts, checkpointing, inputs in STEPS:
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
        train_parts(model, tuple(parts.split(",")))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        image, note = measured_image_cost(config, "vlm_sft", None, parts, "fp32", False)
        assert image is not None, note
        shape = replace(Shape.of(model, config), activations=fit, image=image)
        for rows, length in inputs:
            measured = step_peak(model, optimizer, batch(config, rows, length))
            work = Workload(precision="fp32", micro_batch=rows, seq_length=length, cuda_context_gib=0.0,
                            activation_checkpointing=checkpointing, dropout_mask_bytes=4)  # fmt: skip
            planned = plan_memory(shape, layout("single_gpu"), work, 1).device
            step = sum(v for k, v in planned.items() if k not in ("parameters", "optimizer_states"))
            at_peak = step - planned["gradients"] - planned["recomputed_layer"]
            if checkpointing:  # the peak moves to the tower's backward: every other gradient made, a layer recomputed
                tower = planned["gradients"] + planned["image_activations"] + planned["recomputed_layer"]
                at_peak = max(at_peak, tower)
            # checkpointed: within 10%, the recomputed layer's own gradients in its backward (MLP-wide) unplanned
            assert measured == pytest.approx(at_peak, rel=0.10 if checkpointing else 0.05), (parts, rows, planned)
            if parts.startswith("vision") and not checkpointing:
                assert planned["image_activations"] > 0.25 * at_peak
        del model, optimizer


def step_peak(model, optimizer, inputs: dict) -> int:
    """The most bytes malloc held above the weights and optimizer states during a step (the test_planner.py way)."""
    model(**inputs).loss.backward()  # a first step creates the optimizer states
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    before, mode = live_heap_bytes(), _PeakLiveBytes()
    with mode:
        outputs = model(**inputs)  # kept through backward, as in the Trainer
        outputs.loss.backward()
    del outputs
    optimizer.zero_grad(set_to_none=True)
    return mode.peak - before


def test_the_image_paths_flops_are_the_towers_matmuls_and_attention():
    """The tower's forward FLOPs per image, counted by hand: per layer 2 x patches x its linear weights
    (q, k, v, o, and the MLP's two) plus attention's 4 x patches^2 x width; the patch embedding's convolution,
    the projector's matmul. A trained tower's backward is twice its forward; a frozen one has none, and with it
    the FLOPs per text token leave its parameters out."""
    config = narrow_gemma3()
    vision = config.vision_config
    p, w, i, layers = (448 // 14) ** 2, 256, 1024, 4
    per_layer = 2 * p * (4 * w * w + 2 * w * i) + 4 * p * p * w
    embedding = 2 * p * (3 * 14 * 14) * w
    projector = 2 * IMAGE_TOKENS * w * config.text_config.hidden_size
    trained, _ = measured_image_cost(config, "vlm_sft", None, "vision,projector,language", "fp32", False)
    frozen, _ = measured_image_cost(config, "vlm_sft", None, "projector,language", "fp32", False)
    assert vision.num_hidden_layers == layers
    assert trained.forward_flops == pytest.approx(layers * per_layer + embedding + projector, rel=0.01)
    # backward: the linear layers' 2 x forward; flash attention's 5/2 (it recomputes the scores); the patch
    # embedding's weight gradient alone (the pixels need none); the projector's 2 x
    attention = layers * 4 * p * p * w
    backward = 2 * (layers * 2 * p * (4 * w * w + 2 * w * i)) + 2.5 * attention + embedding + 2 * projector
    assert trained.backward_flops == pytest.approx(backward, rel=0.01)
    assert frozen.forward_flops == trained.forward_flops
    # a frozen tower: the projector's backward alone, to its weight and to its input (the trained norm before it)
    assert frozen.backward_flops == pytest.approx(2 * projector, rel=0.01)
    model_shape = Shape(total=10**9, trainable=10**9, largest_module=1, largest_unit=1, num_layers=1,
                        hidden_size=256, num_heads=4, vocab_size=8192)  # fmt: skip
    with_image = replace(model_shape, image=frozen)
    text_only = training_flops_per_token(model_shape, 100)
    expected = (
        text_only
        - 6 * frozen.trainable
        - 4 * (frozen.parameters - frozen.trainable)
        + (frozen.forward_flops + frozen.backward_flops) / 100
    )
    assert training_flops_per_token(with_image, 100) == pytest.approx(expected)
