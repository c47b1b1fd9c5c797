"""`python -m toolkit report RUN [RUN ...]`: runs side by side (e.g. one recipe under DDP, FSDP and ZeRO-3).

Each RUN is a run's output folder (its `run_log.jsonl` and `run_summary.json`, written by every run) or a W&B
offline run folder (`wandb/offline-run-*`). Writes, offline, PNG charts (loss against steps and against
dollars; tokens/s, MFU, peak memory and cost per run) and a page in Markdown and HTML whose table is the runs'
own summaries. With `--wandb_project` and a W&B account, the same charts go to a W&B Report too, with the runs'
plans against what they measured (wandb_report.py).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ToolkitError, command, description
from ..errors import report as report_error
from ..outputs import SUMMARY, writable
from .samples import EVAL_FILE, RUN_LOG, SAMPLES_FILE

COLUMNS = {  # summary key -> (table heading, format)
    "strategy": ("strategy", "{}"),
    "processes": ("processes", "{}"),
    "steps": ("steps", "{}"),
    "tokens": ("tokens", "{:,}"),
    "training_seconds": ("training s", "{:.1f}"),
    "tokens_per_second": ("tokens/s", "{:,.0f}"),
    "mean_mfu": ("MFU", "{:.2%}"),
    "sampling_share": ("sampling", "{:.0%}"),  # GRPO: the share of the training time spent sampling
    "peak_memory_gib": ("peak memory GiB", "{:.2f}"),
    "unit_hours": ("device-hours", "{:.4g}"),
    "cost_usd": ("cost $", "{:.4g}"),
    "train_loss": ("train loss", "{:.4f}"),
    "eval_loss": ("eval loss", "{:.4f}"),
}


@dataclass
class Run:
    name: str
    history: list[dict[str, Any]]  # training log lines, one per logging step (last one kept per step)
    summary: dict[str, Any]
    samples: list[dict[str, Any]] = field(default_factory=list)  # --generation_samples: OUTPUT/samples.jsonl
    config: dict[str, Any] = field(default_factory=dict)  # what defines the run, its plans included
    evaluation: list[dict[str, Any]] = field(default_factory=list)  # OUTPUT/eval_results.json's rows, before/after


class ReportError(ToolkitError, ValueError):
    """Something given to `toolkit report` that is not a finished run."""


def json_lines(path: Path) -> list[dict[str, Any]]:
    """A .jsonl file's records; a last line cut short (a run killed as it wrote) is left out, any other unreadable
    line is a ReportError naming it."""
    text = path.read_text(errors="replace").splitlines()
    out = []
    for number, line in enumerate(text, 1):
        try:
            out.append(json.loads(line)) if line.strip() else None
        except ValueError:
            if number < len(text):
                raise ReportError(f"{path} line {number} is not JSON: the file is damaged; report the other "
                                  "runs, or restore it.") from None  # fmt: skip
    return out


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if (path / SUMMARY).is_file():
        try:
            written = json.loads((path / SUMMARY).read_text())
            summary, config = written["summary"], written.get("config", {})
        except (ValueError, KeyError, TypeError):
            raise ReportError(f"{path / SUMMARY} is not a run's summary (not JSON, or cut short): report the other "
                              "runs, or run this one again.") from None  # fmt: skip
        if not (path / RUN_LOG).is_file():
            raise ReportError(f"{path} has no {RUN_LOG} (the log every run writes beside its summary): report the "
                              "other runs, or restore it.")  # fmt: skip
        lines = json_lines(path / RUN_LOG)
        name = path.name
    elif list(path.glob("*.wandb")):
        from .wandb_run import read_offline_run

        run = read_offline_run(path)
        summary = {k.removeprefix("summary/"): v for k, v in run["summary"].items() if k.startswith("summary/")}
        config = run["config"]
        summary.setdefault("wandb_offline", True)
        summary.setdefault("wandb_run_dir", str(path))
        lines = [{k.removeprefix("train/"): v for k, v in row.items()} for row in run["history"]]
        for line in lines:
            line["step"] = line.get("global_step")
        summary.setdefault("wandb_run_id", path.name.rsplit("-", 1)[-1])
        name = f"{summary.get('recipe', 'run')}-{summary['wandb_run_id']}"
    else:
        raise ReportError(f"{path} is neither a run's output folder ({SUMMARY}) nor a W&B offline run "
                          "(*.wandb): pass the --output_dir of a finished run.")  # fmt: skip
    if not summary:
        raise ReportError(f"{path} has no end-of-run summary (the run did not finish or stop cleanly).")
    samples = json_lines(path / SAMPLES_FILE) if (path / SAMPLES_FILE).is_file() else []
    evaluation = []
    if (path / EVAL_FILE).is_file():
        try:
            evaluation = json.loads((path / EVAL_FILE).read_text())["results"]
        except (ValueError, KeyError, TypeError):
            raise ReportError(f"{path / EVAL_FILE} is not `toolkit eval`'s (not JSON, or cut short): run `python -m "
                              f"toolkit eval {path}` again, or remove it.") from None  # fmt: skip
    return Run(name, by_step(lines), summary, samples, config, evaluation)


def by_step(lines: list[dict[str, Any]], key: str = "loss") -> list[dict[str, Any]]:
    """The log lines that carry `key`, one per step in step order: a resumed run logs again the steps after its
    checkpoint, and the last line of a step is the one the run kept (the model card's curve reads them so too)."""
    kept = {line["step"]: line for line in lines if key in line and line.get("step") is not None}
    return [kept[step] for step in sorted(kept)]


def unique_names(runs: list[Run]) -> None:
    """Output folders are often all called `out`: name a run by its strategy then, and number what is left."""
    if len({r.name for r in runs}) < len(runs):
        for r in runs:
            r.name = f"{r.summary.get('recipe', r.name)} {r.summary.get('strategy', '')}".strip()
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name} ({seen[r.name]})"


