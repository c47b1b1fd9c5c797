"""A tool-using grpo run's held-out answers: each prompt offered the run's tools through the chat template, the
answer generated greedily and, where it calls a tool, the call run (with the run's time limit), its result
appended as a tool message and the answer continued, at most --max_tool_calls rounds, within the run's
--max_completion_length for all of it, tool results included: what GRPOTrainer's tool loop does when it samples,
without the sampling. Without it a held-out answer would stop at its first call, its result never seen.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass
class Answer:
    """One held-out prompt's exchange so far: its ids (the prompt's, then the completion's), what was said."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # the completion's: the model's tokens and the tool results'
    messages: list[dict] = field(default_factory=list)  # the assistant's turns and the tool messages
    finished: bool = False  # the last turn ended on an end-of-turn token within the length
    calls: int = 0  # tool-calling rounds taken
    turn_calls: list | None = None  # the calls the last turn made, to run


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens that follow an assistant turn that called tools: the tool messages and the next assistant header,
    as the template renders them (the difference of two renders, cut at the assistant turn's end-of-turn token,
    as TRL cuts it)."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(head + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)  # fmt: skip
    ends = [k for k, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    prefix = prefix[: ends[-1] + 1] if ends else prefix
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template does not render a tool result after the assistant's turn it answers")
    return full[len(prefix) :]


def run_calls(calls: list[dict], tools: dict) -> list[dict]:
    """The tool messages for an assistant turn's calls: each result, or the error a failed call gives (TRL's)."""
    out = []
    for call in calls:
        name = call.get("function", {}).get("name", "unknown")
        try:
            result = tools[name](**call["function"]["arguments"])
        except Exception as error:  # noqa: BLE001 - a failing tool is an answer's error result, as in training
            result = {"error": str(error)}
        out.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
    return out


def answers_with_tools(model, tokenizer, prompts: list, policy, batch_size: int) -> list[Answer]:
    """Each prompt's greedy answer with the run's tools (module docstring)."""
    from trl.chat_template_utils import add_response_schema

    from ..training.tools import tool_functions

    tools = tool_functions([t.strip() for t in policy.tools.split(",") if t.strip()], policy.tool_timeout)
    add_response_schema(tokenizer)  # how TRL reads a call out of a turn, for the templates it knows
    answers = [Answer(tokenizer.apply_chat_template(p, tools=tools, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)) for p in prompts]  # fmt: skip
    active = list(range(len(answers)))
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues each row's last token
    try:
        while active:
            for start in range(0, len(active), batch_size):
                continued(model, tokenizer, [answers[k] for k in active[start : start + batch_size]], policy, tools)
            active = [k for k in active if called(tokenizer, answers[k], policy, tools)]
            print(f"  {len(answers) - len(active)}/{len(answers)} held-out prompts answered (with tools)",
                  file=sys.stderr, flush=True)  # fmt: skip
    finally:
        tokenizer.padding_side = side
    return answers


def continued(model, tokenizer, group: list[Answer], policy, tools: list) -> None:
    """The answers continued greedily to their next end of turn, within what is left of the length."""
    import torch
    from trl.chat_template_utils import parse_response

    budget = policy.max_completion_length
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    contexts = [a.prompt_ids + a.ids for a in group]
    batch = tokenizer.pad({"input_ids": contexts}, padding=True, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             max_new_tokens=max(budget - len(a.ids) for a in group))  # fmt: skip
    for answer, context, row in zip(group, contexts, out[:, batch["input_ids"].shape[1] :].tolist(), strict=True):
        row = row[: budget - len(answer.ids)]
        ends = next((k for k, t in enumerate(row) if t in eos), None)
        said = row[: ends + 1] if ends is not None else row
        answer.finished = ends is not None
        answer.ids += said
        turn = parse_response(tokenizer, said, prefix=context, tools=tools)
        answer.messages.append(turn)
        answer.turn_calls = turn.get("tool_calls") if answer.finished else None


def called(tokenizer, answer: Answer, policy, tools: list) -> bool:
    """Whether the answer goes on: its last turn's calls run and their results appended, if it made any, rounds
    are left (--max_tool_calls) and the results fit in the length with room to answer."""
    if not answer.turn_calls or (policy.max_tool_calls is not None and answer.calls >= policy.max_tool_calls):
        return False
    results = run_calls(answer.turn_calls, {tool.__name__: tool for tool in tools})
    answer.calls += 1
    suffix = tool_suffix_ids(tokenizer, results)
    if len(answer.ids) + len(suffix) >= policy.max_completion_length:  # TRL drops such a result: the answer ends
        answer.finished = False
        return False
    answer.ids += suffix
    answer.messages += results
    return True
