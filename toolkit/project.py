"""The project's own files: recipes in `recipes/`, strategy files in `accelerate_configs/` and `ds_configs/`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import uuid
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RECIPES = PROJECT_ROOT / "recipes"
STRATEGIES = PROJECT_ROOT / "accelerate_configs"


def cache_root() -> Path:
    """Where the toolkit keeps what it builds once and reuses: tiny models, converted packaged assets."""
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "finetune-recipes"))


def aside(path: Path, suffix: str = "tmp") -> Path:
    """Where to write `path` before renaming it into place, beside it and this writer's alone: the cache is shared
    by every node of a job (NFS, a shared volume), where another machine's process can have this one's PID."""
    return path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.{suffix}")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.py"))


def is_recipe(name: str) -> bool:
    return (RECIPES / f"{name}.py").is_file()


def recipe_name(given: str) -> str:
    """A recipe as a command names it: `llama3_fft`, or the file's path as a launch names it (recipes/llama3_fft.py);
    anything else (a Hub id, a folder, an unknown name) as given, for the caller to judge."""
    path = Path(given)
    if path.suffix != ".py" or not is_recipe(path.stem):
        return given
    shipped = path.resolve() == (RECIPES / path.name).resolve() or path.parts[-2:] == ("recipes", path.name)
    return path.stem if shipped else given


def recipe_writing(path: str | Path) -> str | None:
    """The recipe whose run writes `path` (its default output folder, runs/<recipe>, or the merged model in it),
    if any: a DPO recipe starts from an SFT recipe's output."""
    parts = Path(path).parts
    parts = parts[:-1] if parts[-1:] == ("merged",) else parts
    return parts[-1] if len(parts) >= 2 and parts[-2] == "runs" and is_recipe(parts[-1]) else None


def strategy_files() -> list[Path]:
    return sorted(STRATEGIES.glob("*.yaml"))


def project_path(name: str | Path) -> Path:
    """A path as given if it exists from here, else relative to the project (configs name each other that way)."""
    path = Path(name)
    return path if path.exists() else PROJECT_ROOT / path


def load_recipe(name: str) -> dict[str, Any]:
    """The RECIPE dict of recipes/<name>.py, imported without running it (recipes import each other). A file that
    does not import, or defines no RECIPE dict, is one error line naming the file and the line."""
    from .errors import ConfigError

    path = RECIPES / f"{name}.py"
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))  # llama3_lora builds on llama3_fft
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # importing a recipe imports the toolkit: keep --json clean
            spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ConfigError(f"{path} does not import: {error.msg} (line {error.lineno}): fix the recipe file.") from None
    except Exception as error:  # noqa: BLE001 - whatever a user's recipe file raises as it imports
        raise ConfigError(f"{path} does not import: {type(error).__name__}: {error}: fix the recipe file.") from None
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path} defines no RECIPE dict: a recipe is `RECIPE = dict(model_name_or_path=..., "
                          "task=..., ...)` and `run(RECIPE)` under `if __name__ == \"__main__\"`.")  # fmt: skip
    return recipe


# ----------------------------------------------------------------------- paths a user names

PACKAGE_PREFIX = "package:"  # a model or data set shipped inside an installed package (data/sources.py)
REASONING_GYM_PREFIX = "reasoning_gym:"  # problems reasoning-gym generates, with its checker (data/packaged.py)


def looks_like_path(name: str) -> bool:
    """A local path, not a Hub id ("org/name"): it starts like one, or has more than one '/'."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).suffix in (".json",
           ".jsonl", ".csv", ".parquet")  # fmt: skip


def check_local_path(name: str, what: str, flag: str, inside: str | None = None) -> None:
    """A setting that names a local path (not a Hub id, not a package: path) must exist, with `inside` in it."""
    from .errors import ConfigError

    if name.startswith(PACKAGE_PREFIX) or not looks_like_path(name):
        return
    path = Path(name).expanduser()
    if not path.exists():
        recipe, made_by = recipe_writing(path), ""
        if recipe and path.name == "merged":
            made_by = (
                f"it is recipes/{recipe}.py's model merged with its adapter (make finetune MODEL={recipe} "
                "ARGS='--use_lora true --merge_lora true' makes it); or "
            )
        elif recipe:
            made_by = f"it is recipes/{recipe}.py's output (make finetune MODEL={recipe} makes it); or "
        raise ConfigError(f"The {what} path {name} does not exist: {made_by}pass an existing path with {flag}, or a "
                          "Hub id (org/name).")  # fmt: skip
    if inside and path.is_dir() and not (path / inside).is_file():
        raise ConfigError(f"{name} has no {inside}: pass a folder written by save_pretrained with {flag}.")
