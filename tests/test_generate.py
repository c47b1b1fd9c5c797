"""Talking to a trained model: `python -m toolkit generate` and `chat` load a full model, a merged one, or a LoRA
adapter on its base, with the chat template the run trained with."""

from __future__ import annotations

import pytest
from bert import RECIPE as BERT
from llama3_fft import RECIPE as LLAMA3_FFT
from llama3_lora import RECIPE as LLAMA3_LORA

from toolkit import train
from toolkit.__main__ import entry

PROMPTS = ["What is 2 plus 3?", "What is 10 plus 20?"]
SHORT = ["--tiny", "--max_steps", "8", "--report_to", "none"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    train(LLAMA3_LORA, [*SHORT, "--merge_lora", "true", "--output_dir", str(root / "lora")], "llama3_lora")
    train(LLAMA3_FFT, [*SHORT, "--output_dir", str(root / "full")], "llama3_fft")
    train(BERT, [*SHORT, "--output_dir", str(root / "bert")], "bert")
    return {"adapter": root / "lora", "merged": root / "lora" / "merged", "full": root / "full", "bert": root / "bert"}


def generated(folder, capsys, *flags: str) -> list[str]:
    """The answers `python -m toolkit generate` streams, one per prompt."""
    capsys.readouterr()
    argv = [str(folder), *(f for p in PROMPTS for f in ("--prompt", p)), "--max_new_tokens", "12", *flags]
    assert entry("generate")(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("> ")] == [f"> {p}" for p in PROMPTS]
    return [lines[i + 1] if i + 1 < len(lines) else "" for i, line in enumerate(lines) if line.startswith("> ")]


def test_generate_is_the_models_greedy_continuation_under_its_chat_template(runs, capsys):
    """What the command prints is what transformers' own greedy generate gives for the run's saved template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    answers = generated(runs["full"], capsys)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(runs["full"]), AutoTokenizer.from_pretrained(runs["full"])
    assert tokenizer.chat_template and "<|start_header_id|>" in tokenizer.chat_template  # the run's llama3 template
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert answer.strip() == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert any(answers)


def test_an_adapter_on_its_base_answers_as_its_merged_model(runs, capsys):
    """Two loading paths, one model: the adapter applied to the base it names, and the weights merged on disk."""
    assert (runs["adapter"] / "adapter_config.json").is_file() and not (runs["adapter"] / "model.safetensors").exists()
    assert generated(runs["adapter"], capsys) == generated(runs["merged"], capsys)


def test_sampling_is_seeded(runs, capsys):
    sampled = [generated(runs["full"], capsys, "--temperature", "1.5", "--seed", str(seed)) for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # the same seed, the same answers


def test_chat_keeps_the_conversation_and_starts_over_on_reset(runs, capsys, monkeypatch):
    import toolkit.generate as generate

    said = iter(["What is 2 plus 3?", "And 4 plus 4?", "/reset", "What is 2 plus 3?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(said))
    seen, answer = [], generate.answer

    def recorded(model, tokenizer, messages, args, stream=True):
        seen.append([dict(m) for m in messages])
        return answer(model, tokenizer, messages, args, stream)

    monkeypatch.setattr(generate, "answer", recorded)
    assert entry("chat")([str(runs["adapter"]), "--max_new_tokens", "8", "--system", "Be brief."]) == 0
    assert [len(messages) for messages in seen] == [2, 4, 2]  # system + the conversation so far; reset keeps system
    assert seen[1][2]["role"] == "assistant" and seen[0] == seen[2]
    assert capsys.readouterr().out.count("model> ") == 3


@pytest.mark.parametrize(("folder", "key"), [("bert", "it labels text"), ("missing", "holds no model")])
def test_generate_refuses_what_it_cannot_talk_to(runs, folder, key, capsys, tmp_path):
    path = runs.get(folder, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        entry("generate")([str(path), "--prompt", "hello"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_answers_stop_at_the_end_of_a_llama3_turn(tmp_path, capsys):
    """Meta's real Llama 3 tokenizer (llama-models' tokenizer.model): its end of sequence is <|end_of_text|>, its chat
    turns end with <|eot_id|>, and an answer stops at either, as Meta's own code does (`Tokenizer.stop_tokens`).
    A model that says <|eot_id|> first: `generate` ends its answer there (it ran to --max_new_tokens before), and
    a fine-tune saves both in its generation config."""
    pytest.importorskip("llama_models")
    import torch
    from llama_models.llama3.tokenizer import Tokenizer
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from toolkit.data.conversations import apply_chat_template_setting, stop_token_ids
    from toolkit.data.sources import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("package:llama_models/llama3/tokenizer.model"))
    apply_chat_template_setting(tokenizer, "llama3")
    meta = Tokenizer.get_instance()
    assert tokenizer.eos_token_id == meta.eos_id == 128001
    # Meta's: <|end_of_text|>, <|eom_id|> (a tool call's end, which the llama3 template never writes), <|eot_id|>
    assert stop_token_ids(tokenizer) == [128001, 128009] and set(meta.stop_tokens) >= {128001, 128009}

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.lm_head = torch.nn.Linear(16, len(tokenizer), bias=True)  # says <|eot_id|> whatever it is asked
    torch.nn.init.zeros_(model.lm_head.weight)
    with torch.no_grad():
        model.lm_head.bias.zero_()[meta.special_tokens["<|eot_id|>"]] = 1.0
    steps = []
    model.register_forward_hook(lambda *_: steps.append(1))
    from types import SimpleNamespace

    from toolkit.generate import answer

    args = SimpleNamespace(temperature=0.0, max_new_tokens=12, repetition_penalty=1.0)
    assert answer(model, tokenizer, [{"role": "user", "content": "Hi"}], args, stream=False) == ""
    assert len(steps) == 1  # one token, <|eot_id|>, then done

    from llama3_fft import RECIPE as LLAMA3_FFT
    from transformers import GenerationConfig

    out = tmp_path / "run"
    train(LLAMA3_FFT, [*SHORT, "--max_steps", "1", "--output_dir", str(out)], "llama3_fft")
    tiny_tokenizer = AutoTokenizer.from_pretrained(out)
    expected = [tiny_tokenizer.eos_token_id, tiny_tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    assert GenerationConfig.from_pretrained(out).eos_token_id == expected
