"""The tools a GRPO run's completions may call (--tools): the built-in calculator by name, or a user's own
function as `module:function` or `path/file.py:function`, which TRL offers the model through the chat template
(its JSON schema read from the signature's type hints and the docstring's Args, by transformers) and runs when a
completion calls it, the result appended as a tool message and the completion continued (GRPOTrainer's tool loop,
at most --max_tool_calls rounds).

Each call runs in a forked process with a time limit (--tool_timeout): a tool that hangs is killed there, one that
raises or returns what is not text, a number, a list or a dict becomes an error result, and TRL scores the
completion as it scores any (its tools/failure_frequency counts them): never a hang, never the run's end. A tool
whose schema cannot be read (no type hints, no docstring for an argument) is one line before any weights load.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
import operator
from collections.abc import Callable

from ..errors import ConfigError
from .rewards import user_function

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
             ast.UAdd: operator.pos}  # fmt: skip
RESULTS = (str, int, float, bool, list, dict)  # what a tool message can say (TRL writes str(result))


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


def run_limited(function: Callable, seconds: float, kwargs: dict):
    """`function(**kwargs)` in a forked process, killed after `seconds`; its result, or the error it raised."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            result = function(**kwargs)
            if not isinstance(result, RESULTS):
                raise TypeError(f"returned {type(result).__name__}, not text, a number, a list or a dict")
            send.send(("ok", result))
        except BaseException as error:  # the tool's failure, reported to the parent as its result
            send.send(("error", f"{type(error).__name__}: {error}"))

    process = context.Process(target=child, daemon=True)
    process.start()
    try:
        if not receive.poll(seconds):
            raise TimeoutError(f"no result within {seconds:g} s (--tool_timeout): stopped")
        status, result = receive.recv()
    finally:
        process.kill()
        process.join()
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

    tools = []
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
        tools.append(limited(function, seconds))
    return tools
