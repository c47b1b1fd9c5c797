"""Tiny mode keeps each recipe's architecture; the stored configs are the published ones."""

from __future__ import annotations

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


@pytest.mark.parametrize("recipe", [name for name in recipe_names() if name not in ("llama3_dpo", "llama3_dpo_lora")])
def test_every_recipes_tiny_settings_are_accepted(recipe):
    """`--tiny` runs any recipe: its settings, with tiny mode's layer over them, pass every check a run makes of
    them (smollm2_chat's generation samples and minilm_bbc's evaluation after training need held-out rows, which
    tiny mode holds none of: it turns them off too). The DPO recipes start from an SFT run's output folder."""
    from toolkit.settings.parser import parse

    args = parse(load_recipe(recipe), recipe, ["--tiny", "--report_to", "none"], tiny_defaults=tiny.tiny_layer)
    assert args.run.tiny and args.training.max_steps == 20
