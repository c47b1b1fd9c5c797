"""After training, on tiny runs in this process: the card every run writes, --push_to_hub at a run's end (refused
before training where it cannot work), and `toolkit eval`'s refusals. The demos (test_demo.py) prove the rest on
real weights and data: the evaluation against the base model, the card's figures, a push's files."""

from __future__ import annotations

import json

import pytest
from hub_stand_in import TOKEN, HubStandIn
from llama3_lora import RECIPE as LLAMA3_LORA

from toolkit import run

TINY = ["--tiny", "--report_to", "none", "--max_steps", "2", "--logging_steps", "1"]


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants

    stand_in = HubStandIn(user="me")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # LFS: what the stand-in serves
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    yield stand_in
    stand_in.close()


def test_a_run_ends_with_its_card_and_pushes_once(hub, tmp_path, capsys):
    """--push_to_hub true --hub_model_id me/tiny-lora on a LoRA run: no push while it trains (the Trainer's own,
    left off), then one commit of the adapter, tokenizer and the card the run wrote, on a private repository."""
    out = tmp_path / "run"
    run(LLAMA3_LORA, [*TINY, "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "1",
                      "--push_to_hub", "true", "--hub_model_id", "me/tiny-lora"], "llama3_lora")  # fmt: skip
    assert f"pushed {out} to me/tiny-lora:" in capsys.readouterr().out
    commits = [path for method, path in hub.calls if path.startswith("/api/models/me/tiny-lora/commit/")]
    assert len(commits) == 1  # once, at the end: not at each of the two checkpoints
    arrived = hub.files("me/tiny-lora")
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "loss_curve.png"} <= set(arrived)
    assert arrived["README.md"] == (out / "README.md").read_bytes()
    assert hub.repos["me/tiny-lora"]["private"] is True
    summary = json.loads((out / "run_summary.json").read_text())["summary"]
    assert f"| steps | {summary['steps']} |" in arrived["README.md"].decode()


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({"HF_TOKEN": None}, ["--hub_model_id", "me/x"], "no Hugging Face token"),
        ({}, ["--hub_model_id", "not a name"], "is not a repository id the Hub accepts"),
        ({}, [], "pushing needs a repository: --repo_id"),
    ],
    ids=["no-token", "bad-name", "no-repository"],
)
def test_a_push_that_cannot_work_is_refused_before_training(hub, env, flags, message, tmp_path, capsys, monkeypatch):
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
            monkeypatch.setenv("HF_HOME", str(tmp_path / "no-token-here"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(LLAMA3_LORA, [*TINY, "--output_dir", str(out), "--push_to_hub", "true", *flags], "llama3_lora")
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (out / "adapter_model.safetensors").exists() and not hub.calls  # nothing trained, nothing sent


def test_eval_refusals_are_one_line(tmp_path, capsys):
    """`toolkit eval` on a folder that is not a finished run, and on a run without held-out data or with a task
    the harness does not have: one line each, naming the fix."""
    from toolkit.results.evaluation import eval_main

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            eval_main([*argv])
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    assert "holds no finished run (no run_summary.json)" in refused(str(tmp_path))
    out = tmp_path / "run"
    run(LLAMA3_LORA, [*TINY, "--output_dir", str(out)], "llama3_lora")
    capsys.readouterr()
    assert "the run held nothing out" in refused(str(out))  # tiny mode holds nothing out
    assert "not a task of lm-evaluation-harness" in refused(str(out), "--tasks", "no_such_task")
    assert "--limit 0: at least 1 example" in refused(str(out), "--limit", "0")
