"""What a job file for a cluster holds, whatever the engine: paths relative to the working directory the cluster
runs in (this repository, synced by SkyPilot or installed in the image: this machine's absolute paths mean nothing
there), each node's `toolkit launch` from the scheduler's variables, resumable, and YAML a person can read."""

from __future__ import annotations

import shlex
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


def resumable(flags: list[str]) -> list[str]:
    """The recipe's flags with `--resume auto` unless a resume is named: a restarted job continues from the newest
    complete checkpoint (a first start finds none and starts fresh)."""
    if any(f == "--resume" or f.startswith("--resume=") for f in flags):
        return list(flags)
    return [*flags, "--resume", "auto"]


PYTHON = ".venv/bin/python"  # `make install`'s, in the working directory every engine runs the job in


def node_launch(config: str | None, script: str, flags: list[str], nodes: str, per_node: str, rank: str, addr: str,
                port: str) -> str:  # fmt: skip
    """One node's `toolkit launch` of a multi-node job, in bash: accelerate's machine flags from the scheduler's
    variables (`nodes`, `per_node`: variable names; `rank`, `addr`, `port`: shell words), the mesh sized for the
    job by `toolkit mesh`, as slurm/launch_node.sh does. Run by the working directory's venv (PYTHON): a container's
    or a VM's `python` is the image's, which has none of the toolkit's packages."""
    quoted = shlex.quote(config) if config else None
    mesh = f' $({PYTHON} -m toolkit mesh {quoted} --nodes "${nodes}" --gpus_per_node "${per_node}")' if config else ""
    return " \\\n  ".join([
        f"{PYTHON} -m toolkit launch" + (f" --config_file {quoted}" if config else ""),
        f'--num_machines "${nodes}" --num_processes "$(({nodes} * {per_node}))" --machine_rank {rank}',
        f"--main_process_ip {addr} --main_process_port {port}{mesh}",
        " ".join(shlex.quote(w) for w in [script, *flags]),
    ])  # fmt: skip


class BlockDumper(yaml.SafeDumper):
    """Multi-line strings (a run script) as YAML literal blocks, as a person writes them."""


BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def dump(documents: list[dict]) -> str:
    return yaml.dump_all(documents, Dumper=BlockDumper, sort_keys=False, width=120)


MARK = "# Written by `python -m toolkit launch`: it replaces this file when run again.\n"


def write_job(path: Path, text: str, flag: str = "--output") -> None:
    """The job file, marked as the writer's: a file there that it did not write (a manifest of the user's) is kept,
    and refused in one line, never replaced without a word."""
    if path.exists() and not path.read_text(errors="replace").startswith(MARK):
        raise ConfigError(f"{path} exists and was not written by `toolkit launch`: pass another {flag}, or move it "
                          "away.")  # fmt: skip
    path.write_text(MARK + text)
