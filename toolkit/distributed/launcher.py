"""`python -m toolkit launch [accelerate launch options] recipes/X.py [recipe flags]`: accelerate's launcher, with
the strategy file checked first, and a failed run ending on its own message and exit code.

`accelerate launch` re-raises a failed rank as a traceback of its own (`CalledProcessError` with one process,
torch's `ChildFailedError` with several) below the toolkit's one-line error, and exits 1 whatever the rank's
exit code was, so 2 (bad input), 3 (diverged), 4 (budget spent) and 75 (preempted, try again) all look alike to
a scheduler. This calls the same launcher, accelerate's `launch_command`, with the same options and config
files, then ends with the first failed rank's exit code and nothing more (TOOLKIT_DEBUG=1: the traceback too).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..errors import ConfigError, command, debugging
from ..project import is_recipe, recipe_names


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


@command
def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .launch_check import check

    parser = launch_command_parser()
    parser.prog = "python -m toolkit launch"
    args = parser.parse_args(argv)
    script = Path(args.training_script)
    recipe = script.stem if script.parent.name == "recipes" else None  # check() names the known recipes
    if recipe is None and not script.is_file():
        raise ConfigError(f"No script {script}: pass a recipe (recipes/<name>.py) or your own training script.")
    if args.config_file:
        check(args.config_file, recipe)  # a bad file is one line here, not a traceback from every rank
    elif recipe is not None and not is_recipe(recipe):
        raise ConfigError(f"No recipe '{recipe}' in recipes/. Known: {', '.join(recipe_names())}.")
    try:
        launch_command(args)
    except subprocess.CalledProcessError as failed:  # one process: the script's own exit code
        if debugging():
            raise
        return exit_code(failed.returncode)
    except ChildFailedError as failed:  # several: the first rank that failed, the others were stopped for it
        if debugging():
            raise
        return exit_code(failed.get_first_failure()[1].exitcode) or 1
    except SignalException as signalled:  # the launcher itself was signalled; the ranks got it too
        return 128 + int(signalled.sigval)
    return 0
