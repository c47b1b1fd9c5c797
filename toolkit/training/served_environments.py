"""Environments served in OpenEnv's protocol (`--environment http://host:port`, openenv-core's servers): the
class TRL is given is built from what the server says of itself, so an environment running behind a URL (a
container, a Hugging Face Space, a process of its own) trains as a class of the user's does (environments.py).

OpenEnv serves each WebSocket session at /ws as an episode with an environment of its own: a `reset` message
begins it (the row's columns are sent; the server passes on those its reset takes), each `step` message is an
action, and every answer is the observation, its reward and whether the episode is done. An MCP environment lists
its tools (a `list_tools` step) and runs one per `call_tool` step: each becomes a method of the class, with the
tool's name, description and argument schema (what TRL and transformers read from a user's method). Any other
environment takes one kind of action, whose fields /schema describes: one tool, `step`. `get_reward` is the
episode's return, the sum of the rewards its answers carried (0 if none did); a call after the server said done
is an error result, and so is a tool's error (MCP's `error`), both counted as TRL counts a tool's failures. A
session lost mid-episode (the server gone) leaves the episode unscorable: the run ends in one line.

Each episode opens its session in its own process (environments.py forks them), so two episodes never share one.
The protocol is spoken here with `websockets`: openenv-core's own client comes with the server's FastAPI, Gradio
and MCP server, which training does not need (`make install` puts openenv-core in .venv-openenv, where the tests
serve environments from).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import urllib.request

from ..errors import ConfigError

SCHEMES = ("http://", "https://", "ws://", "wss://")
TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}
RESERVED = ("metadata", "type")  # an action's fields the protocol fills, not the model


def is_served(spec: str) -> bool:
    return spec.startswith(SCHEMES)


def http_url(url: str) -> str:
    return url.rstrip("/").replace("ws://", "http://", 1).replace("wss://", "https://", 1)


class Session:
    """One WebSocket session with the server: one episode."""

    def __init__(self, url: str, timeout: float) -> None:
        from websockets.sync.client import connect

        address = http_url(url).replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        self.exits = contextlib.ExitStack()  # entered as a context, as websockets 17 asks, and as earlier ones allow
        self.socket = self.exits.enter_context(connect(f"{address}/ws", open_timeout=timeout, max_size=2**27))

    def ask(self, kind: str, data: dict | None = None) -> dict:
        from websockets.exceptions import ConnectionClosed

        with contextlib.suppress(ConnectionClosed):  # the server said why and closed (it is full): read why below
            self.socket.send(json.dumps({"type": kind} if data is None else {"type": kind, "data": data}))
        answer = json.loads(self.socket.recv())
        if answer.get("type") == "error":
            detail = answer.get("data", {})
            full = (": it serves fewer sessions at once than the episodes this run plays at once (its "
                    "max_concurrent_envs; a step's rollouts on each process): raise it") * (
                    detail.get("code") == "CAPACITY_REACHED")  # fmt: skip
            said = str(detail.get("message")).rstrip(".")
            raise RuntimeError(f"the server answered {detail.get('code', 'an error')}: {said}{full}")
        return answer.get("data", {})

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the server or the connection may be gone already
            self.socket.send(json.dumps({"type": "close"}))
            self.socket.recv(timeout=5)  # until the server closes its end: its handler fails if this end goes first
        self.exits.close()


def text(observation: dict) -> str | None:
    """What the model reads of an observation: an MCP tool's text content; else the observation's own fields (all
    but done, reward and metadata): one text field as it is, several as JSON; None if it has none."""
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        return "\n".join(part.get("text", "") for part in result["content"] if part.get("type") == "text")
    fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    if not fields:
        return None
    only = next(iter(fields.values()))
    return only if len(fields) == 1 and isinstance(only, str) else json.dumps(fields)


class ServedEpisode:
    """An episode of the served environment (served_class adds the tools, by the server's names)."""

    url, timeout = "", 10.0

    def __init__(self) -> None:  # no connection here: the episode's process opens its own at reset
        self.session, self.rewards, self.done, self.lost = None, [], True, ""  # done until reset begins an episode

    def reset(self, **row):
        if self.session is not None:
            self.session.close()
        self.session, self.rewards, self.lost = Session(self.url, self.timeout), [], ""
        answer = self.session.ask("reset", json.loads(json.dumps(row, default=str)))  # JSON, whatever the columns
        self._note(answer)
        return text(answer.get("observation") or {})

    def get_reward(self) -> float:
        """The episode's return: the sum of the rewards its answers carried (0 if none did: an episode the
        environment did not reward, as the in-process shop scores one never answered). Asked at the episode's end
        (TRL's last call), it closes the session as the server expects. An episode whose session was lost cannot
        be scored: that raises, and the run ends in one line (the server is gone for the next episode too)."""
        if self.lost:
            raise RuntimeError(f"the session with the server was lost mid-episode ({self.lost})")
        if self.session is not None:
            self.session.close()
            self.session, self.done = None, True
        return float(sum(self.rewards))

    def _note(self, answer: dict) -> None:
        if answer.get("reward") is not None:
            self.rewards.append(float(answer["reward"]))
        self.done = bool(answer.get("done"))

    def _act(self, action: dict) -> str | None:
        from websockets.exceptions import WebSocketException

        if self.done:
            raise RuntimeError("the episode has ended (the environment said done, or it was scored): no more calls")
        try:
            answer = self.session.ask("step", action)
        except (OSError, WebSocketException) as error:
            self.lost, self.done = f"{type(error).__name__}: {error}", True
            raise RuntimeError(f"the session with the server was lost: {self.lost}") from None
        self._note(answer)
        observation = answer.get("observation") or {}
        if observation.get("error"):  # an MCP tool's failure: the model reads it, TRL counts it
            error = observation["error"]
            raise RuntimeError(error.get("message", error) if isinstance(error, dict) else error)
        return text(observation)


def tool(name: str, description: str, schema: dict, action) -> object:
    """A method named `name` whose signature, type hints and docstring (Google style, an Args line per argument)
    say what `schema` (JSON schema) says, as transformers' get_json_schema reads them; its call sends
    action(arguments) as a step."""
    properties, required = schema.get("properties", {}), set(schema.get("required", ()))
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations, lines = {}, []
    for field, spec in properties.items():
        kind = TYPES.get(spec.get("type"), str)
        items = TYPES.get(spec.get("items", {}).get("type")) if kind is list else None
        annotations[field] = list[items] if items else kind
        default = inspect.Parameter.empty if field in required else None
        parameters.append(inspect.Parameter(field, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=annotations[field]))  # fmt: skip
        said = " ".join(str(spec.get("description") or spec.get("title") or field).split())
        choices = f" (choices: {json.dumps(spec['enum'])})" if "enum" in spec else ""
        lines.append(f"    {field}: {said}{choices}")

    def method(self, **arguments):
        return self._act(action(arguments))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (description or name).strip() + ("\n\nArgs:\n" + "\n".join(lines) if lines else "")
    method.__signature__ = inspect.Signature(parameters, return_annotation=str)  # what the model reads is text
    method.__annotations__ = {**annotations, "return": str}
    return method


def fetch(url: str, path: str, timeout: float) -> dict:
    with urllib.request.urlopen(f"{http_url(url)}{path}", timeout=timeout) as answer:
        return json.loads(answer.read())


def listed_tools(url: str, name: str, timeout: float) -> list[dict]:
    """An MCP environment's tools, as a session's `list_tools` step answers them."""
    from websockets.exceptions import WebSocketException

    try:
        session = Session(url, timeout)
        try:
            return session.ask("step", {"type": "list_tools"}).get("observation", {}).get("tools") or []
        finally:
            session.close()
    except (RuntimeError, OSError, WebSocketException) as error:
        raise ConfigError(f"environment {url}: {name} takes MCP's tool calls but did not list its tools ({error})"
                          ": see the server's log.") from None  # fmt: skip


def served_class(url: str, timeout: float) -> type:
    """The class TRL is given for the environment served at `url`: named after the server's environment, a tool per
    MCP tool it lists (or one, `step`, taking its action's fields). One line if no OpenEnv server answers there."""
    try:
        name = fetch(url, "/metadata", timeout).get("name") or "ServedEnvironment"
        action = fetch(url, "/schema", timeout).get("action", {})
    except (OSError, ValueError) as error:  # URLError is an OSError
        said = getattr(error, "reason", None) or error  # urllib's wrapper says less than its reason
        raise ConfigError(f"environment {url}: no OpenEnv server answers there ({said}): start it (docs/rl.md, "
                          "environments served over HTTP) or correct the URL.") from None  # fmt: skip
    if "tool_name" in action.get("properties", {}):  # an MCP environment: its action is MCP's CallToolAction
        tools = {t["name"]: tool(t["name"], t.get("description", ""), t.get("input_schema") or {},
                                 lambda arguments, t=t: {"type": "call_tool", "tool_name": t["name"],
                                                         "arguments": arguments})
                 for t in listed_tools(url, name, timeout)}  # fmt: skip
    else:  # one kind of action: its fields are the arguments of one tool
        fields = {k: v for k, v in action.get("properties", {}).items() if k not in RESERVED}
        schema = {"properties": fields, "required": [k for k in action.get("required", ()) if k in fields]}
        tools = {"step": tool("step", action.get("description", ""), schema, lambda arguments: arguments)}
    clash = sorted(set(tools) & {"reset", "get_reward"})
    if clash:
        raise ConfigError(f"environment {url}: its tool(s) {', '.join(clash)} are TRL's names for an episode's "
                          "beginning and score: rename them on the server.")  # fmt: skip
    return type(name, (ServedEpisode,), {**tools, "url": url, "timeout": timeout, "__doc__": f"{name} at {url}"})
