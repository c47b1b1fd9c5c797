"""Weights & Biases: run naming, the resolved config, offline mode without an account, and reading back what
wandb wrote offline (for tests and for reports built without a network).
"""

from __future__ import annotations

import json
import netrc
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

SECRET = re.compile(r"token|api_key|apikey|secret|password", re.IGNORECASE)


def redact(value: Any) -> Any:
    """Mask every value whose key looks like a credential, at any depth."""
    if isinstance(value, dict):
        return {k: "<redacted>" if SECRET.search(str(k)) and v else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


def redact_argv(argv: list[str]) -> None:
    """Mask credential flags' values in place: wandb records sys.argv in every run's metadata."""
    for i, arg in enumerate(argv):
        flag, eq, _ = arg.partition("=")
        if flag.startswith("-") and SECRET.search(flag):
            if eq:
                argv[i] = f"{flag}=<redacted>"
            elif i + 1 < len(argv):
                argv[i + 1] = "<redacted>"


def redacted_command() -> str:
    """The command that ran this process, credentials masked: `python SCRIPT FLAGS`, or under a launcher `accelerate
    launch --config_file CONFIG --num_processes N SCRIPT FLAGS` (the config as `toolkit launch` names it)."""
    import shlex

    argv = list(sys.argv)
    redact_argv(argv)
    script = shlex.join(argv)
    world = os.environ.get("WORLD_SIZE")
    if not world:
        return f"python {script}"
    config = os.environ.get("TOOLKIT_CONFIG_FILE", "<the accelerate config>")
    return f"python -m toolkit launch --config_file {config} --num_processes {world} {script}"


def finish_run() -> None:
    """Flush and close the W&B run, so the process does not exit with it half-written."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


OFFLINE_NOTICE = (
    "W&B: no API key found, logging offline to ./wandb (upload later with `wandb sync wandb/offline-run-*`)."
)


def init_args(project: str, group: str, tags: list[str]) -> dict[str, Any]:
    """`wandb.init`'s project, group, tags and mode for this run (the user's WANDB_PROJECT, WANDB_RUN_GROUP,
    WANDB_TAGS and WANDB_MODE win), offline where there is no account and no WANDB_MODE. All passed: wandb reads its
    environment once per process, and a second run in it would get the first one's."""
    env_tags = [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",") if t.strip()]
    found = {"project": os.environ.get("WANDB_PROJECT") or project,
             "group": os.environ.get("WANDB_RUN_GROUP") or group, "tags": env_tags or tags}  # fmt: skip
    if os.environ.get("WANDB_MODE"):
        found["mode"] = os.environ["WANDB_MODE"]
    elif not has_api_key():
        found["mode"] = "offline"
    return found


def launch_environment() -> dict[str, str]:
    """What `accelerate launch` passed to this process: its view of the accelerate config."""
    prefixes = ("ACCELERATE_", "FSDP_", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return redact({k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)})


class WandbRun(TrainerCallback):
    """Starts this run's W&B run on rank 0, before WandbCallback (which then logs to the run it finds), with its
    project, group and tags passed to `wandb.init`: wandb reads its environment once per process, so a second
    run in the same process (a notebook, a sweep) would get the first one's. Then logs the whole resolved
    configuration once."""

    def __init__(self, init: dict[str, Any], config: dict[str, Any]):
        self.init, self.config = init, redact(config)

    def on_train_begin(self, args, state, control, **kwargs):
        import wandb

        if not state.is_world_process_zero:
            return
        if wandb.run is None:
            wandb.init(**self.init, name=args.run_name)  # no run_name: wandb's own
        wandb.config.update(self.config, allow_val_change=True)


def run_callback(run, recipe_name: str, tags: list[str], config: dict[str, Any], is_main: bool) -> WandbRun:
    """The callback that starts this run's W&B run (project, group = recipe, tags plus --wandb_tags; offline
    without an account) and logs its resolved `config`. `run`: the RunArguments. It goes before WandbCallback."""
    tags = [*tags, *(t.strip() for t in (run.wandb_tags or "").split(",") if t.strip())]
    init = init_args(run.wandb_project, run.wandb_group or recipe_name, tags)
    if init.get("mode") == "offline" and not os.environ.get("WANDB_MODE") and is_main:
        print(OFFLINE_NOTICE)
    return WandbRun(init, config)


# ------------------------------------------------------------------------------ reading an offline run
# A .wandb file: a 7-byte header (":W&B", uint16 magic, uint8 version), then 32 KiB blocks of LevelDB-log
# records (<crc u32><length u16><type u8> + data; FULL=1, FIRST=2, MIDDLE=3, LAST=4), each a protobuf Record.

BLOCK = 32 * 1024
HEADER = 7


def _records(data: bytes):
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # block trailer: padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        else:  # zero padding at the end of the file
            break


def read_offline_run(run_dir: str | Path) -> dict[str, Any]:
    """History rows, final summary, config, tags, group and alerts of an offline run folder (wandb/offline-run-*)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("*.wandb")
    out: dict[str, Any] = {"history": [], "summary": {}, "config": {}, "tags": [], "group": "", "alerts": []}
    for raw in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        which = record.WhichOneof("record_type")
        if which == "history":
            out["history"].append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif which == "summary":
            for item in record.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif which == "config":
            for item in record.config.update:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif which == "alert":
            out["alerts"].append({"title": record.alert.title, "text": record.alert.text})
        elif which == "run":
            out["tags"], out["group"] = list(record.run.tags), record.run.run_group
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return out
