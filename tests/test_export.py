"""After training: `toolkit export --to gguf` (llama.cpp's converter and quantizer, each file's greedy answers against
transformers') and `toolkit serve` (transformers' server, llama.cpp's for a GGUF) answering the OpenAI client.

On real things: SmolLM2-135M-Instruct's real weights and tokenizer (a LoRA run, merged for the export; served as
its adapter), and a Qwen3 at toy size with SmolLM2's real tokenizer (a GGUF needs a tokenizer llama.cpp
implements; --tiny's is trained here, and is refused)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bert import RECIPE as BERT
from conftest import free_port
from llama3_fft import RECIPE as LLAMA3_FFT
from smollm2_chat import RECIPE as SMOLLM2_CHAT

from toolkit import train
from toolkit.__main__ import entry
from toolkit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
# fp32: the run's model is then what transformers runs in the comparisons (bf16 weights would be another model)
QUICK = ["--max_steps", "2", "--report_to", "none", "--dtype", "float32", "--eval_on_start", "false",
         "--eval_after_training", "false", "--generation_samples", "0", "--max_eval_samples", "32"]  # fmt: skip
PROMPTS = ["--prompts", "4", "--max_new_tokens", "16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A LoRA run of SmolLM2 (real weights) and a full run of a toy Qwen3 with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data.sources import resolve
    from toolkit.models.tiny import tiny_config

    root = tmp_path_factory.mktemp("export")
    smollm2 = resolve(SMOLLM2_CHAT["model_name_or_path"])
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    qwen = AutoModelForCausalLM.from_config(tiny_config("Qwen/Qwen3-0.6B", tokenizer))
    qwen.save_pretrained(root / "qwen3-toy")
    tokenizer.save_pretrained(root / "qwen3-toy")
    train(SMOLLM2_CHAT, [*QUICK, "--output_dir", str(root / "smollm2_lora")], "smollm2_chat")
    train(SMOLLM2_CHAT, [*QUICK, "--model_name_or_path", str(root / "qwen3-toy"), "--use_lora", "false",
                         "--output_dir", str(root / "qwen3_full")], "smollm2_chat")  # fmt: skip
    return {"lora": root / "smollm2_lora", "qwen": root / "qwen3_full"}


def fingerprints(folder: Path) -> dict[str, str]:
    """Every file of a run outside gguf/ and its card, by content."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and "gguf" not in p.parts and p.name not in ("README.md", "loss_curve.png")}  # fmt: skip


def exported(run: Path, *quant: str) -> list[dict]:
    assert entry("export")([str(run), "--to", "gguf", "--quant", ",".join(quant), *PROMPTS]) == 0
    return json.loads((run / "gguf" / "exports.json").read_text())


def test_a_lora_run_merged_and_exported_answers_as_the_trained_model(runs):
    """f16 is the trained model: its greedy answers equal transformers' token for token (or part only at a near
    tie that f16 rounding flips); q8_0 and q4_k_m are written by llama.cpp's quantizer, smaller in that order; the
    run's own files are as they were (the merge happened elsewhere), the card lists the files."""
    import llama_cpp

    run = runs["lora"]
    before = fingerprints(run)
    rows = {r["quantization"]: r for r in exported(run, "f16", "q8_0", "q4_k_m")}
    assert fingerprints(run) == before and not (run / "merged").exists()
    f16 = rows["f16"]["agreement"]
    assert f16["prompts"] == 4 and f16["tokenized_alike"] == 4  # llama.cpp's tokenizer reads the template as the run
    assert all(p["margin"] < 0.05 for p in f16["partings"]), f16  # only a near tie parts them
    assert f16["identical"] >= 3 and f16["agreeing"] >= 0.9 * f16["tokens"]
    sizes = [rows[q]["bytes"] for q in ("f16", "q8_0", "q4_k_m")]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * 134_515_008 * 0.95  # 2 bytes a parameter
    gguf = run / "gguf" / rows["q4_k_m"]["file"]
    llama = llama_cpp.Llama(model_path=str(gguf), verbose=False, n_ctx=256)
    assert "<|im_start|>" in llama.metadata["tokenizer.chat_template"]  # the run's template travels in the file
    assert llama.metadata["general.file_type"] == str(llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)
    llama.close()
    modelfile = (run / "gguf" / "Modelfile").read_text()
    assert f"FROM ./{rows['q4_k_m']['file']}" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    card = (run / "README.md").read_text()
    assert "## GGUF files" in card and rows["q8_0"]["file"] in card


