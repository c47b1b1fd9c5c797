"""`make bench-rl-objectives`: the GRPO demo (recipes/smollm2_grpo.py) trained under each objective, the same
seed, prompts and budget, then one of them again with another seed for the run-to-run spread; one markdown table.

  grpo      --loss_type grpo                                    (each completion's tokens averaged)
  dapo      --loss_type dapo                                    (TRL's default: a mean over the step's tokens)
  dr_grpo   --loss_type dr_grpo                                 (a constant divisor: completions x max length)
  gspo      --loss_type grpo --importance_sampling_level sequence   (one ratio a completion)
  cispo     --loss_type cispo                                   (the clipped ratio a fixed weight)
  sapo      --loss_type sapo                                    (a soft gate in place of the clip)
  rloo      --task rloo                                         (TRL's RLOOTrainer: leave-one-out, beta 0.05)

Each run is the demo's own command in a fresh process (`recipes/smollm2_grpo.py ... --output_dir
runs/rl_objectives/NAME`, its output beside it in NAME.log), which ends by evaluating base and tuned on the same 61
held-out problems (eval_results.json). The table reads each run's folder: held-out accuracy and finished share
(eval_results.json), the training reward of its last steps and the KL to the reference (run_log.jsonl: TRL logs
`kl` only where beta > 0, as rloo's default), the run's dollars (run_summary.json, the toolkit's cost of its
training) and the whole command's wall time (measured here). A full bench is 8 runs of about 6 minutes on 2 CPU
cores (49 minutes on a 2-core Xeon, docs/rl.md); `--tiny --max_steps 1` smoke-tests it in a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OBJECTIVES = {
    "grpo": ["--loss_type", "grpo"],
    "dapo": ["--loss_type", "dapo"],
    "dr_grpo": ["--loss_type", "dr_grpo"],
    "gspo": ["--loss_type", "grpo", "--importance_sampling_level", "sequence"],
    "cispo": ["--loss_type", "cispo"],
    "sapo": ["--loss_type", "sapo"],
    "rloo": ["--task", "rloo"],  # RLOO takes neither loss_type nor the ratio level (settings/policy.py's READ_BY)
}
# Tiny mode holds nothing out; the smoke test brings the held-out split and its evaluation back, so that the table
# is read as a full run's.
TINY_EVAL = ["--eval_fraction", "0.02", "--eval_after_training", "true"]
LAST_STEPS = 4  # the training reward's mean over the run's last steps (one step's 32 answers is a noisy figure)


def train(name: str, flags: list[str], folder: Path) -> dict:
    """One run of the demo in its own process; its folder's figures, or why it failed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "recipes" / "smollm2_grpo.py"), *flags, "--output_dir", str(folder)]
    print(f"{name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(folder.with_suffix(".log"), "w") as log:
        code = subprocess.call(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    wall = time.perf_counter() - start
    if code != 0:
        tail = folder.with_suffix(".log").read_text().strip().splitlines()[-3:]
        print(f"{name}: exit {code}; the end of {folder.with_suffix('.log')}:\n  " + "\n  ".join(tail),
              file=sys.stderr, flush=True)  # fmt: skip
        return {"name": name, "failed": f"exit {code}", "wall": wall}
    return {**read(name, folder), "wall": wall}


def read(name: str, folder: Path) -> dict:
    """A finished run's figures from its output folder."""
    summary = json.loads((folder / "run_summary.json").read_text())
    log = [json.loads(line) for line in (folder / "run_log.jsonl").read_text().splitlines() if line.strip()]
    evaluation = folder / "eval_results.json"
    held_out = {}
    if evaluation.is_file():
        held_out = {r["metric"]: r for r in json.loads(evaluation.read_text())["results"] if r["task"] == "held-out"}
    rewards = [row["reward"] for row in log if "reward" in row and "eval_reward" not in row]
    kl = [row["kl"] for row in log if "kl" in row]
    settings = summary["config"]["toolkit"]
    return {"name": name, "task": settings["task"], "beta": settings["beta"], "seed": settings["seed"],
            "accuracy": held_out.get("accuracy"), "finished": held_out.get("finished"),
            "reward": sum(rewards[-LAST_STEPS:]) / len(rewards[-LAST_STEPS:]) if rewards else None,
            "kl": sum(kl) / len(kl) if kl else None, "usd": summary["summary"].get("cost_usd"),
            "status": summary["summary"].get("status")}  # fmt: skip


def cell(value, digits: str = ".3f") -> str:
    return "-" if value is None else format(value, digits)


def table(rows: list[dict]) -> list[str]:
    lines = ["| objective | seed | held-out accuracy: base -> tuned | finished (tuned) | training reward, last "
             f"{LAST_STEPS} steps | KL to the reference (mean) | wall | $ |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        wall = f"{int(row['wall'] // 60)}:{int(row['wall'] % 60):02d}" if row.get("wall") is not None else "-"
        if "failed" in row:
            lines.append(f"| {row['name']} | | {row['failed']} | | | | {wall} | |")
            continue
        accuracy = row["accuracy"]
        held = f"{accuracy['base']:.3f} -> {accuracy['tuned']:.3f}" if accuracy else "- (no held-out evaluation)"
        finished = row["finished"]["tuned"] if row["finished"] else None
        kl = cell(row["kl"], ".4f") if row["beta"] else "- (beta 0: TRL logs none)"
        lines.append(f"| {row['name']} | {row['seed']} | {held} | {cell(finished)} | {cell(row['reward'])} | {kl} | "
                     f"{wall} | {cell(row['usd'], '.4f')} |")  # fmt: skip
    return lines


def spread(rows: list[dict], repeat: str) -> str | None:
    """The repeated objective's held-out accuracy under its two seeds: how far apart two runs of one objective land."""
    same = [r for r in rows if r["name"].split(" ")[0] == repeat and "failed" not in r and r["accuracy"]]
    if len(same) < 2:
        return None
    tuned = [r["accuracy"]["tuned"] for r in same]
    seeds = " and ".join(str(r["seed"]) for r in same)
    return (f"Run-to-run spread: {repeat}'s tuned held-out accuracy is {' and '.join(f'{t:.3f}' for t in tuned)} "
            f"under seeds {seeds} ({max(tuned) - min(tuned):.3f} apart): a difference between objectives smaller "
            "than that is noise.")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"comma-separated: {', '.join(OBJECTIVES)}")
    parser.add_argument("--seed", type=int, default=42, help="every run's seed (the held-out split's is fixed)")
    parser.add_argument("--repeat", default="dapo", help="the objective run again with --repeat_seed (none: no repeat)")
    parser.add_argument("--repeat_seed", type=int, default=43)
    parser.add_argument("--beta", type=float, help="every run's KL coefficient (default: each task's own)")
    parser.add_argument("--tiny", action="store_true", help="the recipe's tiny mode (a smoke test)")
    parser.add_argument("--max_steps", type=int, help="steps of each run (default: the recipe's 16)")
    parser.add_argument("--output_dir", type=Path, help="runs/rl_objectives (tiny: runs/rl_objectives_tiny)")
    parser.add_argument("--reuse", action="store_true", help="read a run whose folder has finished, not rerun it")
    args = parser.parse_args()
    names = [n.strip() for n in args.objectives.split(",") if n.strip()]
    unknown = [n for n in [*names, args.repeat] if n not in OBJECTIVES and n != "none"]
    if unknown:
        parser.error(f"unknown objective {unknown[0]!r}: one of {', '.join(OBJECTIVES)}")
    out = args.output_dir or ROOT / "runs" / ("rl_objectives_tiny" if args.tiny else "rl_objectives")
    common = [*(["--tiny", *TINY_EVAL] if args.tiny else []), "--report_to", "none",
              *(["--max_steps", str(args.max_steps)] if args.max_steps else []),
              *(["--beta", str(args.beta)] if args.beta is not None else [])]  # fmt: skip
    runs = [(n, args.seed, out / n) for n in names]
    if args.repeat != "none":
        runs.append((f"{args.repeat} (repeat)", args.repeat_seed, out / f"{args.repeat}-seed{args.repeat_seed}"))
    rows = []
    for name, seed, folder in runs:
        flags = [*OBJECTIVES[name.split(" ")[0]], *common, "--seed", str(seed)]
        if args.reuse and (folder / "run_summary.json").is_file() and (folder / "eval_results.json").is_file():
            rows.append({**read(name, folder), "wall": None})
            continue
        rows.append(train(name, flags, folder))
    print("\n".join(table(rows)))
    said = spread(rows, args.repeat)
    if said:
        print(f"\n{said}")
    return 1 if any("failed" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
