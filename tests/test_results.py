"""After training, on tiny runs in this process: the card every run writes, --push_to_hub at a run's end (refused
before training where it cannot work), and `toolkit eval`'s refusals. The demos (test_demo.py) prove the rest on
real weights and data: the evaluation against the base model, the card's figures, a push's files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

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


# ------------------------------------------------------------------------ a finished run with held-out data
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run that held out rows and merged its adapter: the folder the tests below copy (they change it)."""
    out = tmp_path_factory.mktemp("runs") / "lora"
    run(LLAMA3_LORA, [*TINY, "--output_dir", str(out), "--eval_fraction", "0.2", "--max_eval_samples", "16",
                      "--merge_lora", "true"], "llama3_lora")  # fmt: skip
    return out


@pytest.fixture
def copied(lora_run, tmp_path):
    """A copy of the run, to change."""
    return Path(shutil.copytree(lora_run, tmp_path / "lora"))


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture
def no_model_loads(monkeypatch):
    """`toolkit eval` with its model loading refused: a test that reaches it failed to refuse earlier."""
    from toolkit.results import evaluation

    def load(record, which):
        raise AssertionError(f"the {which} model loaded before the refusal")

    monkeypatch.setattr(evaluation, "load", load)


def refused_eval(capsys, *argv: str) -> str:
    """`toolkit eval ARGV`'s one error line (exit code 2)."""
    from toolkit.results.evaluation import eval_main

    with pytest.raises(SystemExit) as exit_info:
        eval_main([*argv])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ")
    return line


def test_the_limit_reaches_every_harness_task(copied, monkeypatch):
    """--limit with reply_choice among the tasks was dropped for every harness task (eval_results.json recording it
    all the same): each task now gets it from the harness, reply_choice too."""
    from toolkit.results import evaluation

    limits = []

    def harness(model, tokenizer, tasks, manager, limit, batch_size):
        limits.append(limit)
        return {t: {"acc": 0.5} for t in tasks}, {t: "inputs" for t in tasks}

    monkeypatch.setattr(evaluation, "task_manager", lambda tasks, include: "the harness's tasks")
    monkeypatch.setattr(evaluation, "harness", harness)
    result = evaluation.evaluate_run(copied, "reply_choice,arc_easy", limit=3)
    assert limits == [3, 3] and result["settings"]["limit"] == 3  # the base model, then the tuned one


def test_eval_takes_the_held_out_figures_the_run_logged(tmp_path, monkeypatch):
    """A run that evaluated the model it started from (step 0, --eval_on_start) and the one it saved (its last step)
    has `toolkit eval`'s held-out figures already: they are taken from its log, no model loaded for them, and are
    those the evaluation computes when the log lacks them (the same rows, collator, metrics, precision)."""
    from toolkit.results import evaluation

    out = tmp_path / "run"
    run(LLAMA3_LORA, [*TINY, "--output_dir", str(out), "--eval_fraction", "0.2", "--max_eval_samples", "16",
                      "--eval_on_start", "true"], "llama3_lora")  # fmt: skip
    unlogged = Path(shutil.copytree(out, tmp_path / "unlogged"))
    log = unlogged / "run_log.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("".join(f"{line}\n" for line in lines if '"eval_loss"' not in line))
    assert len(lines) - len(log.read_text().splitlines()) == 2  # step 0's evaluation and step 2's
    loads, load = [], evaluation.load
    monkeypatch.setattr(evaluation, "load", lambda record, which: loads.append(which) or load(record, which))

    computed = evaluation.evaluate_run(unlogged, "held-out")
    assert loads == ["base", "tuned"] and computed["held_out_logged_at"] == {}
    logged = evaluation.evaluate_run(out, "held-out")
    assert loads == ["base", "tuned"] and logged["held_out_logged_at"] == {"base": 0, "tuned": 2}
    assert logged["inputs"] == computed["inputs"]
    assert [(r["task"], r["metric"]) for r in logged["results"]] == [(r["task"], r["metric"]) for r in
                                                                     computed["results"]]  # fmt: skip
    for ours, fresh in zip(logged["results"], computed["results"], strict=True):
        assert ours["base"] == pytest.approx(fresh["base"], rel=1e-5) and ours["base"] != ours["tuned"]
        assert ours["tuned"] == pytest.approx(fresh["tuned"], rel=1e-5)


def test_the_merged_models_card_is_a_full_models(hub, lora_run):
    """`toolkit push --merged` uploaded the merged model under the adapter's card (library peft, "LoRA adapter"),
    which the Hub's usage snippet follows; it now goes with a card of its own: a full transformers model."""
    from huggingface_hub import ModelCard

    from toolkit.results.push import push

    push(lora_run, "me/merged", merged=True)
    arrived = hub.files("me/merged")
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "loss_curve.png"} <= set(arrived)
    assert not {"adapter_model.safetensors", "adapter_config.json"} & set(arrived)
    assert arrived["model.safetensors"] == (lora_run / "merged" / "model.safetensors").read_bytes()
    card = ModelCard(arrived["README.md"].decode())
    assert card.data.library_name == "transformers" and {"lora", "merged"} <= set(card.data.tags)
    assert "LoRA adapter" not in card.text and "merged into the base weights: a full model" in card.text
    commits = [path for method, path in hub.calls if path.startswith("/api/models/me/merged/commit/")]
    assert len(commits) == 1


