"""Task vlm_sft through the runner, one process, for each image-text family built offline at toy size: the rows read
from a file with their images beside it, the header's line of what trains, the vision tower frozen by default and
the rest trained, LoRA on the language model alone (merged on request), an export that reloads, and each mistake one
clean line before any weight loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from test_bad_input import assert_one_clear_line
from vision_processors import PROCESSORS, tiny_model

from toolkit import run, train
from toolkit.models import vision

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}
QUESTION = "What colour is the square?"


def colour_rows(folder: Path, count: int = 24, llava: bool = False) -> Path:
    """A square of one colour per row, the question about it and its answer; images beside the data file, named
    relative to it (as a user's data folder has them)."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(count):
        name, image = list(COLOURS)[k % len(COLOURS)], f"images/{k}.png"
        Image.fromarray(np.full((28, 28, 3), COLOURS[name], dtype="uint8")).save(folder / image)
        if llava:
            turns = [{"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": f"It is {name}."}]
            rows.append({"conversations": turns, "image": image})
        else:
            question = [{"type": "image"}, {"type": "text", "text": QUESTION}]
            answer = [{"type": "text", "text": f"It is {name}."}]
            turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            rows.append({"messages": turns, "images": [image]})
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def model_folder(family: str, folder: Path) -> Path:
    """The family's tiny model and processor saved as a user's folder (the Qwen2-VL family's processor loads back
    for images alone: its video processor needs torchvision)."""
    processor = PROCESSORS[family]()
    tiny_model(family, processor).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def recipe(model: Path, data: Path) -> dict:
    return {"model_name_or_path": str(model), "task": "vlm_sft", "dataset_name": str(data), "max_seq_length": 96,
            "max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1,
            "report_to": "none", "dtype": "float32", "eval_fraction": 0.25, "save_strategy": "no"}  # fmt: skip


def weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """A saved model's parameters by their names in the model (a checkpoint's keys may be the legacy ones), and
    each part's names."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    return {n: p.detach() for n, p in model.named_parameters()}, vision.model_parts(model)


@pytest.mark.parametrize("family", sorted(PROCESSORS))
def test_each_family_trains_its_language_model_and_projector_and_exports(family, tmp_path, monkeypatch, capsys):
    """Full fine-tuning by default: the tower's weights come out as they went in, the projector's and the language
    model's move; the held-out loss is scored on the image rows; the export reloads as the family's model."""
    from transformers import AutoModelForImageTextToText

    model = model_folder(family, tmp_path / "model")
    out = tmp_path / "out"
    result = train(recipe(model, colour_rows(tmp_path / "data", llava=family == "llava")), ["--output_dir", str(out)],
                   "vlm")  # fmt: skip
    header = capsys.readouterr().out
    assert "trains        projector " in header and "frozen (--train_parts)" in header, header
    assert "24 image-text rows measured by the model's processor" in header
    assert np.isfinite(result.metrics["eval_loss"]) and "eval_token_accuracy" in result.metrics
    (before, parts), (after, _) = weights(model), weights(out)
    assert parts["vision"] and all(torch.equal(before[n], after[n]) for n in parts["vision"])
    for part in ("projector", "language"):
        assert any(not torch.equal(before[n], after[n]) for n in parts[part]), part
    assert type(AutoModelForImageTextToText.from_pretrained(out)) is type(result.trainer.model)
    card = (out / "README.md").read_text()
    assert "full fine-tune of the parts below" in card and "| trained | projector " in card


def test_lora_adapts_the_language_model_alone_and_merges(tmp_path, monkeypatch, capsys):
    """--use_lora: adapters on the decoder's linear layers only (peft's all-linear would adapt the tower's too), the
    header says so; --merge_lora writes a standalone model and processor whose tower is the base's."""
    from peft import PeftConfig
    from transformers import AutoProcessor

    model = model_folder("llava", tmp_path / "model")
    out = tmp_path / "out"
    train(recipe(model, colour_rows(tmp_path / "data")),
          ["--output_dir", str(out), "--use_lora", "true", "--merge_lora", "true"], "vlm")  # fmt: skip
    assert "trains        LoRA on the language model's linear layers" in capsys.readouterr().out
    adapted = {n.split(".lora_A")[0] for n in load_file(out / "adapter_model.safetensors") if ".lora_A" in n}
    assert adapted and all(".language_model." in n for n in adapted), sorted(adapted)
    assert PeftConfig.from_pretrained(out).base_model_name_or_path == str(model)
    AutoProcessor.from_pretrained(out / "merged")
    (base, parts), (merged, _) = weights(model), weights(out / "merged")
    assert all(torch.equal(base[n], merged[n]) for n in parts["vision"] + parts["projector"])
    assert any(not torch.equal(base[n], merged[n]) for n in parts["language"])


def text_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    processor = PROCESSORS["llava"]()
    config = LlamaConfig(vocab_size=len(processor.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    return folder


def no_image(folder: Path) -> Path:
    data = colour_rows(folder, count=4)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[2]["images"] = []
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def broken_image(folder: Path) -> Path:
    data = colour_rows(folder, count=4)
    (folder / "images" / "1.png").write_bytes(b"not a png")
    return data


@pytest.mark.parametrize(
    ("mistake", "flags", "key"),
    [
        ("text-only model", lambda tmp: ["--model_name_or_path", str(text_model(tmp / "llama"))],
         "llama is not an image-text model"),
        ("row without its image", lambda tmp: ["--dataset_name", str(no_image(tmp / "bad"))],
         "row 2 of the train split"),
        ("image that does not decode", lambda tmp: ["--dataset_name", str(broken_image(tmp / "bad"))],
         "its image does not decode"),
        ("text rows", lambda tmp: ["--dataset_name", str(text_rows(tmp))], "task vlm_sft trains on image-and-text"),
        ("unknown part", lambda tmp: ["--train_parts", "vision,decoder"], "--train_parts 'vision,decoder': pick"),
    ],
)  # fmt: skip
def test_each_mistake_is_one_line_before_any_weight_loads(mistake, flags, key, tmp_path, monkeypatch, capsys):
    model = model_folder("llava", tmp_path / "model")
    monkeypatch.setattr("toolkit.models.loading.load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(SystemExit) as exit_code:
        run(recipe(model, colour_rows(tmp_path / "data")), ["--output_dir", str(tmp_path / "out"), *flags(tmp_path)],
            "vlm")  # fmt: skip
    assert exit_code.value.code == 2
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, key)


def text_rows(folder: Path) -> Path:
    data = folder / "text.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).replace("messages", "chat") + "\n")
    return data


def test_the_recipes_stored_config_is_gemma_3_4bs_and_fsdp_wraps_both_towers_layers():
    """The stored config gives the published size of google/gemma-3-4b-it (its Hub page: 4,300,079,472
    parameters, tower included); FSDP wraps each decoder layer and each SigLIP encoder layer as a unit."""
    from toolkit.data.sources import stored_config
    from toolkit.distributed.strategy import layer_class
    from toolkit.models.meta import meta_model

    model = meta_model(stored_config("google/gemma-3-4b-it"), "vlm_sft")
    assert sum(p.numel() for p in model.parameters()) == 4_300_079_472
    assert layer_class(model) == "Gemma3DecoderLayer,SiglipEncoderLayer"
    # The recipe's LoRA, r=16, on the decoder alone (as the run adapts it), by hand: per layer q 2560->2048,
    # k and v 2560->1024, o 2048->2560, gate and up 2560->10240, down 10240->2560; 34 layers.
    per_layer = 16 * ((2560 + 2048) * 2 + (2560 + 1024) * 2 + (2560 + 10240) * 3)
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    adapted = meta_model(stored_config("google/gemma-3-4b-it"), "vlm_sft", lora)
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == 34 * per_layer == 29_802_496


def test_the_qwen2_5_vl_recipes_stored_config_is_the_published_models():
    """Qwen/Qwen2.5-VL-7B-Instruct's stored config gives its published size (its safetensors index: 16,584,333,312
    bytes in bf16, 8,292,166,656 parameters); the recipe's LoRA on the decoder, by hand: per layer q 3584->3584,
    k and v 3584->512, o 3584->3584, gate and up 3584->18944, down 18944->3584, r=16, 28 layers; FSDP wraps the
    decoder's layers and the tower's blocks (the tower is the deeper: 32 blocks to 28 layers)."""
    from toolkit.data.sources import stored_config
    from toolkit.distributed.strategy import layer_class
    from toolkit.models.meta import meta_model

    config = stored_config("Qwen/Qwen2.5-VL-7B-Instruct")
    model = meta_model(config, "vlm_sft")
    assert sum(p.numel() for p in model.parameters()) == 8_292_166_656
    assert layer_class(model) == "Qwen2_5_VLDecoderLayer,Qwen2_5_VLVisionBlock"
    per_layer = 16 * ((3584 + 3584) * 2 + (3584 + 512) * 2 + (3584 + 18944) * 3)
    adapted = meta_model(config, "vlm_sft", {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == 28 * per_layer == 40_370_176


def test_the_plan_counts_each_image_through_the_tower(capsys):
    """The recipe's plan: LoRA on the decoder, so the tower runs forward only, its FLOPs per 896-pixel image those
    of SigLIP-So400m's 27 layers over 4,096 patches (2 x patches x each layer's linear weights, 4 x patches^2 x
    width for attention), the patch embedding and the projector, counted here by hand."""
    from toolkit.planner.cli import main

    assert main(["gemma3_vlm_lora", "--gpu", "H100-80GB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parameters"]["trainable"] == 29_802_496 and not plan["left_out"]
    p, w, i = 4096, 1152, 4304
    tower = 27 * (2 * p * (4 * w * w + 2 * w * i) + 4 * p * p * w) + 2 * p * 3 * 14 * 14 * w + 2 * 256 * w * 2560
    assert f"{tower / 1e12:.3g} TFLOP forward, image path frozen: forward only" in plan["images"]


def test_generate_answers_about_an_image_and_refuses_one_for_a_text_model(tmp_path, monkeypatch, capsys):
    """`toolkit generate RUN --image PATH`: an image-text run (here LoRA on LLaVA, the adapter on its base) answers
    with the picture in the first user turn; a picture that is not there, or given to a text run, is one line."""
    from llama3_fft import RECIPE as LLAMA

    from toolkit.generate import generate_main

    model = model_folder("llava", tmp_path / "model")
    data = colour_rows(tmp_path / "data", count=8)
    out = tmp_path / "out"
    train(recipe(model, data), ["--output_dir", str(out), "--use_lora", "true", "--max_steps", "1"], "vlm")
    capsys.readouterr()
    picture = str(tmp_path / "data" / "images" / "0.png")
    assert generate_main([str(out), "--prompt", QUESTION, "--image", picture, "--max_new_tokens", "3"]) == 0
    assert f"> {QUESTION}" in capsys.readouterr().out
    text = tmp_path / "text"
    train(LLAMA, ["--tiny", "--max_steps", "1", "--report_to", "none", "--output_dir", str(text)], "llama3_fft")
    for run_folder, image, key in [(out, str(tmp_path / "nope.png"), "--image"), (text, picture, "is a text model")]:
        with pytest.raises(SystemExit):
            generate_main([str(run_folder), "--prompt", QUESTION, "--image", image])
        captured = capsys.readouterr()
        assert_one_clear_line(captured.out + captured.err, key)
