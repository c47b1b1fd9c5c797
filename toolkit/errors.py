"""What the toolkit tells a user: an error for their mistake, a warning for what they should know.

Every mistake a user can make (a setting, a file, a launch, a budget) raises a `ToolkitError` subclass before
anything expensive happens; the recipe runner and every command turn it into one line, `error: <what is wrong,
and the fix>`, and exit code 2, without a traceback. Anything else that escapes is a bug in the toolkit.
"""

from __future__ import annotations

import os
import sys

USER_ERROR = 2  # exit code of a refused launch or command


class ToolkitError(Exception):
    """A user's mistake, found before it cost anything. The message names what is wrong and how to fix it."""

    exit_code = USER_ERROR


class ConfigError(ToolkitError, ValueError):
    """A bad recipe, override, flag or config file."""


def is_main_process() -> bool:
    """Rank 0 of the job (every process of a job sees the same RANK; a plain script has none)."""
    return os.environ.get("RANK", "0") == "0"


def warn(message: str, all_ranks: bool = False) -> None:
    """One `warning:` line on stderr, by rank 0 only unless `all_ranks` (e.g. a per-node concern), without the
    warnings module's source excerpt."""
    if all_ranks or is_main_process():
        print(f"warning: {message}", file=sys.stderr, flush=True)
