"""The package's layout stays as the README draws it: rooms in the order a run goes through them, each importing
only the rooms below it (no import circle, between modules or between rooms), no room holding more than a quarter
of the code, and one `training_step` in the package, whose docstring gives the order of the per-step work."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "toolkit"
# Bottom to top: a room may import the rooms before it, never one after it.
ROOMS = ["startup", "errors", "project", "outputs", "settings", "metrics", "data", "models", "planner", "distributed",
         "training", "results", "checks", "runner", "clusters", "generate", "shipping", "__main__",
         "__init__"]  # fmt: skip
# What a reader holds at once (issue 66): a module, a class, a function or method, in lines from its first to last.
MOST_LINES = {"module": 400, "class": 150, "function": 80}


def modules() -> dict[str, Path]:
    """toolkit's modules by dotted name (a package by its own name)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(found: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other toolkit modules, wherever they are in the file (inside functions and
    TYPE_CHECKING blocks too: a deferred import is still an arrow)."""
    graph = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                for alias in node.names:
                    candidate = f"{module}.{alias.name}"
                    targets.add(candidate if candidate in found else module)
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        graph[name] = {t for t in targets if t in found and t != name}
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_between_modules():
    graph = imports(modules())
    package_inits = {name for name, path in modules().items() if path.name == "__init__.py"}
    # A package's __init__ re-exporting its modules is not a circle of theirs (planner/__init__.py does).
    graph = {name: {t for t in targets if t not in package_inits} for name, targets in graph.items()}
    assert circles(graph) == []


def test_each_room_imports_only_the_rooms_below_it():
    upward = defaultdict(set)
    for module, targets in imports(modules()).items():
        for target in targets:
            if ROOMS.index(room(target)) > ROOMS.index(room(module)):
                upward[module].add(target)
    assert dict(upward) == {}


def test_every_room_is_in_the_order():
    assert {room(module) for module in modules()} <= set(ROOMS)


def test_no_room_holds_more_than_a_quarter_of_the_code():
    lines = defaultdict(int)
    for module, path in modules().items():
        lines[room(module)] += len(path.read_text().splitlines())
    biggest = max(lines, key=lines.get)
    assert lines[biggest] / sum(lines.values()) <= 0.25, f"{biggest}: {dict(lines)}"


def test_no_unit_is_longer_than_a_reader_holds():
    """No module, class or function of the package past MOST_LINES: a unit that grows past them is split by
    concern (the trainer's overrides into mixins, a plan's assembly apart from its rendering)."""
    longer = []
    for module, path in modules().items():
        text = path.read_text()
        if (lines := len(text.splitlines())) > MOST_LINES["module"]:
            longer.append((module, lines))
        for node in ast.walk(ast.parse(text)):
            kind = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}.get(
                type(node)
            )
            if kind and (lines := node.end_lineno - node.lineno + 1) > MOST_LINES[kind]:
                longer.append((f"{module}.{node.name}", lines))
    assert longer == []


def test_the_runs_checks_are_one_list():
    """The checks a run passes before its data and weights are checks.py's ordered lists: the runner calls none of
    the rooms' check functions itself (a new one goes into the list, not into the runner)."""
    import toolkit.checks as checks

    called = set()
    for node in ast.walk(ast.parse((PACKAGE / "runner.py").read_text())):
        if isinstance(node, ast.Call):
            called.add(getattr(node.func, "id", None) or getattr(node.func, "attr", None))
    assert {name for name in called if name and name.startswith("check_")} == set()
    assert {"run_checks"} <= called and all(callable(c) for c in (*checks.LAUNCH, *checks.MODEL, *checks.DATA))


def test_one_training_step_and_its_order_written_down():
    import toolkit.training.trainer as trainer

    defined = [path for path in PACKAGE.rglob("*.py") if "def training_step(" in path.read_text()]
    assert [p.relative_to(PACKAGE).as_posix() for p in defined] == ["training/trainer.py"]
    doc = trainer.__doc__
    steps = ["RankReports.record", "RunTracker.count_batch", "model_inputs", "the Trainer's step", "SafeStop.note_loss"]
    positions = [doc.index(step) for step in steps]
    assert positions == sorted(positions)


@pytest.mark.parametrize(
    "name", ["data", "models", "settings", "training", "planner", "metrics", "distributed", "results"]
)
def test_each_room_says_what_it_holds(name):
    assert (PACKAGE / name / "__init__.py").read_text().strip().startswith('"""')
