"""What `toolkit eval` (and `--eval_after_training`, before training starts) refuses, each in one line before any
model loads: tasks a run cannot be evaluated on, a run folder without its model or tokenizer, or one it cannot
write its results into."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from ..errors import ConfigError
from ..metrics.samples import EVAL_FILE
from ..outputs import check_writable
from .record import RunRecord, check_export

HELD_OUT = "held-out"
REPLY_CHOICE = "reply_choice"
DEFAULT_TASKS = {
    "sft": (HELD_OUT, REPLY_CHOICE),
    "classification": (HELD_OUT,),
    "dpo": (),
    "kto": (HELD_OUT,),
    "grpo": (HELD_OUT,),
    "rloo": (HELD_OUT,),
    "distill": (HELD_OUT,),
    "reward": (HELD_OUT,),
    "vlm_sft": (HELD_OUT,),
}
EVAL_FOLDER = "eval"  # RUN/eval/: the reply_choice task's files


def checked_tasks(task: str, named: str | None, holds_out: bool) -> list[str]:
    """The tasks asked for (comma-separated), else the run's task's defaults; refused where such a run cannot be
    evaluated on them."""
    tasks = [t.strip() for t in named.split(",") if t.strip()] if named else list(DEFAULT_TASKS.get(task, ()))
    if not tasks:
        raise ConfigError(f"a {task} run has no default evaluation here yet: name lm-evaluation-harness tasks with "
                          "--tasks (--eval_tasks at the end of a run): hellaswag, arc_easy, ...")  # fmt: skip
    if REPLY_CHOICE in tasks and task != "sft":
        raise ConfigError(f"{REPLY_CHOICE} scores chat answers: a {task} run has none. Drop it from --tasks.")
    needing = [t for t in tasks if t in (HELD_OUT, REPLY_CHOICE)]
    if needing and not holds_out:
        raise ConfigError(f"{' and '.join(needing)} evaluate on held-out data and the run held nothing out "
                          "(eval_fraction 0, no eval_split): train with --eval_fraction 0.1 (or --eval_split NAME), "
                          "or name lm-evaluation-harness tasks instead (--tasks, or --eval_tasks at the end of a "
                          "run).")  # fmt: skip
    if any(t != HELD_OUT for t in tasks) and importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("lm-evaluation-harness is not installed: `pip install lm-eval` (make install has it).")
    return tasks


def check_eval_tasks(task: str, named: str | None, holds_out: bool) -> list[str]:
    """`--eval_after_training`'s tasks, checked before training as `toolkit eval` checks them after: the tasks,
    then the harness's own names (reply_choice is made from the run's data, at the end)."""
    tasks = checked_tasks(task, named, holds_out)
    if harness_names := [t for t in tasks if t not in (HELD_OUT, REPLY_CHOICE)]:
        task_manager(harness_names, None)
    return tasks


def task_manager(tasks: list[str], include: Path | None):
    """lm-evaluation-harness's index of its tasks (and ours, `include`), the names checked before any model loads.
    Ours alone (reply_choice) leave the harness's own out: indexing its thousands of task files takes 30 s on a
    2-core CPU."""
    if include is None:
        manager = own_tasks()
    else:
        manager = harness_class()(include_path=str(include), include_defaults=any(t != REPLY_CHOICE for t in tasks))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"--tasks {', '.join(unknown)}: not a task of lm-evaluation-harness (`lm-eval ls tasks` "
                          f"lists them) nor {REPLY_CHOICE} or {HELD_OUT}.")  # fmt: skip
    return manager


@functools.cache
def own_tasks():
    """The harness's index of its own tasks, made once per process: indexing its thousands of YAML files takes
    seconds (the check before training and the evaluation after it share it)."""
    return harness_class()()


def harness_class():
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("lm-evaluation-harness is not installed: `pip install lm-eval` (make install has it).") \
            from None  # fmt: skip
    return TaskManager


def check_run_folder(record: RunRecord, tasks: list[str]):
    """The run's folder as `toolkit eval` needs it: one it can write its results into, its exported model, and the
    tokenizer the run trained with (returned)."""
    from transformers import AutoTokenizer

    folder = record.folder
    fix = f"Copy the run somewhere writable (`cp -r {folder} COPY`) and evaluate the copy."
    for where in (folder, *([folder / EVAL_FOLDER] if REPLY_CHOICE in tasks else [])):
        check_writable(where, "`toolkit eval`'s results", fix)
    if (folder / EVAL_FILE).exists() and not os.access(folder / EVAL_FILE, os.W_OK):
        raise ConfigError(f"cannot write `toolkit eval`'s results to {folder / EVAL_FILE}: it is read-only. {fix}")
    check_export(folder)
    try:
        return AutoTokenizer.from_pretrained(folder)  # the one the run trained with, its chat template
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{folder}: the run's tokenizer does not load ({reason}): restore its tokenizer files "
                          "(tokenizer.json, tokenizer_config.json), or pass a finished run's --output_dir.") \
            from None  # fmt: skip