BARS = {"tokens_per_second": "tokens/s", "mean_mfu": "mean MFU", "peak_memory_gib": "peak memory (GiB)",
        "cost_usd": "cost (USD)"}  # fmt: skip
NONE_HAS = {"mean_mfu": "no datasheet peak for the device\n(pass --peak_tflops)"}  # why no run has the figure


def charts(runs: list[Run], folder: Path) -> list[Path]:
    """loss.png and efficiency.png in `folder`; reward.png too where a run logged GRPO's reward."""
    figures = [("loss.png", series_figure(runs, "loss", "training loss", "Loss")),
               ("efficiency.png", efficiency_figure(runs))]  # fmt: skip
    if any("reward" in line for run in runs for line in run.history):
        figures.append(("reward.png", series_figure(runs, "reward", "mean reward of the step's completions",
                                                    "Reward")))  # fmt: skip
    paths = []
    for name, figure in figures:
        paths.append(folder / name)
        figure.savefig(paths[-1], dpi=110)
    return paths


def series_figure(runs: list[Run], key: str, label: str, title: str):
    """A logged series (the training loss, GRPO's reward) against the optimizer step and against the dollars
    spent so far, one line per run that logged it."""
    from matplotlib.figure import Figure  # no pyplot: nothing global, nothing to close
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4), layout="tight")
    by_step, by_cost = fig.subplots(1, 2)
    for i, run in enumerate(runs):
        style = {"label": run.name, "linestyle": ("-", "--", ":", "-.")[i % 4]}  # equal curves stay visible
        logged = [line for line in run.history if line.get(key) is not None]
        by_step.plot([line["step"] for line in logged], [line[key] for line in logged], **style)
        priced = [line for line in logged if "cost_usd" in line]
        by_cost.plot([line["cost_usd"] for line in priced], [line[key] for line in priced], **style)
    by_step.set(xlabel="optimizer step", ylabel=label, title=f"{title} vs step")
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_cost.set(xlabel="cost so far (USD)", ylabel=label, title=f"{title} vs dollars")
    dollar_axis(by_cost.xaxis)
    by_step.legend(fontsize=8)
    return fig


def dollar_axis(axis, power: int | None = None) -> None:
    """At most six ticks, and amounts under a cent (a CPU's) as multiples of one power of ten written once at the
    axis's end (x10^-4), not as labels eight digits wide that run into one another; `power`: that power, fixed
    (the bars' labels are written in it)."""
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    formatter = ScalarFormatter(useMathText=True)
    formatter.set_powerlimits((power, power) if power else (-2, 6))
    axis.set_major_locator(MaxNLocator(nbins=5))
    axis.set_major_formatter(formatter)


def cents_power(values: list[float]) -> int | None:
    """The power of ten that amounts under a cent are written in (the largest one's), None for larger amounts."""
    largest = max(values, default=0.0)
    return math.floor(math.log10(largest)) if 0 < largest < 1e-2 else None


