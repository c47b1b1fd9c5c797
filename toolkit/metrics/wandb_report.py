"""`toolkit report RUNS --wandb_project P`: the comparison as a W&B Report (wandb-workspaces' reports API).

The report holds what W&B draws from the runs' own logs (one chart per compared figure against the optimizer
step: loss, tokens/s, MFU, dollars; loss against dollars; GRPO's reward against both), over a runset that selects
exactly the compared runs by their W&B ids; and beside the charts what only the toolkit knows: per run, the
strategy and the memory and cost it planned against the peak it measured and the dollars it spent, and the
generation samples where the runs have them.

A run logged offline (the default without an account) is not on W&B until `wandb sync` uploads it: such runs are
named with the command that uploads them, or uploaded first with `--sync`. A run logged without W&B (`--report_to
none`) cannot be in a W&B report: it is named, not left out. No account, no network, an entity or project W&B
refuses: one line each. tests/test_report.py runs the real command against a stand-in of W&B's API on
127.0.0.1: what it proves is the request the toolkit sends, not how W&B's server renders it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..errors import ToolkitError

Run = Any  # report.py's Run: name, summary, config (it imports this module, not the other way round)

# (metric logged under train/, chart title) against the optimizer step; then loss against dollars.
FIGURES = [("loss", "training loss"), ("tokens_per_second", "tokens/s"), ("mfu", "MFU"), ("cost_usd", "cost (USD)")]


class PublishError(ToolkitError, RuntimeError):
    """A W&B Report that cannot be published from here: the fix is the message."""


def synced(run: Run) -> bool:
    """A run W&B has: logged online, or logged offline and uploaded since (`wandb sync` leaves a .synced file)."""
    folder = run.summary.get("wandb_run_dir")
    if not run.summary.get("wandb_offline") or not folder:
        return True
    return any(Path(folder).glob("*.wandb.synced"))


def check_on_wandb(runs: list[Run], sync: bool) -> None:
    """Every run has a W&B id and is on W&B (`sync`: offline runs uploaded now, with `wandb sync`)."""
    missing = [run.name for run in runs if not run.summary.get("wandb_run_id")]
    if missing:
        raise PublishError(f"{', '.join(missing)} logged no W&B run (--report_to none, or WANDB_MODE=disabled), "
                           "so a W&B report cannot show it: leave it out of the runs to publish, or train it with "
                           "W&B on.")  # fmt: skip
    offline = [run for run in runs if not synced(run)]
    if offline and sync:
        wandb_cli = shutil.which("wandb") or str(Path(sys.executable).parent / "wandb")
        for run in offline:
            done = subprocess.run([wandb_cli, "sync", run.summary["wandb_run_dir"]], capture_output=True, text=True)
            if done.returncode != 0 or not synced(run):
                last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise PublishError(f"wandb sync {run.summary['wandb_run_dir']} failed ({last[0][:200]}): log in "
                                   "(`wandb login`), then report again.")  # fmt: skip
        offline = []
    if offline:
        folders = " ".join(run.summary["wandb_run_dir"] for run in offline)
        raise PublishError(f"{', '.join(run.name for run in offline)} were logged offline and are not on W&B yet: "
                           f"upload them with `wandb sync {folders}`, or pass --sync, then report again.")  # fmt: skip


def plan_table(runs: list[Run]) -> str:
    """Markdown: per run, the strategy, and the memory and cost its own plan predicted against what it measured."""
    gib = 2**30
    lines = ["| run | strategy | processes | planned memory per device GiB | measured peak GiB | planned $ | spent $ |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for run in runs:
        plan = run.config.get("memory_plan") or {}
        cost = run.config.get("cost_plan") or {}
        cells = [run.name, run.summary.get("strategy", "-"), run.summary.get("processes", "-"),
                 f"{plan['device_total'] / gib:.2f}" if plan.get("device_total") else "-",
                 f"{run.summary['peak_memory_gib']:.2f}" if run.summary.get("peak_memory_gib") is not None else "-",
                 f"{cost['usd']:.4g}" if cost.get("usd") is not None else "- (no datasheet peak)",
                 f"{run.summary['cost_usd']:.4g}" if run.summary.get("cost_usd") is not None else "-"]  # fmt: skip
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def check_account_and_network() -> None:
    """An API key, and W&B's server answering on its port, checked in seconds: the SDK would retry for minutes."""
    from .wandb_run import has_api_key

    if not has_api_key():
        raise PublishError("no W&B account on this machine: `wandb login` (or set WANDB_API_KEY), or leave out "
                           "--wandb_project (the charts and pages are written without it).")  # fmt: skip
    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    url = urlparse(base)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5):
            pass
    except OSError as error:
        raise PublishError(f"W&B cannot be reached from here ({base}: {error.strerror or error}): the charts and "
                           "pages are written; publish from a machine with network, or set WANDB_BASE_URL to your "
                           "own W&B server.") from None  # fmt: skip


