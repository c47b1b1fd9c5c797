"""SFT data formats (messages, ShareGPT, Alpaca, prompt/completion, text) and weighted mixtures: each format's loss
mask against tokens built independently, detection, the mixture's proportions, and runs on them."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import no_lock
from llama3_fft import RECIPE as LLAMA3_FFT

from toolkit import train
from toolkit.data.conversations import tokenize_conversation
from toolkit.data.loading import load_data
from toolkit.data.packing import IGNORE_INDEX
from toolkit.data.preparation import prepare
from toolkit.errors import ConfigError, DataError
from toolkit.settings.arguments import DataArguments


@pytest.fixture
def tok(llama_tokenizer):
    return llama_tokenizer


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def prepared(path, tok, **settings):
    args = DataArguments(task="sft", dataset_name=path, max_seq_length=settings.pop("max_seq_length", 512), **settings)
    raw, read = load_data(args)
    return prepare(raw, tok, args, no_lock).train, read


def trained(row):
    return [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_sharegpt_and_alpaca_rows_train_as_the_conversations_they_are(tok, tmp_path):
    """Labels equal those of the same conversation in messages form: the answers and their <|eot_id|> only."""
    turns = [("system", "Be brief."), ("human", "Hi?"), ("gpt", "Hello."), ("human", "Bye?"), ("gpt", "Bye.")]
    sharegpt = [{"from": who, "value": said} for who, said in turns]
    rows, read = prepared(write(tmp_path / "sharegpt.jsonl", [{"conversations": sharegpt, "id": 7}] * 2), tok)
    assert read.endswith("sharegpt.jsonl (sharegpt, detected)")
    messages = [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
                for t in sharegpt]  # fmt: skip
    assert rows[0]["labels"] == tokenize_conversation(tok, messages, 512)["labels"]
    assert trained(rows[0]) == ids(tok, "Hello.<|eot_id|>Bye.<|eot_id|>")

    alpaca = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
              {"instruction": "Name a colour.", "input": "", "output": "Blue"}]  # fmt: skip
    rows, read = prepared(write(tmp_path / "alpaca.jsonl", alpaca), tok)
    assert read.endswith("(alpaca, detected)")
    with_input = [{"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "5"}]
    assert rows[0]["input_ids"] == tokenize_conversation(tok, with_input, 512)["input_ids"]
    assert [trained(row) for row in rows] == [ids(tok, "5<|eot_id|>"), ids(tok, "Blue<|eot_id|>")]


def test_prompt_completion_trains_on_the_completion_only(tok, tmp_path):
    """Text: not templated, prompt tokens masked, completion + EOS trained. Conversational: an assistant turn in
    the prompt is not trained, the completion's is."""
    row = {"prompt": "The capital of France is", "completion": " Paris."}
    rows, read = prepared(write(tmp_path / "pc.jsonl", [row]), tok, data_format="prompt_completion")
    assert read.endswith("(prompt_completion)")
    prompt = tok("The capital of France is")["input_ids"]  # with BOS, as a model reads a document
    assert rows[0]["input_ids"] == prompt + ids(tok, " Paris.") + [tok.eos_token_id]
    assert rows[0]["labels"] == [IGNORE_INDEX] * len(prompt) + ids(tok, " Paris.") + [tok.eos_token_id]

    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "2+2?"}]  # fmt: skip
    rows, _ = prepared(write(tmp_path / "pcc.jsonl", [{"prompt": earlier, "completion": [
        {"role": "assistant", "content": "4."}]}]), tok)  # fmt: skip
    assert trained(rows[0]) == ids(tok, "4.<|eot_id|>")