def efficiency_figure(runs: list[Run]):
    """One bar per run for each of BARS, its value written over it (as the table writes it); n/a where a run has
    no such figure, and where no run has it, no axis at all but why."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter, StrMethodFormatter

    fig = Figure(figsize=(4 * len(BARS), 3.6), layout="tight")
    names = [run.name for run in runs]
    for ax, (key, label) in zip(fig.subplots(1, len(BARS)), BARS.items(), strict=True):
        ax.set_title(label)
        values = [run.summary.get(key) for run in runs]
        known = [i for i, value in enumerate(values) if value is not None]
        if not known:  # an empty axis reads as zeros
            ax.set_axis_off()
            ax.text(0.5, 0.5, f"n/a for every run:\n{NONE_HAS.get(key, 'not in their summaries')}", ha="center",
                    va="center", transform=ax.transAxes, fontsize=9)  # fmt: skip
            continue
        bars = ax.bar(known, [values[i] for i in known], color=[f"C{i}" for i in known])
        power = cents_power([values[i] for i in known]) if key == "cost_usd" else None
        labels = [f"{values[i] / 10**power:.3g}" if power else COLUMNS[key][1].format(values[i]) for i in known]
        ax.bar_label(bars, labels=labels, fontsize=8)  # fractions of a cent: in the axis's x10^power
        for i in set(range(len(runs))) - set(known):
            ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(runs)), names, rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-1, len(runs))  # one run's bar not the panel's whole width
        ax.margins(y=0.15)  # room for the values over the bars
        if key == "mean_mfu":
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))  # decimals from the tick spacing
        elif key == "cost_usd":
            dollar_axis(ax.yaxis, power)
        elif key == "tokens_per_second":
            ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    return fig


def table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    keys = [k for k in COLUMNS if any(run.summary.get(k) is not None for run in runs)]
    rows = []
    for run in runs:
        cells = [run.name]
        for key in keys:
            value = run.summary.get(key)
            cells.append("-" if value is None else COLUMNS[key][1].format(value))
        rows.append(cells)
    return ["run", *(COLUMNS[k][0] for k in keys)], rows


def samples_table(runs: list[Run]) -> tuple[list[str], list[list[str]]] | None:
    """Each held-out prompt with its reference and every run's last answer (and the first run's earliest one, the
    base model's when it evaluated before training), side by side; None when no run has samples."""
    sampled = [run for run in runs if run.samples]
    if not sampled:
        return None
    steps = {run.name: sorted({s["step"] for s in run.samples}) for run in sampled}
    answer = {(run.name, s["step"], s["prompt"]): s["answer"] for run in sampled for s in run.samples}
    first = sampled[0]
    columns = [(first, steps[first.name][0])] if len(steps[first.name]) > 1 else []
    columns += [(run, steps[run.name][-1]) for run in sampled]
    head = ["prompt", "reference", *(f"{run.name}, step {step}" for run, step in columns)]
    rows = []
    for sample in (s for s in first.samples if s["step"] == steps[first.name][0]):
        prompt = sample["prompt"]
        rows.append(
            [prompt, sample["reference"], *(answer.get((run.name, step, prompt), "-") for run, step in columns)]
        )
    return head, rows


def evaluation_table(runs: list[Run]) -> tuple[list[str], list[list[str]]] | None:
    """Each run's evaluation against its base model (`toolkit eval`): task, metric, base, fine-tuned, change."""
    rows = [[run.name, r["task"], r["metric"], f"{r['base']:.4g}", "-" if r["tuned"] is None else f"{r['tuned']:.4g}",
             "-" if r["delta"] is None else f"{r['delta']:+.4g}"] for run in runs for r in run.evaluation]  # fmt: skip
    return (["run", "task", "metric", "base", "fine-tuned", "change"], rows) if rows else None


SPLIT_HEADING = "Where a profiled step's time went"
SPLIT_NOTE = (
    "Per optimizer step over the steps --profile recorded; communication is the collectives in flight, "
    "which overlap the other phases (docs/profiling.md)."
)


