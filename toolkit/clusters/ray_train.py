"""`python -m toolkit launch --on ray [--num_workers N] [--address A] [--max_failures K] ...`: every rank a worker of
a Ray Train `TorchTrainer`, which starts the workers, sets up their process group (gloo on CPUs, NCCL on GPUs)
and RANK/WORLD_SIZE/LOCAL_RANK as torchrun does; each worker runs the recipe script as `accelerate launch` would,
with the strategy's variables accelerate's own launcher computes from the config file.

Failures: Ray's FailureConfig restarts the whole worker group after a worker dies or the run is preempted (exit
75), up to --max_failures times; the recipe runs with `--resume auto`, so a restart continues from the newest
complete checkpoint, exactly (tests/test_ray.py). A run that ends for a reason a restart cannot mend (bad input 2,
diverged 3, budget spent 4) is not restarted: the launch ends on that code, as `toolkit launch` does.

Before a worker starts, the driver refuses in one line what cannot run (ray_checks.py): more workers than the
cluster has room for (an autoscaling cluster gets a bounded wait, --scale_up_timeout), a config's mesh the workers
cannot hold (sized for them otherwise, as `toolkit mesh` sizes it for SLURM). Workers take a GPU each unless the
launch says CPU (--cpu, the config's use_cpu); what depends on a GPU is checked against that, not against the
driver's machine, which may have none (the ranks check their own hardware again).

A remote cluster: `ray job submit --address http://HEAD:8265 --working-dir . -- python -m toolkit launch --on ray
--address auto ...` runs this on the head node (docs/strategies.md); from another machine, --address HOST:PORT or
ray://HOST:10001 ships this directory as the workers' working_dir. Without --address a local cluster is started
for the run and stopped after it.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
from pathlib import Path

from ..errors import BUDGET_SPENT, DIVERGED, USER_ERROR, ConfigError, ToolkitError, first_line, report
from . import ray_checks
from .workdir import resumable

NAME = "ray"
# The workers run on the cluster's machines, not necessarily this one (a head node without GPUs): the launch's
# checks of this machine's hardware are not theirs (launch() checks against the workers' resources instead).
RUNS_HERE = False
FINAL = (0, USER_ERROR, DIVERGED, BUDGET_SPENT)  # exit codes a restart would only repeat
NOT_PASSED_ON = ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")  # Ray's own, per worker


def add_options(group) -> None:
    group.add_argument("--num_workers", type=int, help="Ray Train workers, one rank each (accelerate's "
                       "--num_processes; default the config's)")  # fmt: skip
    group.add_argument("--address", help="a running Ray cluster: `auto` (on its head node, as `ray job submit` "
                       "runs it), HOST:PORT or ray://HOST:10001; default: a local cluster for the run")  # fmt: skip
    group.add_argument("--max_failures", type=int, default=3, help="restarts of the worker group after a failure "
                       "or preemption, each resuming from the newest checkpoint (default 3)")  # fmt: skip
    group.add_argument("--scale_up_timeout", type=float, help="seconds to wait for an autoscaler to add the nodes "
                       "the workers need (default 900 where the cluster publishes room to grow, as KubeRay's and "
                       "autoscaler v2's do; else none: a cluster without room is refused)")  # fmt: skip


def accelerate_words(options, words: list[str]) -> list[str]:
    """--num_workers is Ray's name for accelerate's --num_processes."""
    if options.num_workers is None:
        return words
    if options.num_workers < 1:
        raise ConfigError(f"--num_workers {options.num_workers}: pass 1 or more workers.")
    if any(w == "--num_processes" or w.startswith("--num_processes=") for w in words):
        raise ConfigError("--num_workers and --num_processes name the same count under --on ray: pass one.")
    return [*words, "--num_processes", str(options.num_workers)]


def check_address(address: str | None) -> None:
    """A cluster address that does not answer, refused in seconds (ray.init would wait on it for a minute)."""
    if address in (None, "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address}: pass HOST:PORT (a head node's GCS, 6379), ray://HOST:10001 or auto.")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as error:
        raise ConfigError(f"--address {address}: no Ray cluster answers there ({first_line(error)}). Start one "
                          "(`ray start --head`) or pass the head node's address.") from None  # fmt: skip


def strategy_env(args) -> dict[str, str]:
    """The variables `accelerate launch` would give the ranks for this config (ACCELERATE_*, FSDP_*, DeepSpeed's),
    computed by accelerate's own launch helpers; not the rendezvous, which is Ray's."""
    from accelerate.commands.launch import _validate_launch_command
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    try:
        args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    except ValueError as error:  # a combination of options accelerate's own launch refuses
        raise ConfigError(f"accelerate launch refuses these options: {first_line(error)}") from None
    if args.use_deepspeed:  # as accelerate's launch_command marks the fields the config file set
        fields = list(defaults.deepspeed_config) if defaults else []
        fields += ["mixed_precision"] if mixed_precision_from_config else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        env = prepare_deepspeed_cmd_env(args)[1]
    elif args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        env = prepare_simple_launcher_cmd_env(args)[1]
    return {k: v for k, v in env.items() if os.environ.get(k) != v and k not in NOT_PASSED_ON}


def worker_variables(accelerate: dict[str, str], mesh: dict[str, int], gpu: bool = True) -> dict[str, str]:
    """What each worker sets before the recipe runs: accelerate's variables for the config (strategy_env), the
    toolkit's own (TOOLKIT_*, and the mesh axes accelerate has not, PARALLELISM_CONFIG_PP_*/_EP_SIZE), the mesh
    sized for the workers over the config's sizes, and ACCELERATE_USE_CPU for CPU workers (Ray leaves a node's
    GPUs visible to a worker that holds none: accelerate would take cuda:LOCAL_RANK)."""
    own = {k: v for k, v in os.environ.items() if k.startswith(("TOOLKIT_", "PARALLELISM_"))}
    cpu = {} if gpu else {"ACCELERATE_USE_CPU": "true"}
    return {**accelerate, **own, **ray_checks.mesh_variables(mesh), **cpu}


def launch(options, args) -> int:
    try:
        import ray
        from ray.autoscaler.sdk import request_resources
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray.train.v2.api.exceptions import TrainingFailedError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        raise ConfigError("--on ray needs Ray Train: pip install 'ray[train]' (`make install` has it).") from None
    from ..distributed.launch_check import read_yaml
    from ..distributed.launcher import launch_shape
    from ..settings.mesh import describe

    check_address(options.address)
    config = read_yaml(Path(args.config_file)) if args.config_file else {}
    section = config.get("parallelism_config")
    workers = args.num_processes = launch_shape(args)["processes"]
    # What no cluster can run, before one is joined or started: a mesh the workers cannot hold, a GPU axis on CPUs,
    # options accelerate refuses
    ray_checks.worker_mesh(section, workers, [], args.config_file)
    if ray_checks.says_cpu(args.cpu, config):
        ray_checks.check_gpu_axes(args, section, gpu=False)
    ray_checks.check_model(args)
    accelerate = strategy_env(args)
    shipped = ray_checks.job_runtime_env(options.address, Path.cwd(), args.training_script_args)
    try:
        ray.init(address=options.address, include_dashboard=False, configure_logging=False, runtime_env=shipped)
    except ConnectionError as error:  # it answered, but not as a Ray cluster (or went away)
        raise ConfigError(f"--address {options.address}: {first_line(error)}. A cluster with token authentication "
                          "(`ray start`'s default) needs RAY_AUTH_MODE=token here, with its token in RAY_AUTH_TOKEN or "
                          "~/.ray/auth_token; or run on the head node with --address auto.") from None  # fmt: skip
    except ValueError as error:
        if shipped and "exceeds the maximum size" in str(error):  # Ray's limit on the zipped working_dir
            raise ConfigError(f"{Path.cwd()} is too large to ship to the cluster ({str(error).split('. ')[0]}): "
                              "list its large folders in a .rayignore file (.gitignore's syntax), or run on the head "
                              "node with --address auto.") from None  # fmt: skip
        raise
    requested = False
    try:
        gpu = ray_checks.use_gpu(args.cpu, config, options.address, ray.cluster_resources().get("GPU", 0))
        ray_checks.check_gpu_axes(args, section, gpu)
        per_worker = {"GPU": 1} if gpu else {"CPU": 1}  # Ray Train's own defaults, named so the check is Ray's
        room = ray_checks.node_room(ray.nodes(), per_worker)
        timeout = 0 if options.address is None else options.scale_up_timeout  # a local cluster does not grow
        wait = ray_checks.room_wait(workers, per_worker, room, ray_checks.cluster_ceiling(), timeout)
        if wait:
            request_resources(bundles=[per_worker] * workers)  # the autoscaler scales to them now
            requested = True
            print(f"ray: the cluster has room for {sum(room)} of the {workers} workers: waiting up to {wait:.0f} s "
                  "for its autoscaler to add nodes (--scale_up_timeout)", flush=True)  # fmt: skip
            room = ray_checks.wait_for_room(ray.nodes, workers, per_worker, wait)
        mesh = ray_checks.worker_mesh(section, workers, room, args.config_file)
        if mesh:
            print(f"ray: mesh {describe(mesh)} for {workers} workers", flush=True)
        loop = {"env": worker_variables(accelerate, mesh, gpu), "cwd": os.getcwd(), "script": args.training_script,
                "argv": resumable(args.training_script_args)}  # fmt: skip
        # on the driver's node, which outlives the workers' (placed anywhere, it died with a lost node, and the
        # driver with it, in a traceback)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        loop["board"] = board = ray.remote(ExitCodes).options(num_cpus=0, scheduling_strategy=here).remote()
        env_vars = ray_checks.worker_env_vars(options.address, dict(os.environ))
        trainer = TorchTrainer(run_worker, train_loop_config=loop, torch_config=node_interfaces(),
                               scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu,
                                                            resources_per_worker=per_worker),
                               run_config=RunConfig(name=f"{Path(args.training_script).stem}-{os.getpid()}",
                                                    failure_config=FailureConfig(max_failures=options.max_failures),
                                                    worker_runtime_env={"env_vars": env_vars}))  # fmt: skip
        try:
            trainer.fit()
        except TrainingFailedError:  # restarts spent: the workers' exit codes say how it ended, else Ray's log
            return ray.get(board.outcome.remote()) or 1
        return ray.get(board.outcome.remote())
    finally:
        if requested:
            request_resources(bundles=[])  # the cluster may scale down again once the run is over
        ray.shutdown()


def name_interface() -> None:
    """On a worker, before its process group: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (unless set) the interface
    holding its node's Ray address. gloo otherwise takes its address from the hostname, which Debian's /etc/hosts
    maps to 127.0.1.1: workers on other nodes were told to connect there and the group never formed."""
    import ray

    from ..distributed.network import SOCKET_VARIABLES, local_interface

    interface, _ = local_interface(ray.util.get_node_ip_address())
    for variable in SOCKET_VARIABLES:
        os.environ.setdefault(variable, interface)


def node_interfaces():
    """Ray Train's torch set-up, each worker naming its node's interface first (name_interface)."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    class Backend(_TorchBackend):
        def on_start(self, worker_group, backend_config) -> None:
            worker_group.execute(name_interface)
            super().on_start(worker_group, backend_config)

    class Config(TorchConfig):
        @property
        def backend_cls(self):
            return Backend

    return Config()