def test_a_push_never_writes_into_the_run(hub, copied, monkeypatch, capsys):
    """A push, failed or not, left the run's README.md and loss_curve.png rewritten (the merged model's card was
    written over the run's own; a hand-edited card rewritten before an upload that failed): the run's folder is
    now as it was, and a card the user edited goes up as they left it."""
    from toolkit.results.push import PushError, push

    (copied / "README.md").write_text("---\nlicense: mit\n---\n\n# My own words\n")
    before = listing(copied)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    for merged in (True, False):
        with pytest.raises(PushError, match="the Hub cannot be reached"):
            push(copied, "me/lora", merged=merged)
        assert listing(copied) == before
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    push(copied, "me/lora-merged", merged=True)
    assert listing(copied) == before
    push(copied, "me/lora")
    assert listing(copied) == before
    assert hub.files("me/lora")["README.md"] == (copied / "README.md").read_bytes()
    for name in ("README.md", "loss_curve.png"):  # a run without a card: one made for the push, not into the run
        (copied / name).unlink()
    before = listing(copied)
    push(copied, "me/lora-carded")
    assert listing(copied) == before and b"# lora" in hub.files("me/lora-carded")["README.md"]


def test_the_cards_curve_after_a_resume_goes_one_way(copied, monkeypatch):
    """A resumed run logs again the steps after its checkpoint: the card drew them twice, its curve doubling back;
    it reads the log as `toolkit report` does, the last line of each step."""
    from matplotlib.figure import Figure

    from toolkit.results.card import write_card

    lines = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 7)]  # stopped after step 6, its checkpoint at 4
    lines += [{"step": s, "loss": 4.0 - s / 10} for s in range(5, 9)]  # resumed: steps 5 and 6 again
    (copied / "run_log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    drawn, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: drawn.append(fig) or save(fig, *a, **kw))
    write_card(copied)
    (curve,) = drawn[0].axes[0].lines
    assert list(curve.get_xdata()) == list(range(1, 9))
    assert list(curve.get_ydata())[4:] == [4.0 - s / 10 for s in range(5, 9)]  # the resumed run's, not the first's


def test_eval_of_a_run_without_its_model_is_one_line_before_any_model(copied, no_model_loads, capsys):
    """A run folder without its export: a traceback, after the base model had been evaluated; now one line first."""
    (copied / "adapter_model.safetensors").unlink()
    assert "holds no exported model" in refused_eval(capsys, str(copied))
    assert not (copied / "eval_results.json").exists()


def test_eval_into_a_folder_it_cannot_write_is_one_line_before_any_model(copied, no_model_loads, capsys, monkeypatch):
    """The run's folder on a read-only file system (os.access answers for it, whoever asks; chmod does not stop root,
    so the test answers for the file system): one line before any model loads, not a failure after both."""
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not (Path(path) == copied and mode & os.W_OK)
                        and access(path, mode, **kw))  # fmt: skip
    line = refused_eval(capsys, str(copied))
    assert f"cannot write `toolkit eval`'s results to {copied}" in line and "cp -r" in line
    assert not (copied / "eval").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 folder: the os.access case above covers it")
def test_eval_into_a_read_only_folder(copied, no_model_loads, capsys):
    copied.chmod(0o555)
    try:
        assert "cannot write" in refused_eval(capsys, str(copied))
    finally:
        copied.chmod(0o755)


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("llama3_lora", ["--eval_fraction", "0.1", "--eval_tasks", "held-out,arc_eazy"], "arc_eazy: not a task"),
        ("llama3_lora", [], "the run held nothing out"),  # tiny mode holds nothing out: held-out has no rows
        ("bert", ["--eval_tasks", "reply_choice"], "reply_choice scores chat answers"),
    ],
    ids=["misspelt", "nothing-held-out", "reply-choice-of-a-classifier"],
)
def test_eval_after_training_is_refused_before_training(recipe, flags, message, tmp_path, capsys):
    """--eval_after_training's tasks were refused only after the training and its save; now before any step, as
    --push_to_hub's checks are."""
    from bert import RECIPE as BERT

    out, recipes = tmp_path / "run", {"llama3_lora": LLAMA3_LORA, "bert": BERT}
    with pytest.raises(SystemExit) as exit_info:
        run(recipes[recipe], [*TINY, "--output_dir", str(out), "--eval_after_training", "true", *flags], recipe)
    assert exit_info.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert message in line
    assert not (out / "run_log.jsonl").exists() and not list(out.glob("checkpoint-*"))  # no step
    assert not list(out.glob("*.safetensors"))