def split_table(runs: list[Run]) -> tuple[list[str], list[list[str]]] | None:
    """Where a profiled step's time went (--profile, training/profiling.py), per run: milliseconds a step and share
    of each phase; None when no run was profiled."""
    profiled = [run for run in runs if run.summary.get("profile_split")]
    if not profiled:
        return None
    phases = list(dict.fromkeys(name for run in profiled for name in run.summary["profile_split"]))
    rows = []
    for run in profiled:
        split = run.summary["profile_split"]
        rows.append([run.name, *(f"{split[p]['ms']:.4g} ms ({split[p]['share']:.0%})" if p in split else "-"
                                 for p in phases)])  # fmt: skip
    return ["run", *phases], rows


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    cell = lambda text: " ".join(str(text).split()).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(cell, head)) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(map(cell, row)) + " |" for row in rows)]  # fmt: skip


def write_pages(runs: list[Run], pngs: list[Path], folder: Path) -> tuple[Path, Path]:
    head, rows = table(runs)
    md = ["# Run comparison", "", *markdown_table(head, rows)]
    md += ["", *(f"![{p.stem}]({p.name})" for p in pngs), ""]
    split = split_table(runs)
    if split:
        md += [f"## {SPLIT_HEADING}", "", SPLIT_NOTE, "", *markdown_table(*split), ""]
    evaluation = evaluation_table(runs)
    if evaluation:
        md += ["## Evaluation against the base model", "", *markdown_table(*evaluation), ""]
    samples = samples_table(runs)
    if samples:
        md += ["## What the models say", "", *markdown_table(*samples), ""]
    (folder / "report.md").write_text("\n".join(md))
    cells = lambda row, tag: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)  # noqa: E731
    page = (
        "<!doctype html><meta charset='utf-8'><title>Run comparison</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 10px;border-bottom:1px solid #ddd;"
        "text-align:right}td:first-child{text-align:left}</style><h1>Run comparison</h1><table>"
        f"<tr>{cells(head, 'th')}</tr>" + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in rows) + "</table>"
        + "".join(f"<p><img src='{p.name}' alt='{p.stem}'></p>" for p in pngs)
    )  # fmt: skip
    if split:
        page += (f"<h2>{SPLIT_HEADING}</h2><p>{html.escape(SPLIT_NOTE)}</p><table><tr>{cells(split[0], 'th')}</tr>"
                 + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in split[1]) + "</table>")  # fmt: skip
    if evaluation:
        page += ("<h2>Evaluation against the base model</h2><table>" f"<tr>{cells(evaluation[0], 'th')}</tr>"
                 + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in evaluation[1]) + "</table>")  # fmt: skip
    if samples:
        page += ("<h2>What the models say</h2><table class='samples'>" f"<tr>{cells(samples[0], 'th')}</tr>"
                 + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in samples[1]) + "</table>")  # fmt: skip
        page = page.replace("</style>", ".samples td{text-align:left;vertical-align:top}</style>")
    (folder / "index.html").write_text(page)
    return folder / "report.md", folder / "index.html"


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit report", description=description(__doc__))
    parser.add_argument("runs", nargs="+", help="run output folders or W&B offline run folders")
    parser.add_argument("--output", default="reports/latest", help="folder for the charts and pages")
    parser.add_argument("--wandb_project", help="also publish a W&B Report in this project (needs an account)")
    parser.add_argument("--wandb_entity")
    parser.add_argument("--sync", action="store_true", help="upload runs logged offline first (wandb sync)")
    args = parser.parse_args(argv)
    from .wandb_report import PublishError, check_on_wandb, publish_to_wandb

    try:
        if Path(args.output).exists() and not Path(args.output).is_dir():
            raise ReportError(f"--output {args.output} is a file: pass a folder for the charts and pages.")
        if why := writable(args.output):
            raise ReportError(f"--output {args.output}: cannot write the report there: {why}. Pass a folder you can "
                              "write to.")  # fmt: skip
        runs = [load_run(path) for path in args.runs]
        unique_names(runs)
        if args.wandb_project and not args.sync:
            check_on_wandb(runs, sync=False)  # before anything is drawn: what to upload first
    except (ReportError, PublishError) as error:
        return report_error(error)
    folder = Path(args.output)
    folder.mkdir(parents=True, exist_ok=True)
    pngs = charts(runs, folder)
    md, page = write_pages(runs, pngs, folder)
    print(md.read_text())
    print(f"written: {page}, {md}, " + ", ".join(str(p) for p in pngs))
    if args.wandb_project:
        try:
            samples = samples_table(runs)
            url = publish_to_wandb(runs, args.wandb_project, args.wandb_entity, args.sync,
                                   "\n".join(markdown_table(*samples)) if samples else None)  # fmt: skip
            print(f"W&B report: {url}")
        except PublishError as error:
            return report_error(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