class ExitCodes:
    """A Ray actor the workers tell their exit codes, as torchrun's agent collects its processes' (the driver
    may run elsewhere than any worker). The launch ends on rank 0's last code, else the first failed rank's."""

    def __init__(self) -> None:
        self.codes: dict[int, int] = {}

    def note(self, rank: int, code: int) -> None:
        self.codes[rank] = code

    def outcome(self) -> int:
        return self.codes.get(0) or next((c for c in self.codes.values() if c), 0)


def run_worker(config: dict) -> None:
    """One rank: the recipe script run in this worker, as its own `__main__`, with the launch's variables."""
    import ray.train

    os.environ.update(config["env"])
    if Path(config["cwd"]).is_dir():  # a remote cluster's workers run in `ray job submit`'s working directory
        os.chdir(config["cwd"])
    sys.argv = [config["script"], *config["argv"]]
    try:
        runpy.run_path(config["script"], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except ToolkitError as error:  # a script's own, outside `toolkit.run` (which exits 2): one line, not a restart
        code = report(error)
    rank = ray.train.get_context().get_world_rank()
    ray.get(config["board"].note.remote(rank, code))
    if code not in FINAL:  # preempted (75) or a crash: Ray restarts the group, which resumes
        raise RuntimeError(f"rank {rank} exited with code {code}")
