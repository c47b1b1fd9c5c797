"""Packing: rows filled best-fit-decreasing, and no token attends or is trained across a conversation boundary."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.data.packing import IGNORE_INDEX, SEQUENCES, PackedCollator, pack, supports_packing
from toolkit.models import tiny


def test_best_fit_decreasing_fills_rows_tightly():
    """TRL's packer under the toolkit's marks: 24 tokens in 3 rows of 8 (the optimum, which BFD finds), every
    conversation once and whole, its positions from 0 and its first label ignored."""
    lengths = [6, 5, 4, 3, 2, 2, 1, 1]
    convs = [[100 * (i + 1) + k for k in range(n)] for i, n in enumerate(lengths)]
    packed = pack(Dataset.from_dict({"input_ids": convs, "labels": convs}), 8)
    assert packed["length"] == [8, 8, 8]
    found = []
    for row in packed:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in zip(starts, starts[1:], strict=False):
            found.append(row["input_ids"][a:b])
            assert row["position_ids"][a:b] == list(range(b - a))
            assert row["labels"][a:b] == [IGNORE_INDEX, *row["input_ids"][a + 1 : b]]
    assert sorted(found) == sorted(convs)
    assert pack(Dataset.from_dict({"input_ids": [[1] * 8, [2] * 8, [3]], "labels": [[1] * 8, [2] * 8, [3]]}),
                8)["length"] == [8, 8, 1]  # fmt: skip


def conversations(n: int, vocab: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = {"input_ids": [], "labels": []}
    for length in torch.randint(5, 30, (n,), generator=g).tolist():
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        rows["input_ids"].append(ids)
        rows["labels"].append([IGNORE_INDEX] * (length // 2) + ids[length // 2 :])  # "assistant" second half
    return Dataset.from_dict(rows)


@pytest.fixture(scope="module")
def llama():
    config = AutoConfig.from_pretrained(tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft"))
    torch.manual_seed(0)
    return config


@pytest.mark.parametrize(("attention", "flatten"), [("sdpa", False), ("sdpa", True), ("eager", False),
                                                    ("eager", True), ("flex_attention", False)])  # fmt: skip
def test_packed_logits_and_loss_equal_each_conversation_alone(llama, attention, flatten, monkeypatch):
    assert supports_packing(llama)
    if attention == "flex_attention":
        # What --attn_implementation auto gives packed rows on a GPU. torch's CPU compiler cannot build flex
        # attention's kernel here (and has no backward for it): run it uncompiled, from the same BlockMask
        # transformers builds from the position ids' restarts.
        import transformers.integrations.flex_attention as flex
        from torch.nn.attention.flex_attention import flex_attention

        monkeypatch.setattr(flex, "compile_friendly_flex_attention",
                            lambda q, k, v, training=False, **kwargs: flex_attention(q, k, v, **kwargs))  # fmt: skip
    model = AutoModelForCausalLM.from_config(llama, attn_implementation=attention, dtype=torch.float32).eval()
    data = conversations(12, llama.vocab_size)
    packed = pack(data, max_seq_length=64)
    assert len(packed) < len(data) and all(len(row) <= 64 for row in packed["input_ids"])
    batch = PackedCollator(pad_token_id=0, flatten=flatten)([packed[i] for i in range(len(packed))])
    assert batch[SEQUENCES] == len(data) and batch["use_cache"] is False
    assert batch["input_ids"].shape[0] == (1 if flatten else len(packed))
    # for counting tokens only (RecipeTrainer keeps it from the model); a flattened row without padding has none
    mask = batch.pop("attention_mask", torch.ones_like(batch["input_ids"]))
    assert int(mask.sum()) == sum(map(len, data["input_ids"]))
    del batch[SEQUENCES]

    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        loss_sum, targets, found = 0.0, 0, 0
        for r in range(len(logits)):
            real = int(mask[r].sum())
            starts = (batch["position_ids"][r, :real] == 0).nonzero().flatten().tolist() + [real]
            for start, end in zip(starts, starts[1:], strict=False):
                ids = batch["input_ids"][r : r + 1, start:end]
                labels = torch.tensor([data["labels"][data["input_ids"].index(ids[0].tolist())]])
                alone = model(input_ids=ids, labels=labels)
                torch.testing.assert_close(logits[r, start:end], alone.logits[0], rtol=1e-4, atol=1e-5)
                assert batch["labels"][r, start] == IGNORE_INDEX  # nothing trained to predict the next conversation
                n = int(labels[0, 1:].ne(IGNORE_INDEX).sum())
                loss_sum, targets, found = loss_sum + alone.loss.item() * n, targets + n, found + 1
        packed_loss = model(**batch).loss.item()
    assert found == len(data)  # every conversation, once
    assert packed_loss == pytest.approx(loss_sum / targets, rel=1e-4)  # the same targets, the same loss


def test_packing_only_where_it_is_correct(llama):
    from transformers import PretrainedConfig

    from toolkit.data.packing import use_packing
    from toolkit.errors import ConfigError

    class RemoteCodeConfig(PretrainedConfig):  # a model with its own code: its masks are unknown
        model_type = "my_remote_model"

    assert use_packing("sft", None, llama) is True  # the default for SFT where the model supports it
    assert use_packing("sft", False, llama) is False
    assert use_packing("sft", None, RemoteCodeConfig()) is False
    with pytest.raises(ConfigError, match="conversations would see each other: pass --packing false"):
        use_packing("sft", True, RemoteCodeConfig())
    with pytest.raises(ConfigError, match="applies to sft recipes"):
        use_packing("classification", True, llama)
    assert use_packing("classification", None, llama) is False


@pytest.mark.parametrize(
    ("model", "setting", "packing", "on_gpu", "flash", "chosen", "why"),
    [
        ("llama", "auto", True, True, False, "flex_attention", "document mask"),
        ("llama", "auto", True, True, True, "flash_attention_2", "varlen"),
        ("llama", "auto", True, False, False, "sdpa", "flex attention does not train"),
        ("llama", "auto", False, True, True, "sdpa", "auto"),  # no packed rows: nothing masked to skip
        ("gpt2", "auto", True, True, False, "sdpa", "no flex attention"),
        ("gemma2", "auto", True, False, False, None, "no sdpa"),  # the model's own default: eager
        ("gemma2", "auto", True, True, False, "flex_attention", "document mask"),
        ("llama", "eager", True, True, True, "eager", ""),  # asked for: honoured
    ],
)
def test_auto_attention_skips_masked_blocks_where_it_can(model, setting, packing, on_gpu, flash, chosen, why,
                                                        monkeypatch):  # fmt: skip
    import transformers.utils
    from transformers import Gemma2Config, GPT2Config, LlamaConfig

    from toolkit.models.attention import choose_attention

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: flash)
    config = {"llama": LlamaConfig, "gpt2": GPT2Config, "gemma2": Gemma2Config}[model]()
    name, note = choose_attention(config, setting, "sft", packing, on_gpu=on_gpu)
    assert name == chosen and why in note and bool(note) == bool(why), note
