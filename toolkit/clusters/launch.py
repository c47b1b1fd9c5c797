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
from . import kubernetes, ray_train, skypilot

ENGINES = {"ray": ray_train, "kubernetes": kubernetes, "skypilot": skypilot}


def split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's words, and the script with its own flags (the first word naming a .py file on)."""
    for i, word in enumerate(argv):
        if not word.startswith("-") and word.endswith(".py"):
            return argv[:i], argv[i:]
    return argv, []


def engine_parser(engine) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m toolkit launch --on {engine.NAME}", add_help=False,
                                     allow_abbrev=False)  # fmt: skip
    engine.add_options(parser)
    return parser


@command
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words, script = split_script(argv)
    chooser = argparse.ArgumentParser(prog="python -m toolkit launch", add_help=False, allow_abbrev=False)
    chooser.add_argument("--on", choices=sorted(ENGINES))
    picked, words = chooser.parse_known_args(words)
    if picked.on is None:
        return launcher.main(argv)
    engine = ENGINES[picked.on]
    options, rest = engine_parser(engine).parse_known_args(words)
    for other in ENGINES.values():  # another engine's option: say so, rather than accelerate's "unrecognized"
        for action in engine_parser(other)._actions:
            if other is not engine and set(action.option_strings) & {w.partition("=")[0] for w in rest}:
                raise ConfigError(f"{action.option_strings[0]} is not an option of --on {engine.NAME} (it is "
                                  f"--on {other.NAME}'s).")  # fmt: skip
    rest = engine.accelerate_words(options, rest)
    args = launcher.checked_args(rest + script, here=engine.RUNS_HERE)
    return engine.launch(options, args)