def publish_to_wandb(runs: list[Run], project: str, entity: str | None, sync: bool = False,
                     samples: str | None = None) -> str:  # fmt: skip
    """Save the comparison as a W&B Report, with `samples` (markdown: the runs' answers side by side) if any; its
    URL. Needs an account and network (or WANDB_BASE_URL's server)."""
    check_account_and_network()
    check_on_wandb(runs, sync)
    import wandb_workspaces.reports.v2 as wr

    ids = [run.summary["wandb_run_id"] for run in runs]
    where = {"project": project, **({"entity": entity} if entity else {})}  # else the account's default entity
    panels = [wr.LinePlot(x="train/global_step", y=[f"train/{key}"], title=title) for key, title in FIGURES]
    panels.append(wr.LinePlot(x="train/cost_usd", y=["train/loss"], title="loss vs dollars"))
    if any("reward" in line for run in runs for line in run.history):  # GRPO's, as reward.png beside it
        panels += [wr.LinePlot(x="train/global_step", y=["train/reward"], title="reward"),
                   wr.LinePlot(x="train/cost_usd", y=["train/reward"], title="reward vs dollars")]  # fmt: skip
    blocks = [
        wr.PanelGrid(runsets=[wr.Runset(**where, name="compared runs", filters=f"ID in {ids!r}")], panels=panels),
        wr.H2(text="Planned against measured"),
        wr.MarkdownBlock(text=plan_table(runs)),
    ]
    if samples:
        blocks += [wr.H2(text="What the models say"), wr.MarkdownBlock(text=samples)]
    try:
        report = wr.Report(**where, title="Run comparison", description=", ".join(run.name for run in runs),
                           blocks=blocks)  # fmt: skip
        report.save()
        return report.url
    except Exception as error:  # noqa: BLE001 - the SDK's and the network's, each said in one line
        raise PublishError(explain(error, project, entity)) from None


def explain(error: Exception, project: str, entity: str | None) -> str:
    """What a failed save means, and the fix."""
    message = " ".join(str(error).split())[:300] or type(error).__name__
    if "not logged in" in message or "api_key" in message.lower():
        return ("no W&B account on this machine: `wandb login` (or set WANDB_API_KEY), or leave out --wandb_project "
                "(the charts and pages are written without it).")  # fmt: skip
    if any(word in type(error).__name__ + message for word in ("Connection", "Timeout", "timed out", "resolve")):
        return (f"W&B cannot be reached from here ({message}): the charts and pages are written; publish from a "
                "machine with network, or set WANDB_BASE_URL for your own W&B server.")  # fmt: skip
    where = f"{entity}/{project}" if entity else f"project {project} of your default entity"
    return (f"W&B refused the report for {where} ({message}): check --wandb_entity and --wandb_project, and that "
            "your account may write there.")  # fmt: skip
