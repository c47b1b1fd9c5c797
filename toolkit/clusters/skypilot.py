"""`python -m toolkit launch --on skypilot [--bucket URL] [--budget_usd X] [--deadline_hours H] ... recipes/X.py`:
a SkyPilot task whose resources are the plan's choice (planner/choose.py, as `toolkit plan --choose` prints it):
the cheapest GPU type SkyPilot can rent for the task, count, nodes, config and micro-batch on which the recipe
fits, within the budget and the deadline; the config file, where given, fixes the strategy. `--gpu TYPE [--gpus
N] [--nodes M]` fixes the hardware instead. The task names the clouds that rent the type and can mount the bucket
(and run several nodes, and spot, where asked: sky_clouds.py); a type rented on none of them is not chosen.

Spot by default: `sky jobs launch` (a managed job) recovers from a preemption on new instances, and the recipe's
`--resume auto` continues from the newest checkpoint in the bucket (mounted at /checkpoints, written through a
local cache). The toolkit's own preemption exit (75, checkpoint written) is recovered too; the others (bad input,
diverged, budget spent) end the job. Each node's setup is `make install-node` (the .venv a training run needs,
none of the dev environment); its run calls that venv's python. SkyPilot is not imported here: it is a client
installed on its own (`make install` puts one in .venv-skypilot; its click pin conflicts with huggingface_hub's),
which parses the file.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import PREEMPTED, ConfigError
from ..metrics.cost import device_spec, price_table
from ..project import is_recipe, recipe_name
from .sky_clouds import WHY, able, fixes, needs, why_not
from .workdir import dump, node_launch, portable, resumable, write_job

NAME = "skypilot"
RUNS_HERE = False  # a task file: the cloud's machines load the model
MOUNT = "/checkpoints"
# A bucket's root (SkyPilot mounts no sub-folder) of a store with MOUNT_CACHED: S3, GCS and R2 (sky/data/storage.py;
# IBM COS and OCI's native store keep AbstractStore.mount_cached_command, which raises NotSupportedError).
BUCKET = re.compile(r"^(s3|gs|r2)://[^/]+/?$")
NAME_RULE = re.compile(r"[a-zA-Z0-9]+(?:[._-]{1,2}[a-zA-Z0-9]+)*")  # SkyPilot's task names: sky/task.py


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
    group.add_argument("--job_name", help="the task's name, and its folder in the bucket (default: the script's)")
    group.add_argument("--output", help="the task file (default: <recipe>.sky.yaml)")


def accelerate_words(options, words: list[str]) -> list[str]:
    return words


def rentable(spot: bool = True, nodes: int = 1) -> list[str]:
    """The price table's GPU types SkyPilot rents (those it names) on a cloud that can mount the bucket (and run
    `nodes`, and spot)."""
    return [name for name, d in price_table()["devices"].items() if d.get("skypilot") and able(name, nodes, spot)]


def sky_name(gpu: str, flag: str = "--gpu", nodes: int = 1, spot: bool = True) -> str:
    """SkyPilot's name for a price-table GPU type it can rent for the task, or one line naming those it can."""
    spec = device_spec(gpu, "a GPU type of toolkit/metrics/hardware.yaml")
    if not spec.get("skypilot"):
        raise ConfigError(f"{flag} {gpu}: SkyPilot names no such part to rent; pass one of "
                          f"{', '.join(rentable(spot))}.")  # fmt: skip
    if not able(gpu, nodes, spot):
        other = f"{flag} one of {', '.join(rentable(spot, nodes))}"
        raise ConfigError(
            f"{flag} {gpu}: {why_not(gpu, nodes, spot)}: pass {' or '.join([*fixes(gpu, nodes, spot), other])}."
        )
    return spec["skypilot"]


def job_name(options, script: str) -> str:
    """The task's name: --job_name, checked as SkyPilot checks it, else the script's made valid."""
    made = re.sub(r"[^a-z0-9]+", "-", Path(script).stem.lower()).strip("-") or "finetune"
    if options.job_name is None:
        return made
    if not NAME_RULE.fullmatch(options.job_name):
        fix = re.sub(r"[^a-zA-Z0-9]+", "-", options.job_name).strip("-") or made
        raise ConfigError(f"--job_name {options.job_name}: SkyPilot's task names are letters and digits joined by "
                          f"at most two of . _ - : pass e.g. --job_name {fix}.")  # fmt: skip
    return options.job_name


