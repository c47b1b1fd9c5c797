"""`python -m toolkit launch --on skypilot [--bucket URL] [--budget_usd X] [--deadline_hours H] ... recipes/X.py`:
a SkyPilot task whose resources are the plan's choice (planner/choose.py, as `toolkit plan --choose` prints it):
the cheapest GPU type SkyPilot can rent, count, nodes, config and micro-batch on which the recipe fits, within the
budget and the deadline; the config file, where given, fixes the strategy. `--gpu TYPE [--gpus N] [--nodes M]`
fixes the hardware instead.

Spot by default: `sky jobs launch` (a managed job) recovers from a preemption on new instances, and the recipe's
`--resume auto` continues from the newest checkpoint in the bucket (mounted at /checkpoints, written through a
local cache). The toolkit's own preemption exit (75, checkpoint written) is recovered too; the others (bad input,
diverged, budget spent) end the job. SkyPilot is not imported here: it is a client installed on its own
(`make install` puts one in .venv-skypilot; its click pin conflicts with huggingface_hub's), which parses the file.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import PREEMPTED, ConfigError
from ..metrics.cost import device_spec, price_table
from ..project import is_recipe, recipe_name
from .workdir import dump, node_launch, portable, resumable, write_job

NAME = "skypilot"
RUNS_HERE = False  # a task file: the cloud's machines load the model
MOUNT = "/checkpoints"
BUCKET = re.compile(r"^(s3|gs|r2|cos|oci|https)://[^/]+/?$")  # a bucket's root: SkyPilot mounts no sub-folder


def add_options(group) -> None:
    group.add_argument("--bucket", help="the checkpoint bucket's root (s3://NAME, gs://NAME, ...), mounted at "
                       f"{MOUNT} on every node")  # fmt: skip
    group.add_argument("--budget_usd", type=float, help="the most the run may cost on-demand (the plan's price)")
    group.add_argument("--deadline_hours", type=float, help="the longest it may take, wall clock")
    group.add_argument("--gpu_types", help="comma-separated GPU types to choose from (toolkit/metrics/hardware.yaml)")
    group.add_argument("--gpu", help="rent this GPU type rather than the plan's choice")
    group.add_argument("--gpus", type=int, default=8, help="with --gpu: GPUs a node (default 8)")
    group.add_argument("--nodes", type=int, default=1, help="with --gpu: nodes (default 1)")
    group.add_argument("--on_demand", action="store_true", help="on-demand instances instead of spot")
    group.add_argument("--output", help="the task file (default: <recipe>.sky.yaml)")


def accelerate_words(options, words: list[str]) -> list[str]:
    return words


def rentable() -> list[str]:
    """The price table's GPU types SkyPilot rents (those it names)."""
    return [name for name, d in price_table()["devices"].items() if d.get("skypilot")]


def sky_name(gpu: str) -> str:
    """SkyPilot's name for a price-table GPU type, or one line naming the types it can rent."""
    spec = device_spec(gpu, "a GPU type of toolkit/metrics/hardware.yaml")
    if not spec.get("skypilot"):
        raise ConfigError(f"--gpu {gpu}: SkyPilot names no such part to rent; pass one of {', '.join(rentable())}.")
    return spec["skypilot"]


def choice(args, options) -> dict:
    """The plan's choice for the recipe (and the config, where the launch names one); or the --gpu given."""
    from ..planner.choose import choose
    from ..planner.cli import check_flags, plan_parser, stdout_to_stderr

    config = Path(args.config_file).stem if args.config_file else None
    if options.gpu:
        if config is None:
            raise ConfigError("--gpu without --config_file: name the strategy too, or leave --gpu out for the plan's "
                              "choice of both.")  # fmt: skip
        sky_name(options.gpu)
        return {"gpu": options.gpu, "gpus": options.gpus, "nodes": options.nodes, "config": config,
                "micro_batch": None}  # fmt: skip
    recipe = recipe_name(args.training_script)
    if not is_recipe(recipe):
        raise ConfigError(f"{args.training_script} is not a recipe the planner can size: pass --gpu TYPE (with "
                          "--gpus, --nodes) and --config_file.")  # fmt: skip
    for name in (options.gpu_types or "").split(","):
        if name.strip():
            sky_name(name.strip())
    words = [recipe, "--choose", "--gpu_types", options.gpu_types or ",".join(rentable())]
    words += [w for flag in ("budget_usd", "deadline_hours") if getattr(options, flag) is not None
              for w in (f"--{flag}", str(getattr(options, flag)))]  # fmt: skip
    plan_args = plan_parser().parse_args(words)
    plan_args.model, plan_args.config = recipe, config
    check_flags(plan_args)
    with stdout_to_stderr():
        return choose(plan_args)


