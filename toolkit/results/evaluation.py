"""Did it help: the fine-tuned model against the one it started from, on the same inputs with the same settings.

`python -m toolkit eval RUN [--tasks a,b] [--limit N]` (and `--eval_after_training true` at the end of a run):
  held-out       the recipe's own held-out split, through the run's own collator and metrics (perplexity and
                 token accuracy for SFT, accuracy for classification: per token and per example, so they do not
                 move with how rows are batched), the Trainer's evaluate: the run's own where it logged one (the
                 base model at step 0 with --eval_on_start, the saved one at its last step); for GRPO each model's
                 greedy answers to the held-out prompts scored by the run's rewards (held_out_rewards.py)
  reply_choice   an lm-evaluation-harness task made from the held-out conversations (the harness's YAML format
                 over a JSON file in RUN/eval/): each prompt, as the run's chat template writes it, with its real
                 answer and three answers to other prompts; acc picks by log-likelihood, acc_norm per character.
                 Offline, on real data, for any chat SFT recipe
  other names    the harness's own tasks (hellaswag, arc_easy, mmlu, ...): their data comes from the Hub
Results go to RUN/eval_results.json (both models' inputs fingerprinted: they are the same), a table on stdout, and
the run's W&B run (a table), when it had one. One process: both models load one after the other, once every check
of the run folder, tokenizer, tasks and data has passed (eval_checks.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError, command, description
from ..metrics.samples import EVAL_FILE, RUN_LOG
from ..models import gguf_model
from ..settings import tasks as task_table
from .eval_checks import EVAL_FOLDER, HELD_OUT, REPLY_CHOICE, check_run_folder, checked_tasks, task_manager
from .record import RunRecord
from .reply_choice import reply_choice_task


def tasks_for(record: RunRecord, requested: str | None) -> list[str]:
    """The tasks asked for (--tasks, or the recipe's eval_tasks), else the task's defaults, checked against the
    run (its held-out rows, as its summary counts them: unknown counts as some, which the data then says)."""
    holds_out = record.config.get("data", {}).get("eval_rows") != 0
    return checked_tasks(record.task, requested or record.settings.get("eval_tasks"), holds_out)


# ------------------------------------------------------------------------------------------------ models


def load(record: RunRecord, which: str):
    """The model the run started from ("base") or the one it saved ("tuned"; a LoRA run's adapter on its base), as
    its task loads them, and the tokenizer the run trained with."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, set_seed

    from ..models.loading import load_model
    from ..settings.model_arguments import ModelArguments
    from ..settings.parser import computes_bf16
    from ..settings.tasks import model_class

    folder, task = record.folder, record.task
    tokenizer = AutoTokenizer.from_pretrained(folder)
    labels = None
    if task == "classification":
        config = AutoConfig.from_pretrained(folder / "merged" if (folder / "merged").is_dir() else folder)
        labels = [config.id2label[i] for i in range(len(config.id2label))]
    model_args = record.arguments(ModelArguments)
    model_args.use_lora, model_args.load_in_4bit = False, False
    if not computes_bf16():  # both models in fp32 on a CPU that would emulate 16 bits (settings/parser.py)
        model_args.dtype = "float32"
    if which == "base" or (folder / "adapter_config.json").is_file():
        set_seed(record.settings.get("seed", 42))  # a new head starts as the run's did (runner.py seeds its load)
        model = load_model(model_args, task, tokenizer, labels)
        if which == "tuned":
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, folder)
    else:
        model = model_class(task).from_pretrained(folder, dtype=torch_dtype_of(model_args))
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


def torch_dtype_of(model_args):
    from ..settings.model_arguments import torch_dtype

    return "auto" if model_args.dtype == "auto" else torch_dtype(model_args.dtype)


# ---------------------------------------------------------------------------------------------- held-out


def held_out_data(record: RunRecord, tokenizer, model_config):
    """The run's held-out split prepared as the run prepared it (from the same cache), its collator, and the raw
    held-out conversations (SFT)."""
    from ..data.loading import load_data
    from ..data.packing import use_packing
    from ..data.preparation import prepare
    from ..settings.arguments import DataArguments
    from ..settings.tasks import task

    data_args = record.arguments(DataArguments)
    raw, _ = load_data(data_args)
    if raw.get("eval") is None or len(raw["eval"]) == 0:
        raise ConfigError(f"{record.folder}: the run held nothing out (eval_fraction 0, no eval_split): its held-out "
                          "evaluation has no rows. Name harness tasks with --tasks instead.")  # fmt: skip
    packing = use_packing(record.task, data_args.packing, model_config)
    processor = None
    if task(record.task).images:  # the processor the run saved beside its model (images expand as they did)
        from ..models.processors import load_processor

        processor = load_processor(str(record.folder))
    prepared = prepare(raw, tokenizer, data_args, lambda desc: contextlib.nullcontext(), packing, processor)
    prepared.packed = packing
    conversations = raw["eval"][data_args.messages_column] if data_args.messages_column in raw["eval"].column_names \
        else []  # fmt: skip
    return prepared, conversations


def held_out_metrics(record: RunRecord, model, tokenizer, prepared) -> dict[str, float]:
    """The Trainer's evaluate on the held-out split with the run's collator and metrics (training/evaluation.py)."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from ..data.packing import model_inputs
    from ..settings.parser import computes_bf16
    from ..settings.tasks import task
    from ..training.evaluation import LogitsByName, metrics_for

    class HeldOut(LogitsByName, Trainer):  # the metrics read the model's logits, by name
        def prediction_step(self, model, inputs, *args, **kwargs):  # the collator's bookkeeping kept from the model
            return super().prediction_step(model, model_inputs(inputs), *args, **kwargs)

    settings = record.settings
    compute, preprocess = metrics_for(record.task, prepared.packed)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=scratch, per_device_eval_batch_size=settings["per_device_eval_batch_size"],
                                 bf16=bool(settings.get("bf16")) and computes_bf16(),
                                 fp16=bool(settings.get("fp16")), report_to=[],
                                 use_cpu=not torch.cuda.is_available(), disable_tqdm=False,
                                 remove_unused_columns=not task(record.task).images)  # fmt: skip
        trainer = HeldOut(model=model, args=args, eval_dataset=prepared.eval, data_collator=prepared.collator,
                          processing_class=tokenizer, compute_metrics=compute,
                          preprocess_logits_for_metrics=preprocess)  # fmt: skip
        metrics = trainer.evaluate()
    return held_out_figures(metrics)


# Token-level figures (the Trainer's eval_loss is a mean of batch means: it moves with how rows are batched), and
# a reward model's over its pairs (results/held_out_pairs.py)
HELD_OUT_FIGURES = ("eval_perplexity", "eval_token_accuracy", "eval_answer_accuracy", "eval_accuracy", "eval_margin")


def task_held_out(record: RunRecord, which: str, model, tokenizer, rows, batch_size: int) -> dict[str, float]:
    """A task's own held-out figures, where the Trainer's evaluation is not its measure: distill's closeness to the
    teacher, online RL's rewards of greedy answers, KTO's likelihoods by label, a reward model's pairs; {} for the
    others (held_out_metrics)."""
    kind = task_table.task(record.task)
    if kind.teacher:
        from .held_out_teacher import held_out_teacher

        return held_out_teacher(record, model, tokenizer, rows, last=which == "tuned", batch_size=batch_size)
    if kind.samples_online:
        from .held_out_rewards import held_out_rewards

        return held_out_rewards(record, model, tokenizer, rows, batch_size)
    if kind.labelled:
        from .held_out_labelled import held_out_labelled

        return held_out_labelled(model, tokenizer, rows)
    if record.task == "reward":
        from .held_out_pairs import held_out_pairs

        return held_out_pairs(record, model, tokenizer, rows)
    return {}


def held_out_fingerprint(rows) -> str:
    """What each model is scored on: the token ids the run's collator batches, or the rows TRL's trainer renders
    itself (GRPO's prompts, a reward model's pairs)."""
    if "input_ids" in rows.column_names:
        scored = [list(ids) for ids in rows["input_ids"]]
    else:  # image-text rows: their conversations and images (paths, or the bytes)
        columns = ("prompt", "chosen", "rejected", "messages", "images", "conversations", "image")
        scored = [rows[c] for c in columns if c in rows.column_names]
    return hashlib.sha256(json.dumps(scored, default=str).encode()).hexdigest()


def held_out_figures(metrics: dict[str, Any]) -> dict[str, float]:
    return {k.removeprefix("eval_"): float(v) for k, v in metrics.items() if k in HELD_OUT_FIGURES}


def logged_held_out(record: RunRecord) -> dict[str, tuple[int, dict[str, float]]]:
    """The run's own held-out evaluations, where it made them: of the model it started from at step 0
    (--eval_on_start) as "base", of the one it saved at its last step as "tuned", each with its step. The same rows,
    collator, metrics and precision as held_out_metrics (the chat demo's: equal to 8 digits), so not computed
    twice. None from a 4-bit run (the base that trained was quantized, the one compared here is not) nor from a
    QAT run (it evaluated through its fake quantizers; the saved weights are plain)."""
    from ..metrics.report import json_lines

    log = record.folder / RUN_LOG
    if record.settings.get("load_in_4bit") or record.settings.get("qat") or not log.is_file():
        return {}
    found = {}
    for line in json_lines(log):
        figures = held_out_figures(line)
        if figures and line.get("step") == 0:
            found["base"] = (0, figures)
        elif figures and line.get("step") == record.summary.get("steps"):
            found["tuned"] = (line["step"], figures)
    return found


# ----------------------------------------------------------------------------------- the harness's tasks


def harness(model, tokenizer, tasks: list[str], manager, limit: int | None,
            batch_size: int) -> tuple[dict[str, dict[str, float]], dict[str, str]]:  # fmt: skip
    """lm-evaluation-harness's simple_evaluate on an in-memory model: each task's metrics, and a fingerprint of the
    requests it scored (the contexts and continuations), which is what makes two models' results comparable."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True,
                              bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                              fewshot_random_seed=0)  # fmt: skip
    except (ConnectionError, OSError, ValueError) as error:  # the Hub's data sets, offline
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"lm-evaluation-harness could not load its tasks' data ({reason}): its tasks read their "
            "data from the Hugging Face Hub; offline, use held-out and reply_choice."
        ) from None
    metrics, fingerprints = {}, {}
    for task in tasks:
        found = out["results"][task]
        metrics[task] = {k.split(",")[0]: float(v) for k, v in found.items()
                         if "," in k and "stderr" not in k and isinstance(v, (int, float))}  # fmt: skip
        requests = [sample["arguments"] for sample in out["samples"][task]]
        fingerprints[task] = hashlib.sha256(json.dumps(requests, default=str).encode()).hexdigest()
    return metrics, fingerprints