def test_a_qwen3_full_run_exports_to_f16_and_q8_0(runs):
    """Another family (q_norm, k_norm), exported again: the second export replaces its files and keeps the first's
    records of the others."""
    run = runs["qwen"]
    rows = {r["quantization"]: r for r in exported(run, "f16", "q8_0")}
    assert set(rows) == {"f16", "q8_0"}
    f16 = rows["f16"]["agreement"]
    assert all(p["margin"] < 0.05 for p in f16["partings"]), f16
    rows = {r["quantization"]: r for r in exported(run, "q8_0")}
    assert set(rows) == {"f16", "q8_0"} and sorted(p.name for p in (run / "gguf").glob("*.gguf")) == [
        "qwen3_full-f16.gguf", "qwen3_full-q8_0.gguf"]  # fmt: skip


def test_what_cannot_be_exported_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """A family llama.cpp's converter does not know (OPT, which transformers implements), a tokenizer llama.cpp does
    not implement (--tiny's, trained here), a classifier, a type llama.cpp has no name for: one error line, exit 2,
    no gguf/ folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data.sources import resolve
    from toolkit.models.tiny import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2_CHAT["model_name_or_path"]))
    opt = AutoModelForCausalLM.from_config(tiny_config("facebook/opt-125m", tokenizer))
    opt.save_pretrained(tmp_path / "opt-toy")
    tokenizer.save_pretrained(tmp_path / "opt-toy")
    train(SMOLLM2_CHAT, [*QUICK, "--model_name_or_path", str(tmp_path / "opt-toy"), "--use_lora", "false",
                         "--max_steps", "1", "--output_dir", str(tmp_path / "opt")], "smollm2_chat")  # fmt: skip
    train(LLAMA3_FFT, ["--tiny", "--max_steps", "1", "--report_to", "none", "--output_dir", str(tmp_path / "tiny")],
          "llama3_fft")  # fmt: skip
    train(BERT, ["--tiny", "--max_steps", "1", "--report_to", "none", "--output_dir", str(tmp_path / "bert")], "bert")
    cases = [(tmp_path / "opt", "f16", "no converter for the OPTForCausalLM architecture"),
             (tmp_path / "tiny", "f16", "pre-tokenizer"), (tmp_path / "bert", "f16", "GGUF is for models that write"),
             (tmp_path / "tiny", "q4_k_x", "not a type llama.cpp writes; one of f16, bf16, f32")]  # fmt: skip
    for run, quant, said in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            entry("export")([str(run), "--to", "gguf", "--quant", quant])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and said in err, err
        assert "Traceback" not in err and not (run / "gguf").exists()


def test_an_image_text_run_is_refused_before_it_loads(tmp_path):
    from toolkit.results.record import RunRecord
    from toolkit.shipping.export import check_run

    record = RunRecord(tmp_path, {}, {"toolkit": {"task": "vlm_sft", "model_name_or_path": "x"}})
    with pytest.raises(ConfigError, match="image projector"):
        check_run(record, ["f16"])


def served(command: list[str], port: int, log: Path):
    """A server started as a user would (python -m toolkit serve ...), once it lists its model; stopped after."""
    from openai import OpenAI

    with open(log, "w") as sink:  # a file, not a pipe: a server's chatter would fill a pipe nobody reads, and block it
        process = subprocess.Popen([sys.executable, "-m", "toolkit", *command, "--port", str(port)], cwd=ROOT,
                                   stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    for _ in range(240):
        try:
            return process, client, client.models.list().data[0].id
        except Exception:  # noqa: BLE001 (not listening yet)
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
    process.kill()
    raise AssertionError(f"the server did not come up in 120 s: {log.read_text()[-3000:]}")


def test_serve_answers_the_openai_client_as_the_run_generates(runs, capsys, tmp_path):
    """A LoRA run's adapter behind transformers' server, then its f16 GGUF behind llama.cpp's: each answers as
    `toolkit generate` does (greedy, the run's chat template), streamed or not, and stops where generation does.
    llama.cpp's server penalizes repeats (1.1) unless a request says otherwise: with 1.0 it is greedy decoding."""
    run = runs["lora"]
    question = "Hello"  # answered in a line, well within 64 tokens
    capsys.readouterr()
    assert entry("generate")([str(run), "--prompt", question, "--max_new_tokens", "64"]) == 0
    expected = capsys.readouterr().out.splitlines()[1].strip()
    if not (run / "gguf" / "smollm2_lora-f16.gguf").is_file():
        exported(run, "f16")
    for command in (["serve", str(run)], ["serve", str(run), "--gguf", "f16"]):
        process, client, model = served(command, free_port(), tmp_path / f"{len(command)}.log")
        try:
            ask = dict(model=model, messages=[{"role": "user", "content": question}], max_tokens=64, temperature=0)
            if "--gguf" in command:  # llama.cpp's server's default is 1.1 (transformers' server refuses the field)
                ask["extra_body"] = {"repeat_penalty": 1.0}
            reply = client.chat.completions.create(**ask).choices[0]
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask,
                                                                                                       stream=True)
                               if c.choices)  # fmt: skip
        finally:
            process.terminate()
            process.wait(timeout=30)
        assert reply.message.content.strip() == streamed.strip()
        assert reply.message.content.strip() == expected, (command, reply.message.content, expected)
        assert reply.finish_reason == "stop" and "<|im_end|>" not in reply.message.content


