"""A GRPO run's environments (--environment) loaded and checked before any weights load, each in one line: the
class (`module:Class`, `path/file.py:Class`, or one built for an OpenEnv server's URL: served_environments.py),
its `reset`, its tools' schemas (transformers reads each from the signature's type hints and the docstring's Args,
as for --tools), a tool named like another the model is offered, a reward source (get_reward, or --reward_funcs),
the rows' `environment` names where several classes are named; then one trial episode on the first row, in its
own process: reset and get_reward must answer in time with what TRL can use. The factories TRL is given come out
(environments.py)."""

from __future__ import annotations

import inspect

from ..errors import ConfigError, DataError, warn
from .environments import Environment, EnvironmentFactory, EnvironmentFailure, tool_names
from .rewards import user_object
from .served_environments import is_served, served_class

TRIAL_ROWS = 1  # episodes tried before training: the first row's


def environment_factories(policy, rows, tool_names_offered: list[str]) -> EnvironmentFactory | dict | None:
    """TRL's environment_factory for the recipe's environments (one factory, or a dict by name), each checked and
    tried on its first row (module docstring); None without any."""
    factories = loaded_factories(policy)
    if not factories:
        return None
    for factory in factories.values():
        check_class(factory, tool_names_offered)
    if not policy.rewards() and not any(callable(getattr(f.cls, "get_reward", None)) for f in factories.values()):
        raise ConfigError(f"environment {policy.environment}: no reward: give the class a get_reward() that scores "
                          "the episode from its state, or pass --reward_funcs.")  # fmt: skip
    if None not in factories:
        check_rows(rows, factories)
    for name, factory in factories.items():
        first = next((row for row in rows if name is None or row.get("environment") == name), None)
        if first is not None:
            trial_episode(factory, first, multiple=None not in factories)
    return factories[None] if None in factories else factories


def loaded_factories(policy) -> dict[str | None, EnvironmentFactory]:
    """TRL's factory for each of the run's environments by name, its class loaded (or built from its server), not
    yet checked; {} for none."""
    timeout = policy.tool_timeout
    return {name: EnvironmentFactory(environment_class(spec, timeout), spec, timeout)
            for name, spec in named_environments(policy.environment).items()}  # fmt: skip


def named_environments(value: str | dict | None) -> dict[str | None, str]:
    """The environment classes by the name a row's `environment` column gives them (one class: None, TRL's key for
    every row): a recipe's dict, or `name=spec,...`; {} for none."""
    value = value or {}
    if isinstance(value, dict):
        return {str(name): str(spec) for name, spec in value.items()}
    if "=" not in value:
        return {None: value.strip()}
    named = [part.partition("=") for part in value.split(",") if part.strip()]
    if any(not name.strip() or not spec.strip() for name, _, spec in named):
        raise ConfigError(f"environment {value!r}: write one module:Class, or name=module:Class,... for rows that "
                          "pick theirs in an `environment` column.")  # fmt: skip
    return {name.strip(): spec.strip() for name, _, spec in named}


def environment_class(spec: str, timeout: float) -> type:
    """The class a spec names, or the one built for an environment served at a URL (served_environments.py)."""
    if is_served(spec):
        return served_class(spec, timeout)
    if ":" not in spec:
        raise ConfigError(f"environment {spec!r}: write module:Class or path/file.py:Class.")
    cls = user_object(spec, "environment")
    if not inspect.isclass(cls):
        where, _, name = spec.rpartition(":")
        said = f"has no class {name!r}" if cls is None else f"names {cls!r}, which is not a class"
        raise ConfigError(f"environment {spec}: {where} {said}: TRL builds each episode's environment from a class "
                          "whose public methods are the tools (docs/rl.md).")  # fmt: skip
    return cls


def check_class(factory: EnvironmentFactory, offered: list[str]) -> None:
    """What TRL asks of the class, and the schema of each tool (its public methods)."""
    from transformers.utils import get_json_schema

    cls, spec = factory.cls, factory.spec
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"environment {spec}: {cls.__name__} has no reset(): TRL calls it to begin each episode "
                          "(with the row's columns; text it returns is added to the prompt).")  # fmt: skip
    tools = tool_names(cls)
    if not tools:
        warn(f"environment {spec}: {cls.__name__} has no public method, so the model can call nothing and every "
             "episode is one turn.")  # fmt: skip
    for name in tools:
        try:
            get_json_schema(getattr(cls, name))
        except Exception as error:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(f"environment {spec}: tool {name}'s JSON schema cannot be read "
                              f"({' '.join(str(error).split())}): give every argument a type hint and a line under "
                              "Args: in the docstring, as TRL asks (docs/rl.md).") from None  # fmt: skip
        if name in offered:
            raise ConfigError(f"environment {spec}: tool {name} is also one of --tools: the model would see two tools "
                              "of one name and TRL would run one: rename one.")  # fmt: skip
    if set(dir(Environment)) & set(tools):
        clash = sorted(set(dir(Environment)) & set(tools))
        raise ConfigError(f"environment {spec}: method(s) {', '.join(clash)} are the toolkit's own names for an "
                          "episode's handle: rename them.")  # fmt: skip


def check_rows(rows, factories: dict) -> None:
    """Several environments: each row names its own in an `environment` column, one of theirs."""
    if "environment" not in rows.column_names:
        raise DataError(f"--environment names {len(factories)} environments ({', '.join(factories)}): each row picks "
                        "its own in an `environment` column, and this data has none: add it, or name one "
                        "class.")  # fmt: skip
    unknown = sorted({str(name) for name in rows["environment"]} - set(factories))
    if unknown:
        row = rows["environment"].index(next(n for n in rows["environment"] if str(n) in unknown))
        raise DataError(f"row {row}: environment {unknown[0]!r} is not among --environment's ({', '.join(factories)})"
                        f"{f'; nor are {unknown[1:]}' if len(unknown) > 1 else ''}: name it there, or fix the "
                        "column.")  # fmt: skip


def trial_episode(factory: EnvironmentFactory, row: dict, multiple: bool) -> None:
    """One episode on the first row, in its own process (reset, then get_reward if the class has one), on a
    throwaway instance: whatever fails is one line now, before the weights load and the first step is paid for."""
    handle = factory()
    kwargs = {k: v for k, v in row.items() if not (multiple and k == "environment")}  # TRL's reset kwargs
    try:
        handle.reset(**kwargs)
        if hasattr(handle, "get_reward"):
            handle.get_reward()
    except EnvironmentFailure as error:
        raise ConfigError(f"{error} (tried on the first row before training)") from None
    finally:
        handle._close()
        factory.seconds, factory.unscored = 0.0, 0  # training's own count