def test_text_is_trained_on_every_token_and_cut_into_rows_not_truncated(tok, tmp_path):
    words = " ".join(f"word{i}" for i in range(300))
    rows, read = prepared(write(tmp_path / "text.jsonl", [{"text": words}, {"text": "Short one."}]), tok,
                          max_seq_length=64, packing=False)  # fmt: skip
    assert read.endswith("(text, detected)")
    assert all(row["labels"] == row["input_ids"] and len(row["input_ids"]) <= 64 for row in rows)
    long, short = (tok(text)["input_ids"] + [tok.eos_token_id] for text in (words, "Short one."))
    assert len(rows) == 1 + -(-len(long) // 64) and len(long) > 64
    assert Counter(t for row in rows for t in row["input_ids"]) == Counter(long + short)  # every token, once


def test_the_format_is_detected_or_named_with_the_fix(tmp_path, tok):
    with pytest.raises(DataError, match=r"match no SFT format .*alpaca: instruction, output"):
        prepared(write(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}]), tok)
    with pytest.raises(DataError, match=r"no column \['prompt', 'completion'\].*--data_format \(it is prompt_"):
        prepared(write(tmp_path / "text.jsonl", [{"text": "t"}]), tok, data_format="prompt_completion")
    with pytest.raises(DataError, match="row 1 of the train split of .*: its output is empty"):
        rows = [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": ""}]
        prepared(write(tmp_path / "bad.jsonl", rows), tok)
    with pytest.raises(ConfigError, match="data_format 'chatml' is not one of messages, sharegpt"):
        DataArguments(task="sft", dataset_name="x", data_format="chatml")


def test_a_mixture_takes_each_sources_fraction_seeded_and_shuffled_together(tok, tmp_path):
    """alignment-handbook's semantics: a fraction of each source's train rows (above 1: whole copies, then a
    sample), one shuffle; each source's held-out rows kept whole. Conversational formats mix."""
    chats = [[{"role": "user", "content": f"c{i}"}, {"role": "assistant", "content": "chat"}] for i in range(200)]
    chat = write(tmp_path / "chat.jsonl", [{"messages": messages} for messages in chats])
    alpaca = write(tmp_path / "alpaca.jsonl", [{"instruction": f"a{i}", "output": "alpaca"} for i in range(50)])
    args = DataArguments(task="sft", dataset_name="ignored", dataset_mixture=f"{chat}=0.25,{alpaca}=2.5",
                         eval_fraction=0.2)  # fmt: skip
    raw, read = load_data(args)
    assert (
        read == f"a mixture of {chat} (messages, detected) x0.25 = 40 rows, {alpaca} (alpaca, detected) x2.5 = 100 rows"
    )
    source = [m[1]["content"] for m in raw["train"]["messages"]]
    assert Counter(source) == {"chat": 40, "alpaca": 100}
    assert abs(source[:70].count("alpaca") - 50) <= 12  # shuffled together: no source's rows all at one end
    assert len(raw["eval"]) == 40 + 10 and Counter(m[1]["content"] for m in raw["eval"]["messages"])["alpaca"] == 10
    alpaca_rows = Counter(m[0]["content"] for m in raw["train"]["messages"] if m[1]["content"] == "alpaca")
    assert max(alpaca_rows.values()) - min(alpaca_rows.values()) <= 1 and len(alpaca_rows) == 40  # 2 copies + half
    again, _ = load_data(args)
    assert again["train"]["messages"] == raw["train"]["messages"]  # seeded
    assert DataArguments(task="sft", dataset_mixture={chat: 1, alpaca: "0.5"}).sources() == {chat: 1.0, alpaca: 0.5}

    text = write(tmp_path / "text.jsonl", [{"text": "t"}])
    with pytest.raises(DataError, match="formats that do not mix"):
        load_data(DataArguments(task="sft", dataset_mixture=f"{chat}=1,{text}=1"))
    with pytest.raises(ConfigError, match="positive fractions of their rows: 'org/chat=0.5,local.jsonl=1'"):
        DataArguments(task="sft", dataset_mixture=f"{chat}=0.5,{alpaca}").sources()


def test_runs_train_on_a_mixture_and_on_text(tmp_path, capsys):
    """End to end, 1 process: ShareGPT mixed with Alpaca (the header names them), and continued pre-training on
    text with packing."""
    sharegpt = write(tmp_path / "sharegpt.jsonl", [{"conversations": [{"from": "human", "value": f"Say {w}."},
                                                                      {"from": "gpt", "value": w}]}
                                                   for w in ["yes", "no", "maybe"] * 20])  # fmt: skip
    alpaca = write(tmp_path / "alpaca.jsonl", [{"instruction": f"Repeat {w}.", "output": w} for w in ["a", "b"] * 20])
    common = ["--tiny", "--report_to", "none", "--max_steps", "2", "--per_device_train_batch_size", "4"]
    result = train(LLAMA3_FFT, [*common, "--dataset_mixture", f"{sharegpt}=1,{alpaca}=0.5", "--output_dir",
                                str(tmp_path / "mix")], "llama3_fft")  # fmt: skip
    assert len(result.trainer.train_dataset) > 0 and result.metrics["train_loss"] > 0
    assert "(sharegpt, detected) x1 = 60 rows" in capsys.readouterr().out

    text = write(tmp_path / "text.jsonl", [{"text": " ".join(["lorem ipsum dolor"] * (20 + i))} for i in range(30)])
    result = train(LLAMA3_FFT, [*common, "--dataset_name", text, "--chat_template", "none", "--packing", "true",
                                "--output_dir", str(tmp_path / "text")], "llama3_fft")  # fmt: skip
    batch = next(iter(result.trainer.get_train_dataloader()))
    real = batch["labels"] != IGNORE_INDEX
    assert real.float().mean() > 0.9  # packed documents, every token trained
    assert "(text, detected)" in capsys.readouterr().out