def test_push_uploads_the_gguf_files_beside_the_model(runs, monkeypatch):
    """`toolkit push` after `toolkit export`: each GGUF file and the Modelfile arrive at the repository's top, byte for
    byte, beside the adapter and the card that lists them (to a stand-in of the Hub's API, tests/hub_stand_in.py)."""
    import huggingface_hub.constants
    from hub_stand_in import TOKEN, HubStandIn

    run = runs["lora"]
    if not (run / "gguf" / "exports.json").is_file():
        exported(run, "q8_0")
    hub = HubStandIn(user="me")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the stand-in is reachable
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    try:
        assert entry("push")([str(run), "--repo_id", "me/smollm2-gguf"]) == 0
        arrived = hub.files("me/smollm2-gguf")
    finally:
        hub.close()
    rows = json.loads((run / "gguf" / "exports.json").read_text())
    for name in [row["file"] for row in rows] + ["Modelfile"]:
        assert arrived[name] == (run / "gguf" / name).read_bytes(), name
    assert "adapter_model.safetensors" in arrived and b"## GGUF files" in arrived["README.md"]


def test_eval_scores_each_gguf_file_beside_the_trained_model(runs, capsys):
    """`toolkit eval --gguf`: llama.cpp's logits for the held-out rows through the run's own metrics. f16 is the
    trained model to within its weights' rounding (perplexity within 1%, token accuracy within a token in 50);
    q4_k_m is further off than f16; the table has a column a file."""
    run = runs["lora"]
    if not all((run / "gguf" / f"smollm2_lora-{q}.gguf").is_file() for q in ("f16", "q4_k_m")):
        exported(run, "f16", "q4_k_m")
    capsys.readouterr()
    assert entry("eval")([str(run), "--tasks", "held-out", "--gguf", "f16,q4_k_m"]) == 0
    assert "gguf f16" in capsys.readouterr().out.splitlines()[0]
    rows = {r["metric"]: r for r in json.loads((run / "eval_results.json").read_text())["results"]}
    tuned, f16, q4 = (rows["perplexity"]["tuned"], rows["perplexity"]["gguf"]["f16"],
                      rows["perplexity"]["gguf"]["q4_k_m"])  # fmt: skip
    assert abs(f16 - tuned) < 0.01 * tuned and abs(q4 - tuned) > abs(f16 - tuned), (tuned, f16, q4)
    assert abs(rows["token_accuracy"]["gguf"]["f16"] - rows["token_accuracy"]["tuned"]) < 0.02


def test_what_cannot_be_served_is_one_line(runs, tmp_path, capsys):
    """Before a model loads: a folder with no model, a GGUF never exported (naming the export that writes it), a
    port another process holds, a classifier."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        (tmp_path / "classifier").mkdir()
        (tmp_path / "classifier" / "config.json").write_text('{"architectures": ["BertForSequenceClassification"]}')
        (tmp_path / "classifier" / "model.safetensors").write_bytes(b"")
        cases = [([str(tmp_path)], "holds no exported model"),
                 ([str(runs["qwen"]), "--gguf", "q2_k"], "--quant q2_k` writes it"),
                 ([str(runs["qwen"]), "--port", port], "pass another --port"),
                 ([str(tmp_path / "classifier")], "it labels text")]  # fmt: skip
        for argv, said in cases:
            capsys.readouterr()
            with pytest.raises(SystemExit) as stopped:
                entry("serve")(argv)
            err = capsys.readouterr().err
            assert stopped.value.code == 2 and said in err and "Traceback" not in err, err
