"""`python -m toolkit launch [--on ray|kubernetes|skypilot ...] [accelerate launch options] recipes/X.py [flags]`.

Without `--on`: accelerate's launcher on this machine (distributed/launcher.py). With it, the same command line,
checked the same way first (strategy file, recipe, model), runs or is written for another engine:
- `--on ray`: each rank a worker of a Ray Train TorchTrainer, here or on a running cluster (ray_train.py);
- `--on kubernetes`: a Kubeflow Trainer TrainJob manifest, applied with `--submit` (kubernetes.py);
- `--on skypilot`: a SkyPilot task on the cheapest GPUs the planner fits the recipe on (skypilot.py).
Their own options come before the script, beside accelerate's.
"""

from __future__ import annotations

import argparse
import sys

from ..distributed import launcher
from ..errors import ConfigError, command
from . import kubernetes, ray_train

ENGINES = {"ray": ray_train, "kubernetes": kubernetes}


def split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's words, and the script with its own flags (the first word naming a .py file on)."""
    for i, word in enumerate(argv):
        if not word.startswith("-") and word.endswith(".py"):
            return argv[:i], argv[i:]
    return argv, []


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m toolkit launch", add_help=False, allow_abbrev=False)
    parser.add_argument("--on", choices=sorted(ENGINES))
    for engine in ENGINES.values():
        engine.add_options(parser.add_argument_group(f"--on {engine.NAME}"))
    return parser


@command
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words, script = split_script(argv)
    if "--on" not in words and not any(w.startswith("--on=") for w in words):
        return launcher.main(argv)
    options, rest = engine_parser().parse_known_args(words)
    engine = ENGINES[options.on]
    given = {action.dest for action in engine_parser()._actions if getattr(options, action.dest) != action.default}
    stray = sorted(given - {"on"} - set(engine.OPTIONS))
    if stray:
        raise ConfigError(f"--{stray[0]} is not an option of --on {options.on} (its own: "
                          f"{', '.join('--' + o for o in engine.OPTIONS)}).")  # fmt: skip
    rest = engine.accelerate_words(options, rest)
    args = launcher.checked_args(rest + script, here=engine.RUNS_HERE)
    return engine.launch(options, args)