def choice(args, options) -> dict:
    """The plan's choice for the recipe (and the config, where the launch names one); or the --gpu given."""
    from ..planner.choose import choose
    from ..planner.cli import check_flags, plan_parser, stdout_to_stderr

    config = Path(args.config_file).stem if args.config_file else None
    if options.gpu:
        if config is None:
            raise ConfigError("--gpu without --config_file: name the strategy too, or leave --gpu out for the plan's "
                              "choice of both.")  # fmt: skip
        sky_name(options.gpu, "--gpu", options.nodes, not options.on_demand)
        return {"gpu": options.gpu, "gpus": options.gpus, "nodes": options.nodes, "config": config,
                "micro_batch": None}  # fmt: skip
    recipe = recipe_name(args.training_script)
    if not is_recipe(recipe):
        raise ConfigError(f"{args.training_script} is not a recipe the planner can size: pass --gpu TYPE (with "
                          "--gpus, --nodes) and --config_file.")  # fmt: skip
    for name in (options.gpu_types or "").split(","):
        if name.strip():
            sky_name(name.strip(), "--gpu_types", 1, not options.on_demand)
    words = [recipe, "--choose", "--gpu_types", options.gpu_types or ",".join(rentable(not options.on_demand))]
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
    """The SkyPilot task, and the plan's choice it was written from; every check before the file is written."""
    for flag, what in (("gpus", "GPUs a node"), ("nodes", "nodes")):
        if getattr(options, flag) < 1:
            raise ConfigError(f"--{flag} {getattr(options, flag)}: pass 1 or more {what}.")
    name = job_name(options, args.training_script)
    if options.bucket is None:
        raise ConfigError(f"--on skypilot needs --bucket s3://NAME (or gs://...): the checkpoints live there, "
                          f"mounted at {MOUNT}, so a recovered job resumes from them.")  # fmt: skip
    if not BUCKET.match(options.bucket):
        raise ConfigError(f"--bucket {options.bucket}: pass the bucket's root, s3://NAME, gs://NAME or r2://NAME: "
                          "SkyPilot mounts a whole bucket (the run writes under <bucket>/<job name>/), with a local "
                          "cache (MOUNT_CACHED) for those stores; IBM COS and OCI's have no MOUNT_CACHED.")  # fmt: skip
    picked, spot = choice(args, options), not options.on_demand
    gpu, nodes = picked["gpu"], picked["nodes"]
    if not able(gpu, nodes, spot):  # the plan's choice: it weighs sizes, not the clouds that rent them
        raise ConfigError(f"the plan chose {gpu} on {nodes} nodes, but {why_not(gpu, nodes, spot)}: pass --gpu_types "
                          f"without it, or --gpu {gpu} --nodes 1 with --config_file.")  # fmt: skip
    resources = {"accelerators": f"{sky_name(gpu)}:{picked['gpus']}", "use_spot": spot,
                 "job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": 0,
                                  "recover_on_exit_codes": [PREEMPTED]},
                 "any_of": [{"infra": cloud} for cloud in able(gpu, nodes, spot)]}  # fmt: skip
    spec = {
        "name": name,
        "num_nodes": picked["nodes"],
        "resources": resources,
        "workdir": ".",  # this repository, synced to every node
        "file_mounts": {MOUNT: {"source": options.bucket, "mode": "MOUNT_CACHED"}},
        "secrets": {"HF_TOKEN": None},  # given at launch: --secret HF_TOKEN
        "setup": "make install-node",  # the .venv the run calls (workdir.PYTHON); none of `make install`'s dev tools
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
    clouds = ", ".join(c["infra"] for c in spec["resources"]["any_of"])
    can = ", ".join(WHY[f] for f in needs(spec["num_nodes"], spec["resources"]["use_spot"]))
    header = (f"# {spec['resources']['accelerators']} x {spec['num_nodes']} node(s), "
              f"accelerate_configs/{picked['config']}.yaml ({why}).\n"
              f"# Clouds: {clouds} (those renting it that can {can}).\n"
              f"# Launch: sky jobs launch {path} --secret HF_TOKEN\n")  # fmt: skip
    write_job(path, header + dump([spec]))
    print(f"wrote {path}: {spec['resources']['accelerators']} x {spec['num_nodes']} node(s), "
          f"{picked['config']}.yaml, {'on-demand' if options.on_demand else 'spot'} ({why})")  # fmt: skip
    print(f"launch it with: sky jobs launch {path} --secret HF_TOKEN")
    return 0
