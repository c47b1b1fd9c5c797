"""Paths in a job file: relative to the working directory the cluster runs in (this repository, synced by SkyPilot
or installed in the image), since this machine's absolute paths mean nothing there."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..errors import ConfigError


def portable(path: str, what: str) -> str:
    """`path` relative to the current directory, which the job's working directory mirrors; one line if outside."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        raise ConfigError(f"{what} {path} is outside {Path.cwd()}, which is what the job's nodes get: run from the "
                          "repository's root, with the file inside it.") from None  # fmt: skip


class BlockDumper(yaml.SafeDumper):
    """Multi-line strings (a run script) as YAML literal blocks, as a person writes them."""


BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def dump(documents: list[dict]) -> str:
    return yaml.dump_all(documents, Dumper=BlockDumper, sort_keys=False, width=120)