# ----------------------------------------------------------------------------------------------- the run


def evaluate_run(folder: str | Path, requested: str | None = None, limit: int | None = None,
                 batch_size: int = 8, gguf: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Both models on every task, compared, and on the held-out split each of the run's GGUF files named in `gguf`
    (run by llama.cpp); written to RUN/eval_results.json and returned."""
    import gc

    from ..models.loading import load_config
    from ..settings.model_arguments import ModelArguments

    record = RunRecord.read(folder)
    tasks = tasks_for(record, requested)
    files = gguf_model.exported_files(record.folder, gguf or [], HELD_OUT in tasks)  # before a model loads
    tokenizer = check_run_folder(record, tasks)  # the one the run trained with, its chat template
    harness_tasks = [t for t in tasks if t != HELD_OUT]
    prepared, include, manager = None, None, None
    if HELD_OUT in tasks or REPLY_CHOICE in tasks:
        prepared, conversations = held_out_data(record, tokenizer, load_config(record.arguments(ModelArguments)))
        if REPLY_CHOICE in tasks:
            include = reply_choice_task(conversations, tokenizer, record.folder / EVAL_FOLDER)
    if harness_tasks:  # every name checked before any model loads
        manager = task_manager(harness_tasks, include)
    scores: dict[str, dict[str, dict[str, float]]] = {"base": {}, "tuned": {}}
    inputs: dict[str, dict[str, str]] = {"base": {}, "tuned": {}}
    kind = task_table.task(record.task)  # online RL's, KTO's held-out figures are their own (task_held_out)
    scored_by_trainer = HELD_OUT in tasks and not kind.samples_online and not kind.labelled
    logged = logged_held_out(record) if scored_by_trainer else {}
    for which in ("base", "tuned"):  # one model in memory at a time
        name = record.base_model if which == "base" else record.folder
        if HELD_OUT in tasks:
            inputs[which][HELD_OUT] = held_out_fingerprint(prepared.eval)
        note = ""
        if which in logged:
            step, scores[which][HELD_OUT] = logged[which]
            note = f": held-out as the run evaluated it at step {step}"
        print(f"eval: the {which} model ({name}){note}", file=sys.stderr, flush=True)
        if which in logged and not harness_tasks:
            continue
        model, _ = load(record, which)
        if HELD_OUT in tasks and which not in logged:
            own = task_held_out(record, which, model, tokenizer, prepared.eval, batch_size)
            scores[which][HELD_OUT] = own or held_out_metrics(record, model, tokenizer, prepared)
        if harness_tasks:
            found, prints = harness(model, tokenizer, harness_tasks, manager, limit, batch_size)
            scores[which].update(found)
            inputs[which].update(prints)
        del model
        gc.collect()
    for quant, path in files.items():  # each file run by llama.cpp, through the same rows and code
        with gguf_model.opened(path, record.folder, tokenizer, record.settings) as model:
            scores[quant] = {HELD_OUT: task_held_out(record, "tuned", model, tokenizer, prepared.eval, batch_size)
                             or held_out_metrics(record, model, tokenizer, prepared)}  # fmt: skip
    rows = compared(tasks, scores, list(files))
    result = {
        "run": str(record.folder),
        "base_model": record.base_model,
        "tasks": tasks,
        "settings": {
            "limit": limit,
            "batch_size": batch_size,
            "seed": 0,
            "eval_batch_size": record.settings["per_device_eval_batch_size"],
        },
        "inputs": inputs,  # fingerprints of what each model was scored on: equal for both
        "held_out_logged_at": {which: step for which, (step, _) in logged.items()},  # the run's own, reused
        "results": rows,
    }
    (record.folder / EVAL_FILE).write_text(json.dumps(result, indent=1))
    log_to_wandb(record, rows)
    return result


def compared(tasks: list[str], scores: dict[str, dict], files: list[str]) -> list[dict[str, Any]]:
    """A row a task and metric: the base's figure, the tuned model's, the change, and each GGUF file's."""
    rows = []
    for task in tasks:
        for metric, before in scores["base"][task].items():
            after = scores["tuned"][task].get(metric)
            row = {"task": task, "metric": metric, "base": before, "tuned": after,
                   "delta": None if after is None else after - before}  # fmt: skip
            if files:
                row["gguf"] = {q: scores[q].get(task, {}).get(metric) for q in files}
            rows.append(row)
    return rows


def table(result: dict[str, Any]) -> str:
    """The before/after table, as the run and `toolkit eval` print it (a column for each GGUF file scored)."""
    files = list(result["results"][0].get("gguf", {})) if result["results"] else []
    lines = [f"{'task':<14}{'metric':<16}{'base':>12}{'fine-tuned':>12}{'change':>10}" +
             "".join(f"{'gguf ' + q:>14}" for q in files)]  # fmt: skip
    for row in result["results"]:
        after = row["tuned"]
        change = "" if after is None else f"{after - row['base']:+.4g}"
        lines.append(f"{row['task']:<14}{row['metric']:<16}{fmt(row['base']):>12}{fmt(after):>12}{change:>10}" +
                     "".join(f"{fmt(row['gguf'][q]):>14}" for q in files))  # fmt: skip
    return "\n".join(lines)


def fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.4g}"


