"""`toolkit report`: two real tiny runs side by side; the page's table is the runs' own summaries."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from bert import RECIPE as BERT

from toolkit import train
from toolkit.metrics import report
from toolkit.metrics.samples import read_samples
from toolkit.metrics.wandb_run import read_offline_run


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    folders = []
    for name, flags in [("lr-2e-3", []), ("lr-5e-3", ["--learning_rate", "5e-3"])]:
        out = tmp_path_factory.mktemp("runs") / name
        train(BERT, ["--tiny", "--max_steps", "6", "--logging_steps", "2", "--report_to", "none",
                     "--output_dir", str(out), *flags], "bert")  # fmt: skip
        folders.append(out)
    return folders


def test_report_charts_and_table_equal_the_summaries(two_runs, tmp_path, capsys):
    assert report.main([*map(str, two_runs), "--output", str(tmp_path)]) == 0
    for png in ("loss.png", "efficiency.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # drawn, not blank
    lines = (tmp_path / "report.md").read_text().splitlines()
    head = [c.strip() for c in lines[2].strip("|").split("|")]
    rows = {r[0]: dict(zip(head, r, strict=True)) for r in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[4:6])}  # fmt: skip
    for folder in two_runs:
        summary = json.loads((folder / "run_summary.json").read_text())["summary"]
        row = rows[folder.name]
        assert row["tokens"] == f"{summary['tokens']:,}"
        assert row["cost $"] == f"{summary['cost_usd']:.4g}"
        assert row["train loss"] == f"{summary['train_loss']:.4f}"
        assert row["tokens/s"] == f"{summary['tokens_per_second']:,.0f}"
        assert row["steps"] == "6"
    assert "<table>" in (tmp_path / "index.html").read_text()


def drawn(runs: list[report.Run], tmp_path, monkeypatch) -> dict[str, Any]:
    """The figures `toolkit report` saves, by file name, drawn as saved (their axes, ticks and texts to read)."""
    from matplotlib.figure import Figure

    figures, save = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, *a, **kw: figures.update({Path(path).name: fig})
                        or save(fig, path, *a, **kw))  # fmt: skip
    report.charts(runs, tmp_path)
    for figure in figures.values():
        figure.canvas.draw()
    return figures


def made_up_runs(dollars_per_step: float, mfu: list[float | None]) -> list[report.Run]:
    """Runs as a CPU writes them (no MFU, fractions of a cent) or a GPU (MFU 0.3-0.5, tens of dollars): 40 steps."""
    runs = []
    for i, run_mfu in enumerate(mfu):
        history = [{"step": s, "loss": 3 / s**0.3, "cost_usd": dollars_per_step * s * (i + 1)} for s in range(1, 41)]
        summary = {"tokens_per_second": 45_000.0 * (i + 1), "mean_mfu": run_mfu, "peak_memory_gib": 40.5 + i,
                   "cost_usd": history[-1]["cost_usd"]}  # fmt: skip
        runs.append(report.Run(f"run {i}", history, summary))
    return runs


def axes_titled(figure, title: str):
    (ax,) = [ax for ax in figure.axes if ax.get_title() == title]
    return ax


def shown_tick_labels(ax, which: str = "x") -> list:
    """The tick labels drawn inside the axis's view (matplotlib keeps a tick beyond each end, unlabelled on screen)."""
    low, high = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    ticks = ax.xaxis.get_major_ticks() if which == "x" else ax.yaxis.get_major_ticks()
    return [t.label1 for t in ticks if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()]


@pytest.mark.parametrize("dollars_per_step", [2.5e-5, 1e-5, 0.6], ids=["cpu", "cpu-cheaper", "gpu"])
def test_dollar_ticks_do_not_run_into_one_another(dollars_per_step, tmp_path, monkeypatch):
    """The loss-vs-dollars axis of a CPU's runs printed 0.00025, 0.00050, ... ten labels 8 digits wide, into one
    another; a few ticks now, and a CPU's fractions of a cent as multiples of one power of ten."""
    ax = axes_titled(drawn(made_up_runs(dollars_per_step, [None, None]), tmp_path, monkeypatch)["loss.png"],
                     "Loss vs dollars")  # fmt: skip
    labels = shown_tick_labels(ax)
    texts = [re.sub(r"^\$\\mathdefault\{(.*)\}\$$", r"\1", label.get_text()) for label in labels]  # mathtext's
    boxes = [label.get_window_extent() for label in labels]
    assert len(labels) >= 3 and not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:], strict=False)), texts
    assert max(map(len, texts)) <= 5, texts


