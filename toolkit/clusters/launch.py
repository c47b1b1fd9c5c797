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
from ..errors import ConfigError, command, description
from . import kubernetes, ray_train, skypilot

ENGINES = {"ray": ray_train, "kubernetes": kubernetes, "skypilot": skypilot}
SUMMARIES = {  # `launch --help`'s line for each
    "ray": "each rank a Ray Train worker, on a local cluster or a running one (--address)",
    "kubernetes": "writes a Kubeflow Trainer TrainJob and its TrainingRuntime (--submit applies them)",
    "skypilot": "writes a SkyPilot task on the plan's cheapest fitting GPUs, checkpoints in a bucket",
}


def split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's words, and the script with its own flags (the first word naming a .py file on)."""
    for i, word in enumerate(argv):
        if not word.startswith("-") and word.endswith(".py"):
            return argv[:i], argv[i:]
    return argv, []


def help_text(engine=None) -> str:
    """`launch --help`: accelerate's options and the engines; `launch --on ENGINE --help`: that engine's own."""
    if engine is None:
        from accelerate.commands.launch import launch_command_parser

        parser = launch_command_parser()
        parser.prog = "python -m toolkit launch"
        engines = "\n".join(f"  --on {name:<12}{text}" for name, text in SUMMARIES.items())
        # after accelerate's own help, whose formatter shows only its own option groups
        return (f"{parser.format_help()}\nengines beyond this machine (before the script; `python -m toolkit launch "
                f"--on ENGINE --help` lists its options):\n{engines}\n")  # fmt: skip
    parser = engine_parser(engine)
    parser.usage = f"{parser.prog} [its options] [accelerate launch options] SCRIPT [script flags]"
    parser.description = description(engine.__doc__)
    parser.epilog = "accelerate launch's options: python -m toolkit launch --help"
    return parser.format_help()


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
    if "-h" in words or "--help" in words:  # before the script: the launch's help, not the recipe's
        print(help_text(picked.on and ENGINES[picked.on]))
        return 0
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
