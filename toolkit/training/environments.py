"""The environments a GRPO run's episodes play in (--environment), as TRL's GRPOTrainer takes them
(`environment_factory`): the class's public methods are the tools the model may call, `reset(**row)` begins an
episode (text it returns is appended to the row's last user message), and `get_reward()`, where the class has
one, scores the episode at its end from the environment's state (a reward beside --reward_funcs, weight 1, named
after the class). A completion that calls a tool gets its result back and goes on, at most --max_tool_calls rounds
(TRL's tool loop): an episode is its turns.

Each episode plays in a process of its own, forked at its `reset` from the class's one instance (built once:
"construct once, reset often", as TRL asks) by a small process that holds it (episode_processes.py), so nothing an
episode does to the instance, a class attribute or a module's global is seen by the next, however the environment
resets. A class whose constructor opens a socket (TRL's OpenEnv examples connect their client there) is built in
each episode's process instead: one connection, one session, shared by every fork, would mix the episodes'
states. Every call has a time limit (--tool_timeout). A tool that raises, hangs, dies or returns what is not text
is an error result the model reads and TRL counts (tools/failure_frequency), as for --tools (tools.py); a hung or
dead episode's later calls are error results, and its reward None (unscored: TRL leaves it out of the sum, and the
run says how many, never a silent zero). `reset` or `get_reward` that fails ends the run in one line: an episode
that cannot begin, or cannot be scored, is the environment's bug.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
import typing
from collections.abc import Callable

from ..errors import ToolkitError, warn
from .episode_processes import Episode, Spawner

HOOKS = ("reset", "get_reward")  # TRL's names: every other public method is a tool


class EnvironmentFailure(ToolkitError):
    """An environment whose episode could not begin or be scored: its reset or get_reward raised, hung, died or
    returned what TRL cannot use."""


def tool_names(cls: type) -> list[str]:
    """The class's tools, as TRL lists them: its public functions other than reset and get_reward."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in HOOKS]  # fmt: skip


def observation(value):
    """What reset may return (TRL appends it to the last user message): nothing, text, or content blocks."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, dict) and "type" in part for part in value):
        return value
    raise TypeError(f"returned {type(value).__name__}, not text, None or a list of content blocks")


def reward(value):
    """What get_reward may return: a number (TRL sums it with the other rewards) or None (not scored)."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise TypeError(f"returned {value!r}, not a number or None")
    return float(value)


SHAPES: dict[str, Callable] = {"reset": observation, "get_reward": reward}


def sockets() -> set[str]:
    """This process's open sockets (Linux; elsewhere none are seen)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    links = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
    return {link for link in links if link.startswith("socket:")}


class EnvironmentFactory:
    """TRL's environment_factory for one class: each call a new Environment (a handle TRL pools and resets), every
    episode forked from the one instance of the class; the time its episodes took (`seconds`, the profile's
    `environment` phase through `phase`) and the episodes a stop left unscored (`unscored`)."""

    def __init__(self, cls: type, spec: str, seconds: float) -> None:
        self.cls, self.spec, self.timeout = cls, spec, seconds
        self.instance, self.spawner = None, None
        self.seconds, self.unscored = 0.0, 0
        self.phase: Callable[[str], typing.ContextManager] = lambda name: contextlib.nullcontext()
        self.handle = handle_class(cls)

    def __call__(self):
        return self.handle(self)

    def episode(self) -> Episode:
        """A new episode's process, forked by the spawner from what the class's episodes start from: its one
        instance, built at the first episode; or the class itself (each episode's process builds its own) if
        building it opened a socket."""
        if self.spawner is None:
            before = sockets()
            try:
                instance = self.cls()
            except Exception as error:
                raise EnvironmentFailure(f"environment {self.spec}: {self.cls.__name__}() raised "
                                         f"{type(error).__name__}: {error}") from None  # fmt: skip
            self.instance = self.cls if sockets() - before else instance
            self.spawner = Spawner(self.instance, SHAPES)
        return Episode(self.spawner)

    def close(self) -> None:
        """The spawner ended, and with it any episode still playing (a next episode starts another)."""
        if self.spawner is not None:
            self.spawner.close()
            self.spawner = None

    def timed(self, episode: Episode, name: str, kwargs: dict):
        start = time.perf_counter()
        try:
            with self.phase("environment"):
                return episode.call(name, kwargs, self.timeout)
        finally:
            self.seconds += time.perf_counter() - start


class Environment:
    """The handle TRL holds for an episode: reset forks a new episode (the last one's process stopped); each tool
    and get_reward is called in it (handle_class gives the class the user's tools, by name and schema)."""

    def __init__(self, factory: EnvironmentFactory) -> None:
        self.factory, self.episode, self.last_reward = factory, None, None

    def reset(self, **row):
        if self.episode is not None:
            self.episode.stop()
        self.episode, self.last_reward = None, None
        try:
            self.episode = self.factory.episode()
            return self.factory.timed(self.episode, "reset", row)
        except (RuntimeError, TimeoutError) as error:
            raise EnvironmentFailure(f"environment {self.factory.spec}: reset failed, so the episode cannot begin: "
                                     f"{error}") from None  # fmt: skip

    def _reward(self):
        """get_reward, where the class has one: the episode's score, or None if the episode was stopped early (a
        tool hung or its process died: counted in `unscored`, said once at the end)."""
        if self.episode is None or self.episode.stopped:
            self.factory.unscored += 1
            return None
        try:
            self.last_reward = self.factory.timed(self.episode, "get_reward", {})
        except (RuntimeError, TimeoutError) as error:
            raise EnvironmentFailure(f"environment {self.factory.spec}: get_reward failed, so the episode cannot be "
                                     f"scored: {error}") from None  # fmt: skip
        return self.last_reward

    def _tool(self, name: str, kwargs: dict):
        if self.episode is None:
            raise RuntimeError("the episode has not begun (reset was not called)")
        return self.factory.timed(self.episode, name, kwargs)

    def _close(self) -> None:  # private: TRL takes every public method for a tool
        if self.episode is not None:
            self.episode.stop()


def tool_method(name: str, function: Callable) -> Callable:
    """A tool of the handle: the user's method's name, signature, type hints and docstring (the schema TRL and
    transformers read), its call forwarded to the episode's process."""

    def method(self, **kwargs):
        return self._tool(name, kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = function.__doc__
    method.__signature__ = inspect.signature(function)
    method.__annotations__ = typing.get_type_hints(function)  # resolved here: the user's module, not this one
    return method


def handle_class(cls: type) -> type:
    """Environment under the user's class's name (TRL names the get_reward column after it) with its tools, and
    get_reward only where the class has one (TRL looks for it on the class)."""
    namespace = {name: tool_method(name, getattr(cls, name)) for name in tool_names(cls)}
    if callable(getattr(cls, "get_reward", None)):
        namespace["get_reward"] = Environment._reward
    return type(cls.__name__, (Environment,), {**namespace, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def report_unscored(factories: dict) -> None:
    """Once, at the run's end: the episodes a stopped environment left unscored."""
    for factory in factories.values():
        if factory.unscored:
            warn(f"environment {factory.spec}: {factory.unscored} episode(s) were stopped (a tool call hung or its "
                 "process died) and left unscored (TRL leaves them out of the reward); the samples and "
                 "tools/failure_frequency show which.")  # fmt: skip
