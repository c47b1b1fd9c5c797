"""The gate every patch passes: the library version it was tested with, and the signatures of what it touches.

A `Reliance` is a set of another library's private functions, methods or attributes the toolkit relies on,
as they were when tested: the version window `[low, high)` and each target's parameter names. A `Patch` is a
reliance that replaces one of them; it installs only while nothing has changed, and otherwise warns once and
leaves the library alone (TRL's `_compat.py` does the same for its patches).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from packaging.version import Version

from ...errors import warn


@dataclass(frozen=True)
class Target:
    """`module:Qualified.name`, and its parameter names when tested (empty: an attribute that must exist)."""

    path: str
    parameters: tuple[str, ...] = ()

    def resolve(self):
        module, _, qualified = self.path.partition(":")
        obj = importlib.import_module(module)
        for part in qualified.split("."):
            obj = getattr(obj, part)
        return obj

    def mismatch(self) -> str | None:
        """What changed since it was tested, or None."""
        try:
            obj = self.resolve()
        except (ImportError, AttributeError):
            return f"{self.path} no longer exists"
        if not self.parameters:
            return None
        found = tuple(inspect.signature(obj).parameters)
        if found != self.parameters:
            return f"{self.path} now takes ({', '.join(found)}), tested with ({', '.join(self.parameters)})"
        return None


@dataclass(frozen=True)
class Reliance:
    name: str
    library: str  # the distribution: "accelerate", "transformers"
    versions: tuple[str, str]  # tested from versions[0] up to, not including, versions[1]
    targets: tuple[Target, ...]

    @property
    def installed(self) -> str:
        return importlib.metadata.version(self.library)

    def in_window(self) -> bool:
        low, high = (Version(v) for v in self.versions)
        return low <= Version(self.installed) < high

    def changed(self) -> str | None:
        """The first target that is not as tested, or None."""
        return next((m for m in (t.mismatch() for t in self.targets) if m), None)

    def problem(self) -> str | None:
        """Why this reliance may no longer hold here (a version outside the window, a changed target), or None."""
        if not self.in_window():
            return (f"{self.library} {self.installed} is outside the versions {self.name} was tested with "
                    f"({self.versions[0]} up to {self.versions[1]})")  # fmt: skip
        return self.changed()


_warned: set[str] = set()


def warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warn(message)


@dataclass(frozen=True)
class Patch(Reliance):
    """Replaces `targets[0]` (the others are what the replacement reads or calls) when `needed()`."""

    needed: Callable[[], bool]
    install: Callable[[], None]
    without: str  # what a launch gets while the patch stands aside
    delete_when: str  # the upstream change that makes the patch unnecessary

    def apply(self) -> bool:
        """Install the patch if this launch needs it and the library is as tested; True if installed."""
        if not self.needed():
            return False
        problem = self.problem()
        if problem:
            low, high = self.versions
            warn_once(self.name, f"{problem}: not applying the toolkit's {self.name} patch, so {self.without}. "
                      f"Re-test it with this version and widen its window in toolkit/distributed/patches/"
                      f"{self.name}.py, or install {self.library}>={low},<{high}.")  # fmt: skip
            return False
        self.install()
        return True
