"""GRPO's rewards (task grpo): the built-in ones by name, a user's own as `module:function` or
`path/file.py:function`, or a reward model's folder; each function checked on every call.

A reward is TRL's: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`, one value per
completion (None: no opinion, left out of that completion's sum), the data set's other columns passed by name.
The built-in ones:
  accuracy  1 if the completion's answer is right: its last match of --answer_pattern, scored by reasoning-gym's
            own checker for its problems (a `reasoning_gym` column), else by math-verify against the `answer`
            column (numbers, fractions, LaTeX); 0 otherwise
  format    1 if the whole completion matches --format_pattern, else 0
  length    1 - tokens / --max_completion_length: the shorter, the better (a brevity bonus beside accuracy)
A function that raises, returns the wrong count or a non-number ends the run with one line naming it (its last
checkpoint kept); `check_rewards` calls each once on the first prompts before any weights load, and refuses rewards
that all return None there (no opinion on anything: nothing to learn from). Steps where they all do during training
are counted by stopping.py's SafeStop.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import re
from collections.abc import Callable
from functools import cache
from numbers import Real
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ToolkitError, warn
from ..settings.policy import PolicyArguments


class RewardError(ToolkitError, RuntimeError):
    """A reward function that failed during training: its name and what it did."""


def text_of(completion: Any) -> str:
    """A completion's text: TRL passes text, or for conversational prompts a list of the answer's messages: the
    assistant's, not a tool's result (a number the model never said is not its answer)."""
    if isinstance(completion, list):
        return "\n".join(
            str(m.get("content") or "") for m in completion if isinstance(m, dict) and m.get("role") != "tool"
        )  # turns apart: "12" then "34" is not 1234
    return str(completion)


def last_match(pattern: str, text: str) -> str | None:
    """The last match of `pattern` in `text` (its first group, if it has one)."""
    found = list(re.finditer(pattern, text))
    if not found:
        return None
    match = found[-1]
    return (match.group(1) if match.re.groups else match.group(0)).strip()


@cache
def reasoning_gym_checker(task: str) -> Callable:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def accuracy_reward(pattern: str) -> Callable:
    def accuracy(prompts, completions, completion_ids=None, answer=None, reasoning_gym=None, **_) -> list[float]:
        if answer is None and reasoning_gym is None:
            raise ValueError("it scores against the data set's `answer` column (the gold answer), which this data "
                             "set lacks: add one, or use a reward of your own")  # fmt: skip
        out = []
        for k, completion in enumerate(completions):
            given = last_match(pattern, text_of(completion))
            if given is None:
                out.append(0.0)
            elif reasoning_gym is not None:
                problem = json.loads(reasoning_gym[k])
                out.append(float(reasoning_gym_checker(problem["task"])(given.replace(",", ""), problem["entry"])))
            else:  # the gold answer's own last match: GSM8K's "... #### 72"
                out.append(verified(last_match(pattern, str(answer[k])) or str(answer[k]), given))
        return out

    return accuracy


def verified(gold: str, given: str) -> float:
    """math-verify's judgement of an answer against the gold one (numbers, fractions, LaTeX), or the two texts
    equal where it is not installed."""
    if importlib.util.find_spec("math_verify") is None:
        return float(gold.strip() == given.strip())
    from math_verify import parse, verify

    return float(verify(parse(gold), parse(given)))


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, **_) -> list[float]:  # noqa: A001 - the reward's name in the logs
        return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]

    return format


def length_reward(max_tokens: int) -> Callable:
    def length(prompts, completions, completion_ids, **_) -> list[float]:
        return [1.0 - len(ids) / max_tokens for ids in completion_ids]

    return length


def built_in(name: str, policy: PolicyArguments) -> Callable | None:
    if name == "accuracy":
        return accuracy_reward(policy.answer_pattern)
    if name == "format":
        if not policy.format_pattern:
            raise ConfigError("the format reward matches each completion against --format_pattern: set it, e.g. "
                              "--format_pattern '<think>.*</think>\\s*<answer>.*</answer>'.")  # fmt: skip
        return format_reward(policy.format_pattern)
    if name == "length":
        return length_reward(policy.max_completion_length)
    return None


def user_function(spec: str, what: str = "reward") -> Callable:
    """`module:function` (importable) or `path/file.py:function`; `what` names it in the errors."""
    function = user_object(spec, what)
    if not callable(function):
        where, _, name = spec.rpartition(":")
        raise ConfigError(f"{what} {spec}: {where or 'it'} has no function '{name}' (write module:function or "
                          "path/file.py:function).")  # fmt: skip
    return function


def user_object(spec: str, what: str):
    """What `module:name` or `path/file.py:name` names (None if the module has no such name)."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise ConfigError(f"{what} {spec}: {where} does not exist.")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as error:  # the user's module: any error in it is theirs to see, in one line
        raise ConfigError(f"{what} {spec}: importing {where} failed: {type(error).__name__}: {error}") from None
    return getattr(module, name, None)


def reward_functions(policy: PolicyArguments) -> list[Callable | str]:
    """The recipe's rewards, in order: checked callables, or a reward model's folder (TRL loads it as a
    one-label sequence classifier, e.g. a model the classification task trained)."""
    out: list[Callable | str] = []
    models = policy.reward_models()
    for spec in policy.rewards():
        function = built_in(spec, policy)
        if function is None and ":" in spec:
            function = user_function(spec)
        if function is None:
            if Path(spec).expanduser() in models:
                out.append(reward_model(Path(spec).expanduser()))
                continue
            raise ConfigError(f"reward '{spec}' is neither a built-in one (accuracy, format, length), a "
                              "module:function, a path/file.py:function nor a reward model's folder.")  # fmt: skip
        out.append(Checked(function, spec))
    return out