def test_a_figure_no_run_has_is_said_once_not_drawn_as_an_empty_axis(two_runs, tmp_path, monkeypatch):
    """CPU runs have no datasheet peak, so no MFU: the panel drew an axis from -0.04 to 0.04 under two n/a labels;
    now it draws no axis and says why, once."""
    runs = [report.load_run(folder) for folder in two_runs]
    assert all(run.summary.get("mean_mfu") is None for run in runs)
    ax = axes_titled(drawn(runs, tmp_path, monkeypatch)["efficiency.png"], "mean MFU")
    assert not ax.patches and not ax.axison  # no bars, no ticks, no frame
    (note,) = [text.get_text() for text in ax.texts]
    assert note.startswith("n/a") and "--peak_tflops" in note


def test_a_figure_some_runs_have(tmp_path, monkeypatch):
    """A GPU run beside a CPU run: the MFU in percent, each bar with its value, n/a where a run has none."""
    figure = drawn(made_up_runs(0.6, [0.42, None]), tmp_path, monkeypatch)["efficiency.png"]
    ax = axes_titled(figure, "mean MFU")
    assert len(ax.patches) == 1
    assert sorted(text.get_text() for text in ax.texts) == ["42.00%", "n/a"]
    assert all(label.get_text().endswith("%") for label in shown_tick_labels(ax, "y"))


@pytest.mark.parametrize("mfu", [[0.0301, 0.0242, 0.012], [0.42, 0.38]], ids=["cpu-peak-given", "gpu"])
def test_mfu_ticks_are_distinct(mfu, tmp_path, monkeypatch):
    """The MFU axis of three CPU runs with --peak_tflops (3.01%, 2.42%, 1.20%) read 0%, 1%, 1%, 2%, 2%, 3%: ticks
    every half percent written without decimals. Each tick now has its own label."""
    ax = axes_titled(drawn(made_up_runs(2.5e-5, mfu), tmp_path, monkeypatch)["efficiency.png"], "mean MFU")
    texts = [label.get_text() for label in shown_tick_labels(ax, "y")]
    assert len(texts) >= 3 and len(set(texts)) == len(texts), texts


@pytest.mark.parametrize("costs", [[1.326e-4, 1.273e-4, 1.007e-4, 9.074e-5, 1.7e-4, 6.1e-5], [12.5, 130.0, 7.25]],
                         ids=["six-cpu-runs", "gpu-runs"])  # fmt: skip
def test_cost_bars_read_in_one_notation_without_touching(costs, tmp_path, monkeypatch):
    """Six CPU runs' cost bars read 0.0001326 touching 0.0001273 and 0.0001007 running into 9.074e-05: two notations
    over an axis marked x10^-4. The bars now carry the axis's multiples, short enough not to touch."""
    runs = made_up_runs(1.0, [None] * len(costs))
    for run, cost in zip(runs, costs, strict=True):
        run.summary["cost_usd"] = cost
    ax = axes_titled(drawn(runs, tmp_path, monkeypatch)["efficiency.png"], "cost (USD)")
    labels = [text for text in ax.texts if text.get_text()]
    boxes = [label.get_window_extent() for label in labels]
    texts = [label.get_text() for label in labels]
    assert len(labels) == len(costs) and not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:], strict=False)), texts
    assert not any("e-" in text for text in texts) and max(map(len, texts)) <= 5, texts


