"""The tools a GRPO run's completions may call (--tools): the built-in calculator by name, or a user's own
function as `module:function` or `path/file.py:function`, which TRL offers the model through the chat template
(its JSON schema read from the signature's type hints and the docstring's Args, by transformers) and runs when a
completion calls it, the result appended as a tool message and the completion continued (GRPOTrainer's tool loop,
at most --max_tool_calls rounds).

Each call runs in a process forked for it, with a time limit (--tool_timeout): a tool that hangs is killed there,
one whose process dies is reported at once with its exit code or signal, one that raises or returns what is not
text, a number, a list or a dict becomes an error result, and TRL scores the completion as it scores any (its
tools/failure_frequency counts them): never a hang, never the run's end. A fork a call: nothing a call leaves in
the process (a global, a cache, a connection) is there at the next; no CUDA in a tool (a CUDA context does not
survive a fork); a hundredth of a second to a few tenths a call, more as the training process grows (the fork
copies its page tables). An async tool (`async def`) is run to its result in that process, as TRL awaits one.

A dict or list result reaches the model as JSON (TRL would pass a list on as multimodal content blocks, which text
templates such as Qwen3's render as nothing, and a dict as Python's repr); text as it is; a number as str() writes
it. One line before any weights load: a tool whose schema cannot be read (no type hints, no docstring for an
argument), two tools of one name (TRL calls a tool by name: the later would answer for both), a chat template TRL
cannot show a call in, read a call out of, or keep earlier turns of (check_tool_template).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import multiprocessing
import operator
import signal
from collections.abc import Callable
from multiprocessing.connection import wait

from ..errors import ConfigError
from .rewards import user_function

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
             ast.UAdd: operator.pos}  # fmt: skip
RESULTS = (str, int, float, bool, list, dict)  # what a tool message can say (tool_text writes it)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


BUILT_IN_TOOLS = {"calculator": calculator}


def tool_text(result) -> str:
    """A tool's result as the tool message's text: a dict or list as JSON, as chat templates expect a tool's
    content (text); text as it is; a number as str() writes it, as TRL writes it. Anything else is an error."""
    if inspect.iscoroutine(result):  # an async tool's call: awaited here, as TRL's event loop would
        result = asyncio.run(result)
    if not isinstance(result, RESULTS):
        raise TypeError(f"returned {type(result).__name__}, not text, a number, a list or a dict")
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"returned a {type(result).__name__} that is not JSON ({error})") from None
    return result if isinstance(result, str) else str(result)


def ended(process) -> str:
    """How a tool's process ended, in words: its exit code, or the signal that killed it."""
    return exit_text(process.exitcode)


def exit_text(code: int | None) -> str:
    """An exit code in words (negative: the signal that killed the process, as multiprocessing writes it)."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_limited(function: Callable, seconds: float, kwargs: dict) -> str:
    """`function(**kwargs)` in a forked process, killed after `seconds`; its result as text (tool_text), or the
    error it raised; a process that dies before it answers is reported as it dies, not at the limit."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send(("ok", tool_text(function(**kwargs))))
        except BaseException as error:  # the tool's failure, reported to the parent as its result
            send.send(("error", f"{type(error).__name__}: {error}"))

    process = context.Process(target=child, daemon=True)
    process.start()
    try:
        ready = wait([receive, process.sentinel], timeout=seconds)
        if receive in ready or (ready and receive.poll()):  # a result, perhaps sent just before the process ended
            status, result = receive.recv()
        elif ready:
            process.join()
            raise RuntimeError(f"the tool's process died ({ended(process)}) before it answered")
        else:
            raise TimeoutError(f"no result within {seconds:g} s (--tool_timeout): stopped")
    finally:
        process.kill()
        process.join()
        receive.close()
        send.close()
    if status == "error":
        raise RuntimeError(result)
    return result


def limited(function: Callable, seconds: float) -> Callable:
    """The tool as TRL calls it, with its name, signature and docstring (its schema), run under the time limit."""

    @functools.wraps(function)
    def call(**kwargs):
        return run_limited(function, seconds, kwargs)

    return call


def tool_functions(specs: list[str], seconds: float) -> list[Callable]:
    """The recipe's tools, each schema read as transformers will (a missing type hint or argument description is
    one line now, not a traceback in the trainer), each wrapped in the time limit."""
    from transformers.utils import get_json_schema

    tools, named = [], {}
    for spec in specs:
        function = BUILT_IN_TOOLS.get(spec) or (user_function(spec, "tool") if ":" in spec else None)
        if function is None:
            raise ConfigError(f"tool {spec!r} is neither built in ({', '.join(BUILT_IN_TOOLS)}) nor module:function "
                              "or path/file.py:function.")  # fmt: skip
        try:
            get_json_schema(function)
        except Exception as error:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(f"tool {spec}: its JSON schema cannot be read ({' '.join(str(error).split())}): "
                              "give every argument a type hint and a line under Args: in the docstring, as TRL "
                              "asks (docs/rl.md).") from None  # fmt: skip
        if (name := function.__name__) in named:  # TRL keys the tools by name: the later would answer for both
            raise ConfigError(same_name(named[name], spec, name))
        named[name] = spec
        tools.append(limited(function, seconds))
    return tools


def check_tool_template(tokenizer, flag: str = "--tools") -> None:
    """What GRPOTrainer checks of the chat template when it is built (after the weights load), with TRL's own
    functions, before: that it renders a tool call and its result (supports_tool_calling), that TRL can parse a
    call out of a completion (add_response_schema: the templates TRL knows), and that it keeps earlier turns as
    they were or TRL has a training copy that does (is_chat_template_prefix_preserving, get_training_chat_template).
    TRL sets the parser on the tokenizer there as here (the same object, the same value)."""
    from transformers import ProcessorMixin
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    fix = "use the model's own template, or --chat_template trl:qwen3 (TRL ships the families' templates)"
    if not supports_tool_calling(tokenizer):
        raise ConfigError(f"{flag}: the chat template cannot show a tool call and its result (TRL renders "
                          f"user -> assistant with tool_calls -> tool to check): {fix}.")  # fmt: skip
    inner = tokenizer.tokenizer if isinstance(tokenizer, ProcessorMixin) else tokenizer
    if all(getattr(inner, name, None) is None for name in ("response_template", "response_schema")):
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise ConfigError(f"{flag}: TRL cannot read a tool call out of a completion in this chat template (its "
                              "parsers know the templates it ships, and this is none of them, nor does the "
                              f"tokenizer bring a response_template): {fix}.") from None  # fmt: skip
    if not is_chat_template_prefix_preserving(tokenizer):
        try:
            get_training_chat_template(tokenizer)
        except ValueError:
            raise ConfigError(f"{flag}: the chat template rewrites earlier turns as a conversation grows, and TRL has "
                              f"no training copy of it that does not (its tool loop appends results to a completion): "
                              f"{fix}.") from None  # fmt: skip


def same_name(first: str, second: str, name: str) -> str:
    """The line for two tools of one name, both offered: one named twice, a user's named like a built-in one, or
    two of one name."""
    if first == second:
        return f"tool {first} is named twice in --tools: name it once."
    if name in BUILT_IN_TOOLS and name in (first, second):
        mine = second if first == name else first
        return (f"tool {mine} is named {name}, like the built-in {name} that --tools also offers: the model would see "
                f"two tools of one name, and TRL would run only one: rename your function, or drop {name} from "
                "--tools.")  # fmt: skip
    return (f"tools {first} and {second} are both named {name}: TRL calls a tool by its name, so the later would "
            "answer every call of either: rename one, or offer one.")  # fmt: skip
