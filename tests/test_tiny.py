"""Tiny mode keeps each recipe's architecture; the stored configs are the published ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from toolkit.errors import ConfigError
from toolkit.models import tiny
from toolkit.project import load_recipe, recipe_names


def meta_parameters(config) -> int:
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_stored_configs_give_published_parameter_counts():
    # Published: bert-base-cased's BertModel 108,310,272; Meta-Llama-3-8B 8,030,261,248 (model card),
    # of which the untied lm_head is vocab x hidden = 128,256 x 4,096.
    assert meta_parameters(tiny.stored_config("google-bert/bert-base-cased")) == 108_310_272
    llama = tiny.stored_config("meta-llama/Meta-Llama-3-8B")
    assert meta_parameters(llama) + 128_256 * 4_096 == 8_030_261_248


def test_tiny_llama_keeps_the_architecture():
    tok = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    real, small = tiny.stored_config("meta-llama/Meta-Llama-3-8B"), tiny.tiny_config("meta-llama/Meta-Llama-3-8B", tok)
    assert small.model_type == real.model_type == "llama"
    for key in ("hidden_act", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "attention_bias"):
        assert getattr(small, key) == getattr(real, key), key
    # grouped-query attention kept: 32 heads / 8 KV heads -> 4 / 1
    assert small.num_attention_heads // small.num_key_value_heads == 4
    assert small.hidden_size == 64 and small.num_hidden_layers == 2
    assert small.vocab_size == len(tok)
    # Meta-Llama-3-8B's end of sequence, not its chat turns' <|eot_id|> (which hid that answers must stop at both)
    assert small.eos_token_id == tok.convert_tokens_to_ids("<|end_of_text|>")


HUB_CONFIGS = Path(tiny.__file__).parent.parent / "hub_configs"
STORED = sorted(path.stem.replace("--", "/", 1) for path in HUB_CONFIGS.glob("*--*.json")
                if "vision_config" not in path.read_text())  # fmt: skip  # image-text: tiny_vision's own tests


@pytest.mark.parametrize("name", STORED)
def test_tiny_mode_keeps_each_familys_structure(name):
    """Every family with a stored config keeps at toy size what makes it differ (issue 65: the tiny Qwen3-MoE
    routed every token to all 4 of its experts, and dropout was switched off): a top-k below the experts, shared
    experts, dense layers beside expert layers, grouped routing, dropout, each kind of layer, a sliding window,
    a tied head, latent attention, grouped-query attention; and the tiny model builds and runs."""
    from toolkit.settings.tasks import model_class

    real = tiny.stored_config(name)
    small = tiny.shrunk_config(tiny.stored_config(name), 512)
    assert tiny.structure(small) == tiny.structure(real)
    if small.get_text_config().to_dict().get("sliding_window"):  # short enough to mask inside the tiny rows
        assert small.sliding_window < tiny.TINY_TRAINING["max_seq_length"]
    task = "classification" if tiny.is_encoder(name) else "sft"
    logits = model_class(task).from_config(small)(input_ids=torch.randint(1, 500, (2, 40))).logits
    assert torch.isfinite(logits).all()


def test_dropout_is_the_familys_unless_set(tmp_path):
    """Tiny BERT keeps its 0.1 dropout (a train-mode path a run shows); --dropout 0 switches every probability the
    config sets off, as runs compared number for number across process counts need."""
    from toolkit import train

    for flags, expected in (([], 0.1), (["--dropout", "0"], 0.0)):
        result = train(load_recipe("bert"), ["--tiny", "--max_steps", "1", "--report_to", "none", *flags,
                                             "--output_dir", str(tmp_path / str(expected))], "bert")  # fmt: skip
        config = result.trainer.model.config
        assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == expected


def test_tiny_bert_tokenizer_is_bert_like():
    tok = tiny.tiny_tokenizer("google-bert/bert-base-cased", "classification")
    ids = tok("great film", "awful plot")["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[0] == "[CLS]" and ids.count(tok.sep_token_id) == 2


def test_tiny_data_is_deterministic_and_unique():
    rows = tiny.classification_rows()
    assert rows == tiny.classification_rows()
    assert len({r["text"] for r in rows}) == len(rows)
    assert {r["label"] for r in rows} == {0, 1}
    assert tiny.write_tiny_dataset("sft") == tiny.write_tiny_dataset("sft")


def test_tiny_mode_for_an_unknown_model_says_how_to_add_it():
    with pytest.raises(ConfigError, match=r"No stored config for 'acme/unknown-7b'.*meta-llama/Meta-Llama-3-8B"):
        tiny.stored_config("acme/unknown-7b")


@pytest.mark.parametrize(
    "recipe",
    [n for n in recipe_names() if n not in ("llama3_dpo", "llama3_dpo_lora", "smollm2_grpo_tools", "smollm2_distill")],
)
def test_every_recipes_tiny_settings_are_accepted(recipe):
    """`--tiny` runs any recipe: its settings, with tiny mode's layer over them, pass every check a run makes of
    them (smollm2_chat's generation samples and minilm_bbc's evaluation after training need held-out rows, which
    tiny mode holds none of: it turns them off too). The DPO recipes and the tool demo's GRPO stage start from an
    SFT run's output folder, the distillation demo from its first stage's teacher."""
    from toolkit.settings.parser import parse

    args = parse(load_recipe(recipe), recipe, ["--tiny", "--report_to", "none"], tiny_defaults=tiny.tiny_layer)
    assert args.run.tiny and args.training.max_steps == 20
