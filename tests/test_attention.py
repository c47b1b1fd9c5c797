"""Attention that cannot crash on the GPU it is for: torch inductor lowers flex attention to a short-query kernel
under 128 query tokens, which has no kernel configuration for a GQA model when next_pow2(tokens x query heads per
key/value head) exceeds the mask's 128-row block (../shared/gpu/README.md: every packed decoder launch crashed in
its first forward). The rule is checked against that GPU's measurements; every batch the run's collators emit
under flex, for every family the toolkit knows, must be one the rule lowers; generation runs on sdpa."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT

from toolkit.data.packing import PackedCollator
from toolkit.models.attention import FLEX_BLOCK, choose_attention, flex_lowers, for_generation, pad_multiple

FAMILIES = sorted(p.stem.replace("--", "/") for p in (ROOT / "toolkit" / "hub_configs").glob("*--*.json"))


def heads_of(name: str) -> tuple[int, int]:
    from toolkit.data.sources import stored_config

    config = stored_config(name)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    return heads, kv


@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "lowers"),
    [(64, 4, 1, False), (100, 32, 8, False), (32, 4, 1, True), (64, 4, 4, True), (128, 4, 1, True)],
)
def test_flex_rule_is_what_the_h100_measured(tokens, heads, kv_heads, lowers):
    """../shared/gpu/README.md, "The cause of the flex crash": compiled flex_attention, document BlockMask, bf16,
    head_dim 16, forward and backward, on an H100 with torch 2.11."""
    assert flex_lowers(tokens, heads, kv_heads) is lowers


def test_the_rule_reads_torchs_own_conditions():
    """The rule restates inductor's (flex_decoding.py): the short-query kernel below 128 query tokens for a
    power-of-two head ratio, and its row tile against the mask's block. A torch that changes them fails here."""
    import inspect

    from torch._inductor.kernel.flex import flex_decoding
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

    source = inspect.getsource(flex_decoding)
    assert "sympy.Lt(query.get_size()[-2], 128)" in source
    assert 'SPARSE_Q_BLOCK_SIZE % kernel_options["BLOCK_M"] != 0' in source
    assert "next_power_of_2(" in source and "* gqa_shared_heads" in source
    assert _DEFAULT_SPARSE_BLOCK_SIZE == FLEX_BLOCK


def collators(pad: int | None):
    """The collators a run builds (data/preparation.py), with prepare_data's padding."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    from toolkit.models import tiny

    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return {
        "packed": PackedCollator(tokenizer.pad_token_id, pad_to_multiple_of=pad),
        "unpacked": DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True, pad_to_multiple_of=pad),
        "classification": DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad),
    }


def widths(collate, name: str, lengths) -> set[int]:
    out = set()
    for n in lengths:
        row = {"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))}
        if name == "packed":
            row["position_ids"] = list(range(n))
        if name == "classification":
            row = {"input_ids": row["input_ids"], "labels": 1}
        out.add(collate([row])["input_ids"].shape[1])
    return out


@pytest.mark.parametrize("collator", ["packed", "unpacked", "classification"])
def test_every_width_the_collators_emit_under_flex_lowers_for_every_family(collator):
    """Rows of every length up to 2,048 tokens (a batch is as wide as its longest row), through the collator a
    run builds under flex attention: every width is a multiple of the block, so inductor's main kernel takes it,
    for the head ratio of every family in toolkit/hub_configs/ (and their tiny versions: the same ratio). Without
    the padding, the GQA families crash at widths a real run produces (a short row, a short eval batch)."""
    ratios = {name: heads_of(name) for name in FAMILIES}
    emitted = widths(collators(pad_multiple("flex_attention"))[collator], collator, range(1, 2049))
    assert all(w % FLEX_BLOCK == 0 for w in emitted)
    for name, (heads, kv) in ratios.items():
        assert all(flex_lowers(w, heads, kv) for w in emitted), name
    unpadded = widths(collators(None)[collator], collator, range(1, 2049))
    crashing = {name for name, (heads, kv) in ratios.items() if not all(flex_lowers(w, heads, kv) for w in unpadded)}
    assert {"meta-llama/Meta-Llama-3-8B", "mistralai/Mistral-7B-v0.1", "google/gemma-3-1b-pt"} <= crashing


def test_only_flex_pads():
    assert pad_multiple("flex_attention") == FLEX_BLOCK
    assert {pad_multiple(k) for k in ("sdpa", "eager", "flash_attention_2", None)} == {None}


def test_a_flex_run_pads_its_batches(tmp_path):
    """The runner's data room with flex resolved (as on a GPU): the collator it builds pads, packed or not."""
    from llama3_fft import RECIPE

    from toolkit.data.preparation import prepare_data
    from toolkit.models.loading import blueprint
    from toolkit.models.tiny import tiny_layer
    from toolkit.settings.parser import parse

    for packing in ("true", "false"):
        args = parse(RECIPE, "llama3_fft", ["--tiny", "--attn_implementation", "flex_attention", "--packing", packing,
                                            "--output_dir", str(tmp_path)], tiny_defaults=tiny_layer)  # fmt: skip
        plan = blueprint(args)
        data = prepare_data(args, plan.tokenizer, plan.packing, pad_multiple(args.model.attn_implementation))
        batch = data.collator([data.train[i] for i in range(3)])
        assert batch["input_ids"].shape[1] % FLEX_BLOCK == 0, packing


def test_auto_says_it_pads_and_generates_with_sdpa(monkeypatch):
    import transformers.utils
    from transformers import LlamaConfig

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    name, note = choose_attention(LlamaConfig(), "auto", "sft", True, on_gpu=True)
    assert name == "flex_attention" and f"padded to multiples of {FLEX_BLOCK}" in note and "sdpa" in note


def test_generation_samples_run_on_sdpa_under_flex(tmp_path):
    """GenerationSamples on a model that trains with flex attention: every forward of the generation runs sdpa
    (prompts of any length, one-token steps), and the model trains with flex again afterwards."""
    from transformers import AutoModelForCausalLM

    from toolkit.data.conversations import apply_chat_template_setting
    from toolkit.metrics.samples import Prompt
    from toolkit.models import tiny
    from toolkit.training.generation_samples import GenerationSamples

    checkpoint = tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="flex_attention")
    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    apply_chat_template_setting(tokenizer, "llama3")
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation)
    )

    from types import SimpleNamespace

    args = SimpleNamespace(device=torch.device("cpu"), output_dir=str(tmp_path))
    trainer = SimpleNamespace(model=model, model_wrapped=model, processing_class=tokenizer, args=args)
    prompts = [Prompt([{"role": "user", "content": "What is 2 + " + "3 + " * n + "1?"}], "x") for n in (1, 20)]
    answers = GenerationSamples(trainer, prompts, max_new_tokens=4, synced=False).generate()
    assert len(answers) == 2 and seen and set(seen) == {"sdpa"}
    assert model.config._attn_implementation == "flex_attention"
    with for_generation(model):
        assert model.model.layers[1].self_attn.config._attn_implementation == "sdpa"
    assert model.model.layers[1].self_attn.config._attn_implementation == "flex_attention"