def test_report_into_a_folder_it_cannot_write_is_one_line(two_runs, tmp_path, capsys, monkeypatch):
    """--output under a read-only folder (a read-only file system refuses root too, which os.access says; chmod does
    not stop root, so the test answers for the file system): one line before anything is drawn, not a traceback."""
    locked, access = tmp_path / "read-only", os.access
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not (Path(path) == locked and mode & os.W_OK)
                        and access(path, mode, **kw))  # fmt: skip
    assert report.main([*map(str, two_runs), "--output", str(locked / "report")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --output {locked / 'report'}: ") and "cannot write" in line
    assert not (locked / "report").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 folder: the os.access case above covers it")
def test_report_into_a_read_only_folder_is_one_line(two_runs, tmp_path, capsys):
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert report.main([*map(str, two_runs), "--output", str(locked)]) == 2
        assert "cannot write" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)


def test_report_on_a_folder_without_a_run_says_what_to_pass(tmp_path, capsys):
    assert report.main([str(tmp_path), "--output", str(tmp_path / "r")]) == 2
    assert "neither a run's output folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- W&B Reports, published
class WandbStandIn:
    """W&B's API as `toolkit report --wandb_project` meets it, served on 127.0.0.1: the viewer and default entity,
    the entity's projects (entity `nosuch` refused as W&B refuses it), and the report's upsert, answered as W&B
    answers; every GraphQL request recorded. It proves the request the toolkit sends, not W&B's rendering."""

    USER = {"id": "VXNlcjox", "name": "tester", "username": "tester", "email": "t@example.com", "admin": False,
            "flags": "{}", "entity": "tester", "deletedAt": None, "apiKeys": {"edges": []}, "teams": {"edges": []},
            "photoUrl": None, "userEntity": {"name": "tester"}}  # fmt: skip

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        stand_in, self.requests = self, []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.loads(raw) if self.path == "/graphql" else {}  # the SDK's telemetry is not JSON
                if body:
                    stand_in.requests.append(body)
                reply = json.dumps(stand_in.answer(body.get("query", ""), body.get("variables") or {})).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, query: str, variables: dict) -> dict:
        if "upsertView" in query:
            v = variables
            project = {"id": "UHJvamVjdDox", "name": v["projectName"], "entityName": v["entityName"]}
            view = {"id": "VmlldzoxMjM=", "type": v["type"], "name": v["name"], "displayName": v["displayName"],
                    "description": v["description"], "project": project, "spec": v["spec"],
                    "updatedAt": "2026-11-25T00:00:00"}  # fmt: skip
            return {"data": {"upsertView": {"view": view, "inserted": True}}}
        if "models(" in query:
            if variables.get("entity") == "nosuch":
                return {"data": None, "errors": [{"message": "entity nosuch not found", "path": ["models"]}]}
            node = {"__typename": "Project", "id": "UHJvamVjdDox", "name": "finetune-recipes", "entityName": "tester",
                    "createdAt": "2026-01-01T00:00:00", "isBenchmark": False, "user": self.USER}  # fmt: skip
            page = {"__typename": "PageInfo", "endCursor": "c", "hasNextPage": False}
            return {"data": {"models": {"edges": [{"node": node, "cursor": "c"}], "pageInfo": page}}}
        if "viewer" in query:
            return {"data": {"viewer": self.USER}}
        return {"data": {}}

    def saved_spec(self) -> dict:
        (upsert,) = [r for r in self.requests if "upsertView" in r["query"]]
        return json.loads(upsert["variables"]["spec"])


@pytest.fixture(scope="module")
def wandb_runs(tmp_path_factory):
    """Two runs logged to W&B offline (no account here): a BERT one, and a Llama one with generation samples."""
    from llama3_fft import RECIPE as LLAMA3_FFT

    root = tmp_path_factory.mktemp("wandb-runs")
    common = ["--tiny", "--max_steps", "4", "--logging_steps", "2", "--report_to", "wandb"]
    samples = ["--eval_fraction", "0.1", "--max_eval_samples", "8", "--generation_samples", "1",
               "--generation_max_new_tokens", "4"]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        train(BERT, [*common, "--output_dir", str(root / "bert")], "bert")
        train(LLAMA3_FFT, [*common, *samples, "--output_dir", str(root / "llama")], "llama3_fft")
    return [root / "bert", root / "llama"]


def test_runs_in_one_process_keep_their_own_group_and_tags(wandb_runs):
    """The fixture's two runs share a process (as in a notebook): the second is grouped and tagged as itself, not
    with the first run's W&B settings (which the first left in the environment)."""
    for folder, recipe, other in [(wandb_runs[0], "bert", "llama3_fft"), (wandb_runs[1], "llama3_fft", "bert")]:
        summary = json.loads((folder / "run_summary.json").read_text())["summary"]
        run = read_offline_run(Path(summary["wandb_run_dir"]))
        assert run["group"] == recipe and recipe in run["tags"] and other not in run["tags"], run["tags"]


@pytest.fixture
def stand_in(monkeypatch):
    server = WandbStandIn()
    monkeypatch.setenv("WANDB_BASE_URL", server.url)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_MODE", "offline")  # runs logged offline; the suite's "disabled" stops wandb's API too
    yield server
    server.server.shutdown()