def reward_model(folder: Path) -> str:
    """A reward model's folder, checked before anything loads: TRL scores a completion by the single output of a
    sequence classifier (num_labels 1, what TRL's RewardTrainer trains) through the folder's own tokenizer. A
    language model's folder would get a fresh, random score head; a classifier of several classes would not load."""
    config = json.loads((folder / "config.json").read_text())
    architectures = config.get("architectures") or ["none"]
    labels = len(config.get("id2label") or {0: 0, 1: 1})  # transformers' default: 2
    if not architectures[0].endswith("ForSequenceClassification") or labels != 1:
        found = f"a {architectures[0]}" + (f" with {labels} labels" if "Classification" in architectures[0] else "")
        raise ConfigError(f"reward model {folder}: {found}, where TRL scores completions by a sequence classifier's "
                          "single output (num_labels 1): name a reward model trained so, e.g. by TRL's "
                          "RewardTrainer on preference pairs.")  # fmt: skip
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"reward model {folder} has no tokenizer, which TRL reads the completions with: save it "
                          "there (tokenizer.save_pretrained(folder)).")  # fmt: skip
    return str(folder)


def chat_template_in(folder: Path) -> bool:
    """Whether a saved tokenizer carries a chat template (transformers 5 writes chat_template.jinja; older ones a
    key of tokenizer_config.json)."""
    config = folder / "tokenizer_config.json"
    return (folder / "chat_template.jinja").is_file() or (
        config.is_file() and bool(json.loads(config.read_text()).get("chat_template")))  # fmt: skip


# What TRL passes every reward beside the data's columns (GRPOTrainer._calculate_rewards), for the calls the toolkit
# makes itself: the first prompts before training, the held-out answers after it.
OUTSIDE_TRAINING = {"trainer_state": None, "log_extra": lambda column, values: None,
                    "log_metric": lambda name, value: None}  # fmt: skip


class Checked:
    """A reward function whose every answer is checked: a list of one number (or None) per completion."""

    def __init__(self, function: Callable, spec: str) -> None:
        self.function, self.spec = function, spec
        self.__name__ = spec.rpartition(":")[2] or spec  # TRL's name for it in the logs: rewards/<name>/mean

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float | None]:
        columns = {**OUTSIDE_TRAINING, **columns}  # TRL's own arguments, stood in for before and after training
        try:
            values = self.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            if inspect.isawaitable(values):  # an async reward: awaited here (TRL calls this wrapper as a plain one)
                values = asyncio.run(values)
        except Exception as error:  # the user's code: one line naming it, not a traceback from inside TRL
            raise RewardError(f"reward {self.spec} raised {type(error).__name__}: {error}") from None
        return self.checked(values, len(prompts))

    def checked(self, values: Any, expected: int) -> list[float | None]:
        if not isinstance(values, (list, tuple)) or len(values) != expected:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward {self.spec} returned {got} for {expected} completions: return a list of one "
                              "number (or None) per completion.")  # fmt: skip
        for value in values:
            if value is not None and (not isinstance(value, Real) or math.isnan(value)):
                raise RewardError(f"reward {self.spec} returned {value!r} ({type(value).__name__}): each reward "
                                  "must be a number (or None for no opinion).")  # fmt: skip
        return [None if v is None else float(v) for v in values]


def check_rewards(functions: list[Callable | str], rows: list[dict[str, Any]]) -> None:
    """Each reward called once on the first prompts, each answered with its own `answer` (or nothing), before any
    weights load: a function that cannot run on these columns fails now, in one line, not after the first step; so
    do rewards that all return None for every one of them (one such beside a reward that judges is a warning)."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    prompts = [row["prompt"] for row in rows]
    completions = [[{"role": "assistant", "content": str(row.get("answer", ""))}] if isinstance(row["prompt"], list)
                   else str(row.get("answer", "")) for row in rows]  # fmt: skip
    silent = []  # the functions that returned None for every probed completion
    for function in functions:
        if isinstance(function, str) and isinstance(prompts[0], list) and not chat_template_in(Path(function)):
            raise ConfigError(f"reward model {function}: its tokenizer has no chat template, which TRL formats these "
                              "conversations with before scoring them: save the template it was trained with "
                              "beside it (tokenizer.save_pretrained(folder)).")  # fmt: skip
        if isinstance(function, Checked):
            try:
                values = function(prompts, completions, [[0] for _ in rows], **columns)
            except RewardError as error:
                raise ConfigError(f"{error} (called on the first {len(rows)} prompts before training)") from None
            if all(v is None for v in values):
                silent.append(function.spec)
    if not silent:
        return
    named = (f"reward{'s' if len(silent) > 1 else ''} {', '.join(silent)} returned None for all {len(rows)} probed "
             "completions (the first prompts, answered with their own `answer`)")  # fmt: skip
    if len(silent) == len(functions):
        # TRL gives a completion no reward judged no advantage: every step would train on nothing, loss 0, silently
        raise ConfigError(f"{named}: no reward has an opinion on any of them, so there is nothing to learn from. "
                          "Return a number for the completions it can judge (None only for those it "
                          "cannot).")  # fmt: skip
    # Beside a reward that judges them, None is legitimate (TRL sums the weighted rewards with nansum): a word only.
    warn(f"{named}: only the other rewards score them; check it judges the completions it should.")
