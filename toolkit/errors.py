"""What the toolkit tells a user: an error for their mistake, a warning for what they should know.

Every mistake a user can make (a setting, a file, a launch, a budget) raises a `ToolkitError` subclass before
anything expensive happens; the recipe runner and every command turn it into one line, `error: <what is wrong,
and the fix>`, and exit code 2, without a traceback (TOOLKIT_DEBUG=1 adds it, for a bug report). In a
multi-process job every rank meets the same mistake, so rank 0 alone prints it; the other ranks wait a moment
before they exit, since the launcher kills the whole job when its first process ends and rank 0 must get to
say why (a mistake only one rank met is printed by that rank after the wait). Anything else that escapes is a
bug in the toolkit, and keeps its traceback.

Exit codes: 2 bad input (fix and relaunch); 3 the loss diverged (or GRPO's rewards judged nothing: stopping.py);
4 the budget is spent; 75 preempted (resume).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

USER_ERROR = 2  # exit code of a refused launch or command
DIVERGED = 3  # the loss became NaN or infinite, or GRPO's rewards judged nothing for steps in a row
BUDGET_SPENT = 4  # stopped with a checkpoint before passing --budget_usd
PREEMPTED = 75  # EX_TEMPFAIL, "try again": stopped with a checkpoint on one of PREEMPTION_SIGNALS
# A spot instance's notice, `kill`, a launcher shutting down (SIGTERM); SLURM's warning before the time limit
# (`#SBATCH --signal=USR1@...`).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Where a launcher's processes each say they wrote their preemption checkpoint (a file rank-<RANK>): the launcher
# exits 75 only where all of them did (distributed/launcher.py).
PREEMPTED_DIR = "TOOLKIT_PREEMPTED_DIR"
PEER_GRACE_S = 15.0  # how long a rank > 0 leaves rank 0 to report the mistake they share


class ToolkitError(Exception):
    """A user's mistake, found before it cost anything. The message names what is wrong and how to fix it."""

    exit_code = USER_ERROR


class ConfigError(ToolkitError, ValueError):
    """A bad recipe, override, flag or config file."""


class DataError(ToolkitError, ValueError):
    """A data set that does not fit the recipe: missing columns, unusable rows, no rows left, ..."""


def first_line(error: BaseException) -> str:
    """An exception's first line (at most 200 characters), for a message of ours that quotes it."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def say_preempted() -> None:
    """This process stopped on a preemption signal with its checkpoint written: told to its launcher."""
    folder = os.environ.get(PREEMPTED_DIR)
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}"), "w"):
            pass


def is_main_process() -> bool:
    """Rank 0 of the job (every process of a job sees the same RANK; a plain script has none)."""
    return os.environ.get("RANK", "0") == "0"


def debugging() -> bool:
    return os.environ.get("TOOLKIT_DEBUG", "").lower() in ("1", "true", "yes")


def warn(message: str, all_ranks: bool = False) -> None:
    """One `warning:` line on stderr, by rank 0 only unless `all_ranks` (e.g. a per-node concern), without the
    warnings module's source excerpt."""
    if all_ranks or is_main_process():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def report(error: Exception, label: str = "error") -> int:
    """Print `label: message` from rank 0 (every rank adds its traceback under TOOLKIT_DEBUG=1) and return the
    exit code the process should end with (`error.exit_code`: a ToolkitError's, or a stopped run's)."""
    if debugging():
        traceback.print_exception(error, file=sys.stderr)
    if is_main_process():
        print(f"{label}: {error}", file=sys.stderr, flush=True)
    elif isinstance(error, ToolkitError):  # rank 0 prints it and ends the job, unless it never meets it
        time.sleep(PEER_GRACE_S)
        print(f"{label} (rank {os.environ['RANK']}): {error}", file=sys.stderr, flush=True)
    return error.exit_code


def description(doc: str) -> str:
    """A command's --help description: its docstring's first paragraph, on one line (a first line ends mid-way)."""
    return " ".join(doc.split("\n\n")[0].split())


def command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A `python -m toolkit <command>` entry point whose user errors end as one line and SystemExit(2), as
    argparse ends its own."""

    @functools.wraps(main)
    def guarded(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except ToolkitError as error:
            raise SystemExit(report(error)) from None

    return guarded