def test_offline_runs_are_named_with_the_command_that_uploads_them(wandb_runs, stand_in, tmp_path, capsys):
    out = tmp_path / "report"
    assert report.main([*map(str, wandb_runs), "--wandb_project", "finetune-recipes", "--output", str(out)]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    folders = [json.loads((run / "run_summary.json").read_text())["summary"]["wandb_run_dir"] for run in wandb_runs]
    assert "bert, llama were logged offline and are not on W&B yet" in line
    assert f"`wandb sync {' '.join(folders)}`" in line and "--sync" in line
    assert not any("upsertView" in r["query"] for r in stand_in.requests) and not out.exists()


def test_the_published_report_compares_exactly_these_runs(wandb_runs, stand_in, tmp_path, capsys, monkeypatch):
    """--sync uploads the offline runs first (`wandb sync`, here a stand-in that marks each run uploaded, as the real
    one does); then the saved report: a runset of exactly the compared runs' ids, one chart per figure against the
    step and loss against dollars, the plans against the measurements, the answers side by side, and its URL."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "wandb").write_text('#!/bin/sh\n[ "$1" = sync ] && for f in "$2"/*.wandb; do touch "$f.synced"; done\n')
    (fake / "wandb").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    argv = [*map(str, wandb_runs), "--wandb_project", "finetune-recipes", "--sync", "--output", str(tmp_path / "r")]
    assert report.main(argv) == 0
    assert f"W&B report: {stand_in.url}/tester/finetune-recipes/reports/Run-comparison--VmlldzoxMjM=" in (
        capsys.readouterr().out
    )
    summaries = [json.loads((run / "run_summary.json").read_text()) for run in wandb_runs]
    blocks = stand_in.saved_spec()["blocks"]
    (grid,) = [b for b in blocks if b["type"] == "panel-grid"]
    (runset,) = grid["metadata"]["runSets"]
    ids = [s["summary"]["wandb_run_id"] for s in summaries]
    assert runset["filters"]["filters"] == [{"key": {"section": "run", "name": "name"}, "op": "IN", "value": ids,
                                             "disabled": False}]  # fmt: skip
    panels = [(p["config"]["xAxis"], p["config"]["metrics"], p["config"]["chartTitle"])
              for p in grid["metadata"]["panelBankSectionConfig"]["panels"]]  # fmt: skip
    assert panels == [("train/global_step", ["train/loss"], "training loss"),
                      ("train/global_step", ["train/tokens_per_second"], "tokens/s"),
                      ("train/global_step", ["train/mfu"], "MFU"),
                      ("train/global_step", ["train/cost_usd"], "cost (USD)"),
                      ("train/cost_usd", ["train/loss"], "loss vs dollars")]  # fmt: skip
    markdown = [b["content"] for b in blocks if b["type"] == "markdown-block"]
    plan_rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                 for line in markdown[0].splitlines()[2:]}  # fmt: skip
    for run, written in zip(("bert", "llama"), summaries, strict=True):
        summary, planned = written["summary"], written["config"]["memory_plan"]["device_total"]
        assert plan_rows[run][:4] == [summary["strategy"], str(summary["processes"]), f"{planned / 2**30:.2f}",
                                      f"{summary['peak_memory_gib']:.2f}"]  # fmt: skip
        assert plan_rows[run][5] == f"{summary['cost_usd']:.4g}"
    prompt = read_samples(wandb_runs[1])[0]["prompt"]
    assert prompt in markdown[1] and "llama, step" in markdown[1]


def test_a_grpo_run_adds_its_reward_to_the_published_report(wandb_runs, stand_in, tmp_path, monkeypatch):
    """Beside the common charts, GRPO's reward against the step and against dollars (reward.png's twins), once a
    compared run logged it."""
    from smollm2_grpo import RECIPE as GRPO

    grpo = tmp_path / "grpo"
    train(GRPO, ["--tiny", "--max_steps", "2", "--report_to", "wandb", "--output_dir", str(grpo)], "smollm2_grpo")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "wandb").write_text('#!/bin/sh\n[ "$1" = sync ] && for f in "$2"/*.wandb; do touch "$f.synced"; done\n')
    (fake / "wandb").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    argv = [str(wandb_runs[0]), str(grpo), "--wandb_project", "finetune-recipes", "--sync", "--output",
            str(tmp_path / "r")]  # fmt: skip
    assert report.main(argv) == 0
    (grid,) = [b for b in stand_in.saved_spec()["blocks"] if b["type"] == "panel-grid"]
    panels = [(p["config"]["xAxis"], p["config"]["metrics"], p["config"]["chartTitle"])
              for p in grid["metadata"]["panelBankSectionConfig"]["panels"]]  # fmt: skip
    assert panels[-2:] == [("train/global_step", ["train/reward"], "reward"),
                           ("train/cost_usd", ["train/reward"], "reward vs dollars")]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "env", "entity", "message"),
    [
        ("no-account", {"WANDB_API_KEY": None}, None, "no W&B account on this machine: `wandb login`"),
        ("no-network", {"WANDB_BASE_URL": "http://127.0.0.1:9"}, None, "W&B cannot be reached from here"),
        ("bad-entity", {}, "nosuch", "W&B refused the report for nosuch/finetune-recipes"),
    ],
    ids=lambda v: v if isinstance(v, str) and v in ("no-account", "no-network", "bad-entity") else "",
)
def test_publishing_that_cannot_work_is_one_line(case, env, entity, message, wandb_runs, stand_in, tmp_path, capsys,
                                                monkeypatch):  # fmt: skip
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    for run in wandb_runs:  # uploaded already: what fails is the report itself
        folder = Path(json.loads((run / "run_summary.json").read_text())["summary"]["wandb_run_dir"])
        for file in folder.glob("*.wandb"):
            file.with_name(file.name + ".synced").touch()
    argv = [*map(str, wandb_runs), "--wandb_project", "finetune-recipes", "--output", str(tmp_path / "r")]
    assert report.main([*argv, *(["--wandb_entity", entity] if entity else [])]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in captured.err, captured.err[-2000:]
