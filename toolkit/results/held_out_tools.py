"""A tool-using grpo run's held-out answers: each prompt offered the run's tools through the chat template, the
answer generated greedily and, where it calls a tool, the call run (with the run's time limit), its result
appended as a tool message and the answer continued, at most --max_tool_calls rounds, within the run's
--max_completion_length for all of it, tool results included: what GRPOTrainer's tool loop does when it samples,
without the sampling, with its template, end-of-turn ids, error results and length rules (Loop). Without it a
held-out answer would stop at its first call, its result never seen.

A run in an environment (--environment) plays each held-out row's episode as training does: the row's environment
reset with its columns (its text added to the prompt), its methods offered as tools beside --tools and run in the
episode's process, and its get_reward read at the end (training/environments.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from ..training.environment_checks import loaded_factories
from ..training.environments import tool_names


@dataclass
class Answer:
    """One held-out prompt's exchange so far: its ids (the prompt's, then the completion's), what was said."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # the completion's: the model's tokens and the tool results'
    messages: list[dict] = field(default_factory=list)  # the assistant's turns and the tool messages
    finished: bool = False  # the last turn ended on an end-of-turn token within the length
    calls: int = 0  # tool-calling rounds taken
    turn_calls: list | None = None  # the calls the last turn made, to run
    tools: list = field(default_factory=list)  # what the answer is offered: --tools and its environment's
    environment: object = None  # the episode's handle (environments.py), where the run has an environment
    scored: tuple | None = None  # once its episode ended: its environment's name and get_reward (end_episode)

    def end_episode(self) -> None:
        """The episode scored, where its class has a get_reward (TRL's reward named after the class), and its
        process and session ended."""
        handle, self.environment = self.environment, None
        if handle is not None:
            if hasattr(handle, "get_reward"):
                self.scored = (type(handle).__name__, handle.get_reward())
            handle._close()


def end_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer, as GRPOTrainer stops sampling: the generation config's end of sequence and the
    tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return eos if tokenizer.eos_token_id in eos else [tokenizer.eos_token_id, *eos]


@dataclass
class Loop:
    """What every round uses, set up as GRPOTrainer sets it up: the tools, the template it renders with (a
    prefix-preserving training copy where the tokenizer's own rewrites earlier turns, as Qwen3's does), the ids
    that end a turn (the generation config's and the tokenizer's end of sequence), and the run's limits."""

    tools: list  # --tools'
    template: str | None
    eos: list[int]
    budget: int  # --max_completion_length: the model's tokens and the tool results'
    rounds: int | None  # --max_tool_calls
    environments: object = None  # the run's environment factories (environment_checks.py), or None

    @classmethod
    def of(cls, model, tokenizer, policy) -> Loop:
        from trl.chat_template_utils import add_response_schema, get_training_chat_template
        from trl.chat_template_utils import is_chat_template_prefix_preserving as preserves

        from ..training.tools import tool_functions

        tools = tool_functions([t.strip() for t in (policy.tools or "").split(",") if t.strip()], policy.tool_timeout)
        environments = loaded_factories(policy) or None
        if not any(getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema")):
            add_response_schema(tokenizer)  # how TRL reads a call out of a turn, for the templates it knows
        preserving = preserves(tokenizer)
        return cls(tools, None if preserving else get_training_chat_template(tokenizer), end_ids(model, tokenizer),
                   policy.max_completion_length, policy.max_tool_calls, environments)  # fmt: skip

    def begin(self, tokenizer, prompt: list[dict], row: dict) -> Answer:
        """A held-out row's answer, its episode begun where the run has an environment (TRL's: the row's columns
        to reset, its text appended to the last user message, the environment's tools offered beside --tools)."""
        if self.environments is None:
            return Answer(self.render(tokenizer, prompt, True, self.tools), tools=self.tools)
        name = row.get("environment") if None not in self.environments else None
        handle = self.environments[name]()
        said = handle.reset(**({k: v for k, v in row.items() if k != "environment"} if name else row))
        if said is not None:
            content = prompt[-1]["content"]
            content = content + said if isinstance(content, str) == isinstance(said, str) else (
                [{"type": "text", "text": content}] if isinstance(content, str) else content) + (
                [{"type": "text", "text": said}] if isinstance(said, str) else said)  # fmt: skip
            prompt = prompt[:-1] + [{**prompt[-1], "content": content}]
        tools = self.tools + [getattr(handle, n) for n in tool_names(type(handle))]
        return Answer(self.render(tokenizer, prompt, True, tools), tools=tools, environment=handle)

    def render(self, tokenizer, messages: list[dict], generation_prompt: bool, tools: list) -> list[int]:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=True,
                                             add_generation_prompt=generation_prompt, return_dict=False)  # fmt: skip

    def suffix(self, tokenizer, tool_messages: list[dict], tools: list) -> list[int]:
        """The tokens that follow an assistant turn that called tools: the tool messages and the next assistant
        header, as the template renders them (the difference of two renders, cut at the assistant turn's end of
        sequence, as TRL cuts it)."""
        call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": call}]
        prefix = self.render(tokenizer, head, False, tools)
        full = self.render(tokenizer, head + tool_messages, True, tools)
        ends = [k for k, t in enumerate(prefix) if t == tokenizer.eos_token_id]
        prefix = prefix[: ends[-1] + 1] if ends else prefix
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template does not render a tool result after the assistant's turn it answers")
        return full[len(prefix) :]

    def run(self, calls: list[dict], tools: list) -> list[dict]:
        """The tool messages for an assistant turn's calls: each result, or the error a failed call gives, worded as
        TRL words it (the model reads it)."""
        by_name, out = {tool.__name__: tool for tool in tools}, []
        for call in calls:
            if call.get("type") != "function":
                name, result = call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}
            else:
                name = call["function"]["name"]
                try:
                    if name not in by_name:
                        raise ValueError(f"Tool {name} not found.")
                    result = by_name[name](**call["function"]["arguments"])
                except Exception as error:  # noqa: BLE001 - a failing tool is an answer's error result, as in training
                    result = {"error": str(error)}
            out.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
        return out


