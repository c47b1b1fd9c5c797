"""`toolkit report`: two real tiny runs side by side; the page's table is the runs' own summaries."""

from __future__ import annotations

import json

import pytest
from bert import RECIPE as BERT

from toolkit import train
from toolkit.metrics import report


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


def test_report_on_a_folder_without_a_run_says_what_to_pass(tmp_path, capsys):
    assert report.main([str(tmp_path), "--output", str(tmp_path / "r")]) == 2
    assert "neither a run's output folder" in capsys.readouterr().err