def run_script(args, picked: dict, name: str) -> str:
    """What each node runs: its `toolkit launch` from SkyPilot's node variables, the mesh sized by `toolkit mesh`;
    the config the launch named, else the plan's."""
    config = (
        portable(args.config_file, "--config_file")
        if args.config_file
        else f"accelerate_configs/{picked['config']}.yaml"
    )
    flags = list(args.training_script_args)
    if picked["micro_batch"] and not any(f.startswith("--per_device_train_batch_size") for f in flags):
        flags += ["--per_device_train_batch_size", str(picked["micro_batch"])]  # the plan's fitting micro-batch
    flags = resumable(["--output_dir", f"{MOUNT}/{name}", *flags])
    launch = node_launch(
        config,
        portable(args.training_script, "the script"),
        flags,
        "SKYPILOT_NUM_NODES",
        "SKYPILOT_NUM_GPUS_PER_NODE",
        '"$SKYPILOT_NODE_RANK"',
        '"$main_ip"',
        '"${MAIN_PORT:-29500}"',
    )
    return "\n".join(["set -e", 'main_ip=$(echo "$SKYPILOT_NODE_IPS" | head -n1)', launch, ""])


def task(args, options) -> tuple[dict, dict]:
    """The SkyPilot task, and the plan's choice it was written from."""
    if options.bucket is None:
        raise ConfigError(f"--on skypilot needs --bucket s3://NAME (or gs://...): the checkpoints live there, "
                          f"mounted at {MOUNT}, so a recovered job resumes from them.")  # fmt: skip
    if not BUCKET.match(options.bucket):
        raise ConfigError(f"--bucket {options.bucket}: pass the bucket's root (s3://NAME): SkyPilot mounts a whole "
                          "bucket; the run writes under <bucket>/<job name>/.")  # fmt: skip
    picked = choice(args, options)
    name = re.sub(r"[^a-z0-9-]+", "-", Path(args.training_script).stem.lower()).strip("-")
    resources = {"accelerators": f"{sky_name(picked['gpu'])}:{picked['gpus']}", "use_spot": not options.on_demand,
                 "job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": 0,
                                  "recover_on_exit_codes": [PREEMPTED]}}  # fmt: skip
    spec = {
        "name": name,
        "num_nodes": picked["nodes"],
        "resources": resources,
        "workdir": ".",  # this repository, synced to every node
        "file_mounts": {MOUNT: {"source": options.bucket, "mode": "MOUNT_CACHED"}},
        "secrets": {"HF_TOKEN": None},  # given at launch: --secret HF_TOKEN
        "setup": "make install",
        "run": run_script(args, picked, name),
    }
    return spec, picked


def launch(options, args) -> int:
    spec, picked = task(args, options)
    path = Path(options.output or f"{spec['name']}.sky.yaml")
    row = picked.get("row")
    spot = f", ${row['usd_spot']:,.2f} spot" if row and row.get("usd_spot") is not None else ""
    why = (f"the plan's choice: ${row['usd']:,.2f} on-demand{spot}, {picked['wall_hours']:,.1f} h at micro-batch "
           f"{picked['micro_batch']}" if row else "--gpu given")  # fmt: skip
    header = (f"# {spec['resources']['accelerators']} x {spec['num_nodes']} node(s), "
              f"accelerate_configs/{picked['config']}.yaml ({why}).\n"
              f"# Launch: sky jobs launch {path} --secret HF_TOKEN\n")  # fmt: skip
    write_job(path, header + dump([spec]))
    print(f"wrote {path}: {spec['resources']['accelerators']} x {spec['num_nodes']} node(s), "
          f"{picked['config']}.yaml, {'on-demand' if options.on_demand else 'spot'} ({why})")  # fmt: skip
    print(f"launch it with: sky jobs launch {path} --secret HF_TOKEN")
    return 0