def answers_with_tools(model, tokenizer, rows, policy, batch_size: int) -> list[Answer]:
    """Each held-out row's greedy answer with the run's tools and environment (module docstring), `batch_size`
    rows at a time, each group's episodes ended and scored before the next begins: as many episodes live at once
    as training plays (an environment's server takes so many sessions, not one per held-out row)."""
    loop = Loop.of(model, tokenizer, policy)
    answers: list[Answer] = []
    group: list[Answer] = []
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues each row's last token
    try:
        for start in range(0, len(rows), batch_size):
            chunk = [rows[k] for k in range(start, min(start + batch_size, len(rows)))]
            group = active = [loop.begin(tokenizer, row["prompt"], row) for row in chunk]
            while active:
                continued(model, tokenizer, active, loop)
                active = [answer for answer in active if called(tokenizer, answer, loop)]
            for answer in group:
                answer.end_episode()
            answers += group
            print(f"  {len(answers)}/{len(rows)} held-out prompts answered (with tools)", file=sys.stderr, flush=True)
    finally:
        tokenizer.padding_side = side
        for answer in group:
            if answer.environment is not None:  # left playing by a failure
                answer.environment._close()
    return answers


def continued(model, tokenizer, group: list[Answer], loop: Loop) -> None:
    """The answers continued greedily to their next end of turn, within what is left of the length."""
    import torch
    from trl.chat_template_utils import parse_response

    contexts = [a.prompt_ids + a.ids for a in group]
    batch = tokenizer.pad({"input_ids": contexts}, padding=True, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=loop.eos,
                             max_new_tokens=max(loop.budget - len(a.ids) for a in group))  # fmt: skip
    for answer, context, row in zip(group, contexts, out[:, batch["input_ids"].shape[1] :].tolist(), strict=True):
        row = row[: loop.budget - len(answer.ids)]
        ends = next((k for k, t in enumerate(row) if t in loop.eos), None)
        said = row[: ends + 1] if ends is not None else row
        answer.finished = ends is not None
        answer.ids += said
        turn = parse_response(tokenizer, said, prefix=context, tools=answer.tools)
        answer.messages.append(turn)
        answer.turn_calls = turn.get("tool_calls") if answer.finished else None


def called(tokenizer, answer: Answer, loop: Loop) -> bool:
    """Whether the answer goes on: its last turn's calls run and their results appended, if it made any and rounds
    are left (--max_tool_calls). Results past the length are dropped and the answer ends as it stands (ended on its
    end of turn); results that fill it exactly are kept and the answer ends cut short: TRL's rules."""
    if not answer.turn_calls or (loop.rounds is not None and answer.calls >= loop.rounds):
        return False
    results = loop.run(answer.turn_calls, answer.tools)
    answer.calls += 1
    suffix = loop.suffix(tokenizer, results, answer.tools)
    if len(answer.ids) + len(suffix) > loop.budget:
        return False
    answer.ids += suffix
    answer.messages += results
    if len(answer.ids) == loop.budget:
        answer.finished = False
        return False
    return True
