"""An image-text model's parts (toolkit/models/vision.py) under each family's own module names: vision tower,
projector and language model found by transformers' accessors, the tower frozen by default, LoRA on the language
model alone, and a text-only model refused in one line."""

from __future__ import annotations

import pytest
from vision_processors import PROCESSORS, picture, tiny_model

from toolkit.errors import ConfigError
from toolkit.models.vision import language_lora_targets, model_parts, train_parts

# Where each family keeps its parts (transformers' names), written out here as the independent reference.
WHERE = {
    "gemma3": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."),
    "idefics3": ("model.vision_model.", "model.connector.", "model.text_model."),
    "llava": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."),
    "internvl": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."),
    "llava_onevision": (
        "model.vision_tower.",
        ("model.multi_modal_projector.", "model.image_newline"),
        "model.language_model.",
    ),  # fmt: skip
    "qwen2_vl": ("model.visual.", "model.visual.merger.", "model.language_model."),  # the merger: in the tower
    "qwen2_5_vl": ("model.visual.", "model.visual.merger.", "model.language_model."),
    "qwen3_vl": (
        "model.visual.",
        ("model.visual.merger.", "model.visual.deepstack_merger_list."),
        "model.language_model.",
    ),  # fmt: skip
}


@pytest.fixture(params=sorted(PROCESSORS))
def family(request):
    return request.param, tiny_model(request.param, PROCESSORS[request.param]())


def test_each_part_is_where_the_family_keeps_it(family):
    name, model = family
    parts = model_parts(model)
    assert sorted(n for names in parts.values() for n in names) == sorted(n for n, _ in model.named_parameters())
    vision, projector, language = WHERE[name]
    others = parts["projector"] + parts["language"]
    assert parts["vision"] and all(n.startswith(vision) and not n.startswith(projector) for n in parts["vision"])
    assert not any(n.startswith(vision) and not n.startswith(projector) for n in others)
    assert parts["projector"] and all(n.startswith(projector) for n in parts["projector"])
    assert all(n.startswith(language) or n.startswith("lm_head") for n in parts["language"])


def test_by_default_the_tower_is_frozen_and_the_rest_trains(family):
    _, model = family
    counts = train_parts(model)
    parts = model_parts(model)
    named = dict(model.named_parameters())
    assert not any(named[n].requires_grad for n in parts["vision"])
    assert all(named[n].requires_grad for n in parts["projector"] + parts["language"])
    assert counts["vision"] == (sum(named[n].numel() for n in parts["vision"]), False)
    train_parts(model, ("vision", "projector", "language"))
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ConfigError, match=r"--train_parts 'tower': pick one or more of vision,projector,language"):
        train_parts(model, ("tower",))


def test_lora_adapts_the_language_models_linear_layers_alone(family):
    from peft import LoraConfig, get_peft_model

    _, model = family
    language = model_parts(model)["language"]
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=language_lora_targets(model)))
    lora = [n for n, _ in adapted.named_parameters() if "lora_" in n]
    assert lora and all(".language_model." in n or ".text_model." in n for n in lora)
    layers = {n.removeprefix("base_model.model.").split(".lora_")[0] + ".weight" for n in lora}
    linear = {n for n in language if n.endswith("_proj.weight")}
    assert layers == linear  # every linear layer of the decoder, nothing else


def test_a_text_only_model_is_refused_in_one_line():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM has no image encoder .* a text-only model cannot take "
                                          r"images") as refused:  # fmt: skip
        model_parts(model)
    assert "\n" not in str(refused.value)


def test_the_processor_loads_from_its_folder_and_each_refusal_is_one_line(tmp_path):
    """A saved processor loads as the model's own (chat template included); a Qwen2-VL folder on a machine without
    torchvision (its video processor needs it, in transformers 5) loads for images alone, and expands an image as
    the family does; a processor class that itself needs torchvision (Mistral 3's PixtralProcessor) and a folder
    with no image processor are each one line naming the fix."""
    import importlib.util
    import json

    from toolkit.models.processors import load_processor

    gemma3 = PROCESSORS["gemma3"]()
    gemma3.save_pretrained(tmp_path / "gemma3")
    loaded = load_processor(str(tmp_path / "gemma3"))
    assert type(loaded).__name__ == "Gemma3Processor" and loaded.chat_template == gemma3.chat_template

    qwen = tmp_path / "qwen2_vl"  # as the Hub's folders are: a Qwen2VLProcessor with its video processor's config
    PROCESSORS["qwen2_vl"]().save_pretrained(qwen)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "temporal_patch_size": 2,
             "merge_size": 2}  # fmt: skip
    (qwen / "video_preprocessor_config.json").write_text(json.dumps(video))
    loaded = load_processor(str(qwen))
    assert type(loaded).__name__ == "Qwen2VLProcessor"
    assert loaded.chat_template == PROCESSORS["qwen2_vl"]().chat_template
    if importlib.util.find_spec("torchvision") is None:  # images alone: the video processor needs torchvision
        assert "video_processor" not in type(loaded).get_attributes()
        batch = loaded(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[picture(0)], return_tensors="pt")
        tokens = int((batch["input_ids"] == loaded.tokenizer.image_token_id).sum())
        assert tokens == int(batch["image_grid_thw"].prod()) // 4  # its patches merged 2 x 2

    if importlib.util.find_spec("torchvision") is None:  # Mistral 3's processor class itself needs it: one line
        pixtral = tmp_path / "pixtral"
        PROCESSORS["llava"]().save_pretrained(pixtral)
        for file in pixtral.glob("*.json"):
            file.write_text(file.read_text().replace("LlavaProcessor", "PixtralProcessor"))
        with pytest.raises(ConfigError, match=r"processor needs torchvision \(PixtralProcessor requires it\): pip "
                                              r"install torchvision") as refused:  # fmt: skip
            load_processor(str(pixtral))
        assert "\n" not in str(refused.value)

    gemma3.tokenizer.save_pretrained(tmp_path / "no_images")  # its config names Gemma3Processor
    with pytest.raises(ConfigError, match=r"has no image processor \(transformers found no preprocessor_config.json"
                                          r"\): it is not an image-text model"):  # fmt: skip
        load_processor(str(tmp_path / "no_images"))
    from toolkit.models.tiny import train_tokenizer

    train_tokenizer(False, ["A text-only model's words."]).save_pretrained(tmp_path / "text")
    with pytest.raises(ConfigError, match=r"has no image processor \(AutoProcessor gave a \w+\): it is not an "
                                          r"image-text model"):  # fmt: skip
        load_processor(str(tmp_path / "text"))
