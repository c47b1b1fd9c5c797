"""`python -m toolkit check`: a strategy file's mistakes found in a second, before `accelerate launch`."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import ROOT

from toolkit.distributed.launch_check import check
from toolkit.errors import ConfigError

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))


# SmolLM2-135M: tied embeddings, 9 heads, 3 key/value heads
SMOLLM2_SFT = ("smollm2_chat", "smollm2_tools_sft", "smollm2_shop_sft")
# the recipes that sample completions, and their tasks
ONLINE = {"smollm2_grpo": "grpo", "qwen3_grpo": "grpo", "qwen3_grpo_tools": "grpo", "smollm2_rloo": "rloo",
          "qwen3_distill": "distill", "smollm2_grpo_tools": "grpo", "smollm2_distill": "distill",
          "smollm2_grpo_env": "grpo"}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_passes_with_every_recipe(config):
    """Every pair passes but QLoRA's under a sharding engine or tensor parallelism, which is refused by name (its
    4-bit base is replicated), and under tensor parallelism the encoders' (transformers has no TP plan for them)
    and SmolLM2's (heads that 2 ranks cannot split); under a sequence split the recipes that are not SFT, and
    SmolLM2's 9 heads over 8 Ulysses ranks; FP8 on this machine (no FP8 tensor cores), QLoRA's first; under
    pipeline stages all but the SFT recipes of untied decoders in 16 or 32 bits; GRPO under any of those axes; the
    image-text recipe under any of them (Gemma 3's composite model has no tensor-parallel plan of its own); under
    expert parallelism all but the full fine-tune of a mixture of experts (the models another run writes, the DPO
    recipes' and the tool demo's GRPO stage's, are checked when they load), and LoRA on fused experts under tensor
    parallelism."""
    text = config.read_text()
    experts = "parallelism_config_ep_size" in text
    pipeline = "parallelism_config_pp_size" in text
    tensor = "parallelism_config_tp_size" in text
    split = "parallelism_config_cp_size" in text or "parallelism_config_sp_size" in text
    sharding = any(f"distributed_type: {kind}" in text for kind in ("FSDP", "DEEPSPEED")) or tensor
    for recipe in RECIPES:
        if experts and recipe in ("qwen3_moe_fft", "llama3_dpo", "llama3_dpo_lora", "smollm2_grpo_tools"):
            assert check(config, recipe).endswith(": ok")
        elif experts:
            message = "LoRA under expert parallelism" if recipe == "qwen3_moe_lora" else "is a dense model"
            with pytest.raises(ConfigError, match=message):
                check(config, recipe)
        elif tensor and recipe == "qwen3_moe_lora":
            with pytest.raises(ConfigError, match="LoRA on a mixture of experts' fused experts under tensor"):
                check(config, recipe)
        elif "mixed_precision: fp8" in text:  # QLoRA's combination, then this machine: no FP8 tensor cores
            message = "with mixed_precision fp8" if recipe == "llama3_qlora" else "this machine has no CUDA GPU"
            with pytest.raises(ConfigError, match=message):
                check(config, recipe)
        elif (pipeline or tensor or split) and recipe in ONLINE:
            name = ONLINE[recipe]
            trainer = "DistillationTrainer" if name == "distill" else f"{name.upper()}Trainer"
            with pytest.raises(ConfigError, match=f"under {name}: TRL's {trainer} samples completions"):
                check(config, recipe)
        elif pipeline and recipe in ("bert", "minilm_bbc", "llama3_dpo", "llama3_dpo_lora", "qwen3_reward", "qwen3_kto",
                                     "gemma3_vlm_lora", "qwen2_5_vl_lora"):  # fmt: skip
            with pytest.raises(ConfigError, match="run a causal language model's SFT loss on the last stage"):
                check(config, recipe)
        elif pipeline and recipe == "llama3_qlora":
            with pytest.raises(ConfigError, match="QLoRA \\(--load_in_4bit\\) under pipeline stages"):
                check(config, recipe)
        elif pipeline and recipe in SMOLLM2_SFT:  # tied embeddings: on the first and the last stage
            with pytest.raises(ConfigError, match="ties its output head to its input embeddings"):
                check(config, recipe)
        elif split and recipe in ("bert", "minilm_bbc", "llama3_dpo", "llama3_dpo_lora", "qwen3_reward", "qwen3_kto",
                                  "gemma3_vlm_lora", "qwen2_5_vl_lora"):  # fmt: skip
            with pytest.raises(ConfigError, match="splits the rows of a causal language model"):
                check(config, recipe)
        elif split and recipe in SMOLLM2_SFT and "sp_size" in text:  # 9 heads over 8 ranks
            with pytest.raises(ConfigError, match="sp_size 8 does not divide the model's 9 attention heads"):
                check(config, recipe)
        elif recipe == "llama3_qlora" and sharding:
            with pytest.raises(ConfigError, match="QLoRA \\(--load_in_4bit\\) trains under single_gpu.yaml or ddp"):
                check(config, recipe)
        elif recipe in ("bert", "minilm_bbc", "gemma3_vlm_lora", "qwen2_5_vl_lora") and tensor:
            with pytest.raises(ConfigError, match="has no tensor-parallel plan in transformers"):
                check(config, recipe)
        elif recipe in SMOLLM2_SFT and tensor:  # SmolLM2-135M: 9 heads, 3 key/value heads
            with pytest.raises(ConfigError, match="tp_size 2 does not divide the model's 9 attention heads"):
                check(config, recipe)
        else:
            assert check(config, recipe).endswith(": ok")


def edited(tmp_path, name: str, edit) -> str:
    """A copy of accelerate_configs/NAME.yaml (and its DeepSpeed JSON) with `edit(text) -> text` applied."""
    text = (ROOT / "accelerate_configs" / f"{name}.yaml").read_text()
    path = tmp_path / f"{name}.yaml"
    path.write_text(edit(text))
    return str(path)


def broken_json(tmp_path, edit) -> str:
    values = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    ds = tmp_path / "zero3.json"
    ds.write_text(edit(values))
    return edited(tmp_path, "zero3", lambda t: t.replace("ds_configs/zero3.json", str(ds)))


CASES = {
    "missing file": (lambda tmp: str(tmp / "nope.yaml"), "Config file not found", "accelerate_configs/: ddp.yaml"),
    "malformed YAML": (lambda tmp: edited(tmp, "ddp", lambda t: t + "\n  bad: [unclosed\n"), "is not valid YAML", ""),
    "misspelled key": (
        lambda tmp: edited(tmp, "ddp", lambda t: t.replace("mixed_precision:", "mixed_precison:")),
        "Unknown key 'mixed_precison'",
        "Did you mean 'mixed_precision'?",
    ),
    "misspelled FSDP key": (
        lambda tmp: edited(tmp, "fsdp2", lambda t: t.replace("fsdp_state_dict_type", "fsdp_state_dict_typ")),
        "Unknown key 'fsdp_state_dict_typ' under fsdp_config",
        "Did you mean 'fsdp_state_dict_type'?",
    ),
    "FSDP and DeepSpeed": (
        lambda tmp: edited(
            tmp, "fsdp2", lambda t: t + "deepspeed_config:\n  deepspeed_config_file: ds_configs/zero3.json\n"
        ),
        "is an FSDP config with a deepspeed_config section",
        "accelerate_configs/zero3.yaml",
    ),
    "malformed JSON": (
        lambda tmp: broken_json(tmp, lambda v: json.dumps(v)[:-1] + ",}"),
        "is not valid JSON",
        "",
    ),
    "unknown ZeRO key": (
        lambda tmp: broken_json(
            tmp,
            lambda v: json.dumps(
                {**v, "zero_optimization": {**v["zero_optimization"], "stage3_gather_16bit_weights_on_model_sav": True}}
            ),
        ),  # fmt: skip
        "DeepSpeed rejects",
        "stage3_gather_16bit_weights_on_model_sav",
    ),
    "layer class the model lacks": (
        lambda tmp: edited(
            tmp,
            "fsdp2",
            lambda t: t.replace(
                "fsdp_transformer_layer_cls_to_wrap: null", "fsdp_transformer_layer_cls_to_wrap: GPT2Block"
            ),
        ),  # fmt: skip
        "names ['GPT2Block'], which google-bert/bert-base-cased does not have; its layers are ['BertLayer']",
        "Set it to null",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_config_is_one_message_naming_the_fix(tmp_path, case):
    make, message, fix = CASES[case]
    with pytest.raises(ConfigError) as error:
        check(make(tmp_path), "bert")
    assert message in str(error.value) and fix in str(error.value)


def test_offload_without_a_compiler_says_how_to_get_one(monkeypatch):
    from deepspeed.ops.op_builder import CPUAdamBuilder

    monkeypatch.setattr(CPUAdamBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(ConfigError, match="DeepSpeed's CPU Adam cannot be built here .* build-essential"):
        check(ROOT / "accelerate_configs" / "zero2_offload.yaml")
    assert check(ROOT / "accelerate_configs" / "zero2.yaml").endswith(": ok")  # no offload, no build


def test_make_finetune_checks_before_launching(tmp_path):
    """`make finetune` with an unknown recipe: one line, exit 2, no process launched (so no output folder)."""
    result = subprocess.run(["make", "-s", "finetune", "MODEL=bertt", "CONFIG=ddp"], cwd=ROOT, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode != 0
    assert "error: No recipe 'bertt' in recipes/. Known: bert, gemma3_vlm_lora, llama3_dpo" in result.stderr
    assert "No such file" not in result.stderr  # accelerate never started the missing script


def test_a_recipe_is_named_as_the_launch_names_it():
    """`toolkit check accelerate_configs/pp.yaml recipes/bert.py`, the launch's own spelling, answered "No recipe
    'recipes/bert.py'": the path's recipe is checked (here refused, as the launch would refuse it)."""
    config = ROOT / "accelerate_configs" / "ddp.yaml"
    assert check(config, "recipes/bert.py") == check(config, "bert") == "ddp.yaml: MULTI_GPU, recipe bert: ok"
    with pytest.raises(ConfigError, match="classification recipe is not supported"):
        check(ROOT / "accelerate_configs" / "pp.yaml", "recipes/bert.py")
