"""What `toolkit launch --on ray` decides on the driver before a worker starts (ray_train.py), as functions of what
Ray reports (`ray.nodes()`, the autoscaler's published ceiling), so that the tests give them clusters of their own:

- the workers' resources: a GPU each unless the launch says CPU (`--cpu`, the config's `use_cpu: true`); a local
  cluster started for the run is this machine, whose GPUs decide, as under `accelerate launch`;
- the cluster's room for them: a placement that cannot happen is refused in one line (Ray Train would retry the
  worker group's start forever); where an autoscaler may add the nodes, a bounded wait for them;
- the config's mesh sized for the workers, as `toolkit mesh` sizes it for a SLURM job (settings/mesh.py's job_mesh);
- the runtime environment: this directory as the workers' working_dir on a cluster elsewhere, and the Hub's and
  W&B's variables for every worker (a worker's environment is its node's `ray start`'s, not the driver's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from ..settings.mesh import MODEL_PARALLEL_AXES, config_mesh, describe, job_mesh

SCALE_UP_TIMEOUT_S = 900  # an autoscaler's new GPU nodes: a cloud VM boots and joins in 2-10 minutes
POLL_S = 10
# Ray Train routes a worker's print() through its logger: the toolkit's lines stay lines, and a library that
# captures its own stdout (dill, which datasets hashes functions with) keeps it captured.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
# The driver's variables every worker gets: the Hub's token, endpoint and cache, and every WANDB_* (W&B's key,
# project, entity, mode, ...).
PASSED_ON = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HOME")
# Not shipped to a cluster elsewhere: environments, git, outputs, caches (Ray also leaves out what .gitignore and
# .rayignore list; its limit is the package's zipped size, 512 MiB by default).
NOT_SHIPPED = [".git", ".venv*", "runs", "wandb", "reports", "outputs", "__pycache__", "*.egg-info", ".*_cache"]


def says_cpu(cpu_flag: bool, config: dict) -> bool:
    """The launch asks for CPU workers: accelerate's --cpu, or the config's `use_cpu: true`."""
    return bool(cpu_flag) or str(config.get("use_cpu")).lower() == "true"


def use_gpu(cpu_flag: bool, config: dict, address: str | None, cluster_gpus: float) -> bool:
    """GPU workers unless the launch says CPU. Not from the cluster's GPUs at launch, which an autoscaling cluster
    adds only once workers ask for them; but a local cluster started for the run (no --address) is this machine,
    whose GPUs decide, as under `accelerate launch`."""
    if says_cpu(cpu_flag, config):
        return False
    return address is not None or cluster_gpus > 0


def node_room(nodes: list[dict], per_worker: dict[str, float]) -> list[int]:
    """Workers each live node has room for (a worker's resources all on one node); nodes with none left out."""
    room = [min(int(node.get("Resources", {}).get(name, 0) // need) for name, need in per_worker.items())
            for node in nodes if node.get("Alive")]  # fmt: skip
    return [r for r in room if r > 0]


def counted(workers: int) -> str:
    return f"{workers} Ray worker{'s' if workers != 1 else ''}"


def no_room(workers: int, per_worker: dict[str, float], room: list[int], hint: str = "") -> ConfigError:
    kind = next(iter(per_worker))
    held = sum(room)
    if held == 0:
        where = f"the cluster has no {kind}"
        fix = "pass --cpu to train on its CPUs, or add GPU nodes" if kind == "GPU" else "add nodes"
    else:
        sizes = "/".join(str(r) for r in sorted(set(room), reverse=True))
        where = f"the cluster has room for {held} (nodes of {sizes} {kind}s)"
        fix = f"pass --num_workers {held}, or add nodes"
    return ConfigError(f"{counted(workers)}: each takes one {kind} and {where}: {fix}{hint}.")


def room_wait(workers: int, per_worker: dict[str, float], room: list[int], ceiling: dict | None,
              timeout: float | None) -> float:  # fmt: skip
    """Seconds to wait for an autoscaler to make room for the workers (0: there is room now); a placement that
    cannot happen refused. `ceiling`: the resources the cluster can grow to, where its autoscaler publishes them
    (autoscaler v2, KubeRay); `timeout`: --scale_up_timeout (None, its default: 900 s where the ceiling leaves
    room, else none, a cluster without a published ceiling taken as fixed; 0 for a local cluster)."""
    if sum(room) >= workers:
        return 0
    kind, need = next(iter(per_worker.items()))
    most = None if ceiling is None else int(ceiling.get(kind, 0) // need)
    if most is not None and most < workers:
        now = f"room for {sum(room)}" if room else "room for none"
        fix = f"pass --num_workers {most}, or raise" if most else "raise"
        raise ConfigError(f"{counted(workers)}: each takes one {kind} and the cluster has {now} now, and for "
                          f"{most} once its autoscaler has added every node it may: {fix} the cluster's "
                          "maximum.")  # fmt: skip
    wait = timeout if timeout is not None else SCALE_UP_TIMEOUT_S if most is not None else 0
    if wait <= 0:
        later = " (an autoscaling cluster: --scale_up_timeout S waits for its nodes)"
        raise no_room(workers, per_worker, room, later if timeout is None else "")
    return wait


def wait_for_room(nodes: Callable[[], list[dict]], workers: int, per_worker: dict[str, float], wait: float,
                  sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> list[int]:  # fmt: skip
    """The nodes' room once it holds the workers, looked at every POLL_S seconds for `wait` seconds; then one line."""
    deadline = clock() + wait
    while sum(room := node_room(nodes(), per_worker)) < workers:
        if clock() >= deadline:
            raise ConfigError(f"{counted(workers)}: after {wait:.0f} s the cluster has room for {sum(room)} of the "
                              f"{workers} workers (one {next(iter(per_worker))} each): pass --num_workers "
                              f"{sum(room) or 1}, add nodes, or wait longer (--scale_up_timeout).")  # fmt: skip
        sleep(min(POLL_S, max(0.0, deadline - clock())))
    return room


def worker_mesh(section: dict | None, workers: int, room: list[int], config_file: str) -> dict[str, int]:
    """The config's mesh (its `parallelism_config`) sized for `workers` Ray workers by job_mesh, as `toolkit mesh`
    sizes it for a SLURM job of nodes x processes. Ray packs a worker group onto as few nodes as it can and numbers
    the ranks node by node: one node where one has room for all; otherwise blocks of gcd(workers, each node's room)
    consecutive ranks share a node, whatever the last node's share; nothing known (before ray.init, a cluster
    still scaling): one node's mesh. {} for a config without a mesh."""
    mesh = config_mesh(section)
    if not mesh:
        return {}
    split = {axis: size for axis, size in mesh.items() if axis in MODEL_PARALLEL_AXES}
    model_parallel = math.prod(split.values())
    if workers % model_parallel:
        fit = max(model_parallel, workers // model_parallel * model_parallel)
        raise ConfigError(f"{config_file}: its mesh {describe(split)} needs a multiple of {model_parallel} workers "
                          f"and the launch has {workers}: pass --num_workers {fit} (or sizes in the config whose "
                          f"product divides {workers}).")  # fmt: skip
    per_node = workers if not room or max(room) >= workers else math.gcd(workers, *room)
    inside = split.get("tp", 1) * split.get("cp", 1)
    if per_node % inside:
        sizes = "/".join(str(r) for r in sorted(set(room), reverse=True))
        raise ConfigError(f"{config_file}: its mesh's tp x cp ({inside} ranks) share a node, and the cluster's nodes "
                          f"have room for {sizes} workers: use a tp/cp size in the config that divides each node's "
                          f"{sizes}, or nodes with more GPUs.")  # fmt: skip
    return job_mesh(section, workers // per_node, per_node)


def mesh_variables(mesh: dict[str, int]) -> dict[str, str]:
    """The sized mesh as the variables accelerate's launcher exports from a config (PARALLELISM_CONFIG_*_SIZE)."""
    return {f"PARALLELISM_CONFIG_{axis.upper()}_SIZE": str(size) for axis, size in mesh.items()}


def output_dir(script_args: list[str]) -> str | None:
    """The recipe's --output_dir, as given."""
    for i, word in enumerate(script_args):
        if word.startswith("--output_dir="):
            return word.partition("=")[2]
        if word == "--output_dir" and i + 1 < len(script_args):
            return script_args[i + 1]
    return None


def job_runtime_env(address: str | None, cwd: Path, script_args: list[str]) -> dict | None:
    """ray.init's runtime_env: on a cluster elsewhere (--address HOST:PORT, ray://HOST:10001) the workers get this
    directory as their working_dir, without environments, git and outputs (NOT_SHIPPED, and the run's own output
    folder where it lies inside); none where the cluster has the code: a local one, or `--address auto` on the head
    node, where `ray job submit --working-dir .` shipped it."""
    if address in (None, "auto"):
        return None
    excludes = list(NOT_SHIPPED)
    out = output_dir(script_args)
    if out and not Path(out).is_absolute() and not Path(out).as_posix().startswith(".."):
        excludes.append(Path(out).as_posix())
    return {"working_dir": str(cwd), "excludes": excludes}


def worker_env_vars(address: str | None, environ: dict[str, str]) -> dict[str, str]:
    """The workers' runtime_env env_vars: the driver's HF_* and WANDB_* (PASSED_ON), which a worker started by its
    node's `ray start` does not otherwise see; HF_HOME not from a driver off the cluster (ray://), a path of its
    own machine."""
    passed = {k: v for k, v in environ.items() if k in PASSED_ON or k.startswith("WANDB_")}
    if address is not None and address.startswith("ray://"):
        passed.pop("HF_HOME", None)
    return {**WORKER_ENV, **passed}


def check_gpu_axes(args, section: dict | None, gpu: bool) -> None:
    """What needs GPUs, against the workers' resources, not this machine's (launcher.check_this_machine, for a
    launch here; a head node may have none): context parallelism (models/parallel.py). The ranks check again."""
    from ..models.parallel import CP_ON_CPU

    cp = max(int(args.parallelism_config_cp_size or 1), config_mesh(section).get("cp", 1))
    if cp > 1 and not gpu:
        raise ConfigError(CP_ON_CPU)


def check_model(args) -> None:
    """A recipe's model reachable from the Hub (or cached), checked once here, as `toolkit launch` does."""
    from ..distributed.launcher import check_recipe_model
    from ..project import is_recipe

    script = Path(args.training_script)
    if script.parent.name == "recipes" and is_recipe(script.stem):
        check_recipe_model(script.stem, args.training_script_args)


def cluster_ceiling() -> dict | None:
    """The resources the cluster may grow to, where its autoscaler publishes its node groups (autoscaler v2,
    KubeRay); None where none is published. Ray Train reads the same before it places a worker group (v2's
    WorkerGroup), through an API Ray keeps private: where it is gone, the cluster is taken as fixed."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config()
    except Exception:  # a private API: any failure means no published ceiling
        return None
