"""Tool-using GRPO (--tools): the completions call the calculator through the chat template, TRL runs it and the
completion goes on with its result; a tool that raises, hangs or returns nonsense is an error result within its
time limit, never a hang; a tool whose schema cannot be read, a template that cannot show tool calls, or tools
under a task that runs none are one line. The tiny model cannot write a tool call by chance: a scripted sampler
writes what a model that learnt to would (a call, then the answer from the tool's result)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from conftest import logged
from qwen3_grpo_tools import RECIPE as TOOLS

from toolkit import train
from toolkit.errors import ConfigError
from toolkit.training.tools import calculator, tool_functions

NAME = "qwen3_grpo_tools"


def tool_flags(out: Path, *extra: str) -> list[str]:
    return ["--tiny", "--max_steps", "2", "--report_to", "none", "--save_strategy", "no", "--max_seq_length", "1536",
            "--max_completion_length", "384", "--output_dir", str(out), *extra]  # fmt: skip


def scripted(tool: str):
    """A sampler in place of TRL's generate: a prompt ending on the user's question gets a call of `tool` with the
    question's sum; one ending on a tool's result gets that result as the answer."""

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tokenizer = self.processing_class
        completions = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids)
            if "<tool_response>" in text:
                result = text.rpartition("<tool_response>")[2].partition("</tool_response>")[0].strip()
                number = re.findall(r"-?\d+", result)
                reply = f"The sum is {number[-1] if number else 'unknown'}.<|im_end|>"
            else:
                a, b = re.findall(r"What is (\d+) plus (\d+)\?", text)[-1]
                call = {"name": tool, "arguments": {"expression": f"{a} + {b}"}}
                reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"
            completions.append(tokenizer.encode(reply, add_special_tokens=False))
        return completions, None

    return generate


def test_completions_call_the_calculator_and_answer_from_its_result(tmp_path, monkeypatch):
    """Every completion calls the calculator once and answers with its result: each step's accuracy is 1 (the
    reward reads the final answer), no call failed, and the card says so."""
    from toolkit.training.rl import RecipeGRPOTrainer

    monkeypatch.setattr(RecipeGRPOTrainer, "_generate_single_turn", scripted("calculator"))
    out = tmp_path / "run"
    train(TOOLS, tool_flags(out), NAME)
    assert logged(out, "tools/call_frequency") == [1.0, 1.0]
    assert logged(out, "tools/failure_frequency") == [0.0, 0.0]
    assert logged(out, "rewards/accuracy/mean") == [1.0, 1.0]
    assert "| tools | calculator: 1 calls a completion, 0% of calls failed (the run's mean) |" in (
        out / "README.md").read_text()  # fmt: skip


def test_a_run_whose_completions_never_call_a_tool_says_so(tmp_path, monkeypatch):
    from toolkit.training.rl import RecipeGRPOTrainer

    def answers(self, prompt_ids, *args, **kwargs):
        return [self.processing_class.encode("4.<|im_end|>", add_special_tokens=False) for _ in prompt_ids], None

    monkeypatch.setattr(RecipeGRPOTrainer, "_generate_single_turn", answers)
    out = tmp_path / "run"
    train(TOOLS, tool_flags(out), NAME)
    assert logged(out, "tools/call_frequency") == [0.0, 0.0]
    assert "| tools | calculator: never called |" in (out / "README.md").read_text()


SLOW_TOOLS = '''
import time

def slow(expression: str) -> str:
    """Never answers.

    Args:
        expression: Anything.
    """
    time.sleep(600)
    return "late"

def opaque(expression: str) -> str:
    """Returns what is not text.

    Args:
        expression: Anything.
    """
    return object()

def untyped(expression):
    """No type hint."""
    return expression
'''


@pytest.mark.parametrize("tool", ["slow", "opaque"])
def test_a_tool_that_hangs_or_returns_nonsense_is_an_error_result_in_time(tool, tmp_path, monkeypatch):
    """The hanging tool is stopped at --tool_timeout, the nonsense one refused: each call fails (TRL's failure
    frequency 1) and the completion is scored as it stands; the run ends in seconds."""
    from toolkit.training.rl import RecipeGRPOTrainer

    (tmp_path / "tools.py").write_text(SLOW_TOOLS)
    spec = f"{tmp_path / 'tools.py'}:{tool}"
    monkeypatch.setattr(RecipeGRPOTrainer, "_generate_single_turn", scripted(tool))
    out = tmp_path / "run"
    start = time.perf_counter()
    train(TOOLS, tool_flags(out, "--tools", spec, "--tool_timeout", "0.5"), NAME)
    assert time.perf_counter() - start < 120
    assert logged(out, "tools/failure_frequency") == [1.0, 1.0]
    assert logged(out, "rewards/accuracy/mean") == [0.0, 0.0]


def test_the_calculator_computes_arithmetic_and_nothing_else():
    assert calculator("(12 + 7) * 3") == "57" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os').system('true')", "2 ** 100000", "x + 1", "[1, 2]"):
        with pytest.raises(ValueError):
            calculator(bad)
    (tool,) = tool_functions(["calculator"], 5.0)
    assert tool.__name__ == "calculator" and tool(expression="40 + 2") == "42"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tools", "{untyped}"], r"tool .*:untyped: its JSON schema cannot be read"),
        (["--tools", "abacus"], "tool 'abacus' is neither built in"),
        (["--chat_template", "llama3"], "--tools: the chat template cannot show a tool call and its result"),
        (["--task", "rloo"], "tools: TRL's RLOOTrainer runs no tools"),
        (["--tool_timeout", "0"], r"tool_timeout \(0\) must be positive"),
    ],
)
def test_tools_that_cannot_run_are_one_line(flags, message, tmp_path):
    (tmp_path / "tools.py").write_text(SLOW_TOOLS)
    flags = [f.format(untyped=f"{tmp_path / 'tools.py'}:untyped") for f in flags]
    with pytest.raises(ConfigError, match=message):
        train(TOOLS, tool_flags(tmp_path / "run", *flags), NAME)