def log_to_wandb(record: RunRecord, rows: list[dict[str, Any]]) -> None:
    """The table in the run's own W&B run (resumed by its id, offline if it was), where it had one."""
    summary = record.summary
    if not summary.get("wandb_run_id"):
        return
    try:
        import wandb
    except ImportError:
        return
    logged = summary.get("wandb_run_dir")  # WANDB_DIR/wandb/<run>: the same WANDB_DIR again
    run = wandb.init(id=summary["wandb_run_id"], project=summary.get("wandb_project"), resume="allow",
                     entity=summary.get("wandb_entity"), mode="offline" if summary.get("wandb_offline") else None,
                     dir=str(Path(logged).parent.parent) if logged else None)  # fmt: skip
    columns = ["task", "metric", "base", "tuned", "delta"]
    run.log({"eval/before_after": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])})
    run.summary.update({f"eval_after/{r['task']}/{r['metric']}": r["tuned"] for r in rows})
    run.finish()


@command
def eval_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit eval RUN [--tasks a,b] [--limit N] [--batch_size B]`: the fine-tuned model against the one
    it started from, on the same inputs; RUN/eval_results.json and the table."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit eval", description=description(eval_main.__doc__))
    parser.add_argument("run", help="a run's --output_dir")
    parser.add_argument("--tasks", help=f"comma-separated: {HELD_OUT}, {REPLY_CHOICE}, or lm-evaluation-harness tasks")
    parser.add_argument("--limit", type=int, help="at most this many examples of each harness task")
    parser.add_argument("--batch_size", type=int, default=8, help="the harness's batch size")
    parser.add_argument("--gguf", help="comma-separated: the run's GGUF files (toolkit export) to score on held-out")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: at least 1 example per task, or leave it out for all.")
    gguf = [q.strip() for q in args.gguf.split(",") if q.strip()] if args.gguf else None
    print(table(evaluate_run(args.run, args.tasks, args.limit, args.batch_size, gguf)))
    return 0
