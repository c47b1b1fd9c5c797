"""Checks of one setting's value, shared by the argument dataclasses (arguments.py, model_arguments.py): an optional
setting a command line unsets, a number's lower bound.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields

from ..errors import ConfigError

NULLS = ("none", "null", "")  # how a command line says "unset" for an optional setting


def optional_fields_unset(settings) -> None:
    """`--eval_split None`, `--chat_template ""`: an optional setting given as none/null/empty is unset (None),
    not a split or a template of that name."""
    for f in fields(settings):
        hint = typing.get_type_hints(type(settings)).get(f.name)
        optional = isinstance(hint, types.UnionType) and type(None) in hint.__args__
        value = getattr(settings, f.name)
        if optional and isinstance(value, str) and value.strip().lower() in NULLS:
            setattr(settings, f.name, None)


def at_least(name: str, value: float | None, low: float, fix: str = "") -> None:
    if value is not None and value < low:
        raise ConfigError(f"{name} must be at least {low:g}, got {value:g}{fix}.")
