"""`python -m toolkit launch --on ray`: each rank a Ray Train worker, on a local Ray cluster of 2 CPU workers, for
real. A worker killed mid-run is restarted by Ray, and the run ends as `accelerate launch`'s uninterrupted run with
2 processes: the same losses and weights, bit for bit. (A running cluster joined with --address was checked the
same way by hand, `ray start --head` then RAY_AUTH_MODE=token; the launch costs 30-90 s on 2 cores.)"""

from __future__ import annotations

import sys

import pytest
from conftest import BIN, ROOT, check, launch, rank_reports, run_cmd

from toolkit.clusters.launch import main

FLAGS = ["--tiny", "--max_steps", "6", "--save_steps", "2", "--per_device_train_batch_size", "8",
         "--record_rank_reports", "true", "--report_to", "none"]  # fmt: skip
CONFIG = str(ROOT / "accelerate_configs" / "ddp.yaml")
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def on_ray(*words: str) -> list[str]:
    return [str(BIN / "python"), "-m", "toolkit", "launch", "--on", "ray", "--config_file", CONFIG, *words]


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    """The reference: the same flags under `accelerate launch --num_processes 2`."""
    out = tmp_path_factory.mktemp("accelerate") / "run"
    check(launch("ddp", "bert", *FLAGS, "--output_dir", str(out), cwd=out.parent))
    return rank_reports(out)


KILLER = """
import os, signal, sys
from pathlib import Path
from toolkit.training import stopping, trainer

class Killed(stopping.SafeStop):
    def on_step_end(self, args, state, control, **kwargs):
        marker = Path({marker!r})
        if state.global_step == 3 and os.environ["RANK"] == "1" and not marker.exists():
            marker.touch()  # the first attempt only
            os.kill(os.getpid(), signal.SIGKILL)
        return super().on_step_end(args, state, control, **kwargs)

trainer.SafeStop = Killed
sys.path.insert(0, {recipes!r})
from bert import RECIPE
from toolkit import run
run(RECIPE, sys.argv[1:], name="bert")
"""


@pytest.mark.launch
def test_killed_worker_is_restarted_and_resumes_as_accelerate_launch(accelerate_run, tmp_path):
    """Two workers on a local cluster started for the run (no --address), one gloo group, accelerate's DDP. Rank 1
    is killed (SIGKILL) after step 3 of 6, checkpoint-2 on disk: Ray's FailureConfig restarts the worker group,
    the recipe's `--resume auto` continues from checkpoint-2, and the run ends as the uninterrupted
    `accelerate launch --num_processes 2` run, bit for bit: the losses (history restored, then the same steps),
    learning rates, each rank's rows after the resume and the weights."""
    script = tmp_path / "killed.py"
    script.write_text(KILLER.format(marker=str(tmp_path / "killed"), recipes=str(ROOT / "recipes")))
    out = tmp_path / "run"
    cmd = on_ray("--num_workers", "2", "--max_failures", "1", str(script), *FLAGS, "--output_dir", str(out))
    result = check(run_cmd(cmd, cwd=tmp_path, env=RAY_ENV, timeout=400))
    assert "strategy      MULTI_CPU, 2 process(es) on 1 machine(s), cpu, backend gloo" in result.stdout
    assert "resume auto: no complete checkpoint" in result.stdout  # the first attempt: restartable from the start
    assert (tmp_path / "killed").exists()  # the kill happened
    assert f"resume auto: continuing from {out / 'checkpoint-2'}" in result.stdout
    reports = rank_reports(out)
    assert [r["process_index"] for r in reports] == [0, 1]
    for resumed, full in zip(reports, accelerate_run, strict=True):
        assert resumed["losses"] == full["losses"]
        assert resumed["learning_rates"] == full["learning_rates"]
        assert resumed["rows"] == full["rows"][-len(resumed["rows"]) :]
        assert resumed["weights_sha256"] == full["weights_sha256"]


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--num_workers", "0"], "--num_workers 0: pass 1 or more workers."),
        (["--num_workers", "2", "--num_processes", "2"], "--num_workers and --num_processes name the same count"),
        (["--address", "127.0.0.1:1"], "--address 127.0.0.1:1: no Ray cluster answers there"),
        (["--address", "nowhere"], "--address nowhere: pass HOST:PORT"),
        (["--image", "x"], "--image is not an option of --on ray (it is --on kubernetes's)"),
        (["--multi_gpu", "--cpu"], "accelerate launch refuses these options: You can only use one of `--cpu`"),
    ],
)
def test_bad_ray_launches_are_one_line(words, message, capsys, monkeypatch):
    """Each refused on the driver, before a cluster is joined or started (no_cluster: ray.init raises), with exit
    code 2 and one line (accelerate's own refusal was a traceback)."""
    no_cluster(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        main(["--on", "ray", "--config_file", CONFIG, *words, str(ROOT / "recipes" / "bert.py"), "--tiny"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err


def test_ray_missing_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CONFIG_FILE", "")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: `import ray` raises ImportError
    with pytest.raises(SystemExit):
        main(["--on", "ray", "--config_file", CONFIG, str(ROOT / "recipes" / "bert.py"), "--tiny"])
    assert capsys.readouterr().err.startswith("error: --on ray needs Ray Train: pip install 'ray[train]'")


@pytest.mark.parametrize(("code", "restarts"), [(0, False), (2, False), (3, False), (4, False), (75, True), (1, True)])
def test_a_worker_raises_only_for_what_a_restart_can_mend(code, restarts, tmp_path, monkeypatch):
    """A worker whose recipe ends on bad input (2), divergence (3) or a spent budget (4) returns, so Ray does not
    restart the group (any exception from a worker restarts it); a preempted (75) or crashed one raises. Either
    way the exit code reaches the board the launch ends on."""
    import types

    from toolkit.clusters import ray_train

    script = tmp_path / "ends.py"
    script.write_text(f"import sys\nsys.exit({code})\n")
    noted = {}
    board = types.SimpleNamespace(note=types.SimpleNamespace(remote=lambda rank, c: noted.update({rank: c})))
    context = types.SimpleNamespace(get_world_rank=lambda: 1)
    monkeypatch.setattr("ray.train.get_context", lambda: context)
    monkeypatch.setattr("ray.get", lambda value: value)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.chdir(tmp_path)  # the worker moves to the launch's directory: restored after
    config = {"env": {}, "cwd": str(tmp_path), "script": str(script), "argv": [], "board": board}
    if restarts:
        with pytest.raises(RuntimeError, match=f"rank 1 exited with code {code}"):
            ray_train.run_worker(config)
    else:
        ray_train.run_worker(config)
    assert noted == {1: code}
    codes = ray_train.ExitCodes()
    codes.note(1, code)
    codes.note(0, 0)
    assert codes.outcome() == code  # rank 0 ended well: the first failed rank's code


# What the driver decides before a worker starts (toolkit/clusters/ray_checks.py), from clusters of its own: Ray's
# own `ray.nodes()` rows, as Ray reports them.


def nodes(*resources: dict) -> list[dict]:
    return [{"Alive": True, "Resources": {"CPU": 8.0, "memory": 1e10, **r}} for r in resources]


def section(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "accelerate_configs" / f"{name}.yaml").read_text()).get("parallelism_config")


@pytest.mark.parametrize(
    ("config", "workers", "room", "mesh"),
    [
        ("fsdp2_tp", 16, [8, 8], {"dp_replicate": 1, "dp_shard": 8, "tp": 2}),  # the file's 2 x 2, for 16
        ("fsdp2_tp", 6, [8], {"dp_replicate": 1, "dp_shard": 3, "tp": 2}),
        ("fsdp_hybrid", 16, [8, 8], {"dp_replicate": 2, "dp_shard": 8}),  # replicas across nodes, shards inside
        ("fsdp_hybrid", 12, [8, 8], {"dp_replicate": 3, "dp_shard": 4}),  # 8 + 4 packed: blocks of gcd(12, 8)
        ("fsdp_hybrid", 16, [], {"dp_replicate": 1, "dp_shard": 16}),  # nodes not known: one node's mesh
        ("fsdp_hybrid", 4, [8, 8], {"dp_replicate": 1, "dp_shard": 4}),  # one node holds them all
        ("pp", 4, [2, 2], {"dp_replicate": 2, "dp_shard": 1, "pp": 2}),
        ("ddp", 16, [8, 8], {}),
    ],
)
def test_the_mesh_is_sized_for_the_workers(config, workers, room, mesh):
    """A config's mesh sized for the launch's workers as `toolkit mesh` sizes it for a SLURM job (job_mesh): before,
    fsdp2_tp.yaml's dp_shard 2 x tp 2 went to 16 workers as it was, and accelerate raised on every one of them."""
    from toolkit.clusters.ray_checks import worker_mesh

    assert worker_mesh(section(config), workers, room, config) == mesh


def test_the_workers_get_the_sized_mesh():
    from accelerate.commands.launch import launch_command_parser

    from toolkit.clusters import ray_train
    from toolkit.clusters.ray_checks import worker_mesh

    config = str(ROOT / "accelerate_configs" / "fsdp2_tp.yaml")
    args = launch_command_parser().parse_args(["--config_file", config, "--num_processes", "16", "train.py"])
    accelerate = ray_train.strategy_env(args)
    assert accelerate["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"  # the file's, for its own 4 processes
    env = ray_train.worker_variables(accelerate, worker_mesh(section("fsdp2_tp"), 16, [8, 8], config))
    assert (env["PARALLELISM_CONFIG_DP_SHARD_SIZE"], env["PARALLELISM_CONFIG_TP_SIZE"]) == ("8", "2")
    assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "1" and "ACCELERATE_USE_CPU" not in env
    assert ray_train.worker_variables(accelerate, {}, gpu=False)["ACCELERATE_USE_CPU"] == "true"  # GPUs stay visible


@pytest.mark.parametrize(
    ("config", "workers", "room", "message"),
    [
        ("pp", 1, [], "pp: its mesh pp=2 needs a multiple of 2 workers and the launch has 1: pass --num_workers 2"),
        ("fsdp2_tp", 4, [1, 1, 1, 1], "tp x cp (2 ranks) share a node, and the cluster's nodes have room for 1"),
    ],
)
def test_a_mesh_the_workers_cannot_hold_is_one_line(config, workers, room, message):
    from toolkit.clusters.ray_checks import worker_mesh
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        worker_mesh(section(config), workers, room, config)
    assert message in str(refused.value) and "\n" not in str(refused.value)


class NoWorkers(Exception):
    """ray.init reached: the launch went on to start a cluster and its workers."""


def no_cluster(monkeypatch) -> None:
    def init(*args, **kwargs):
        raise NoWorkers

    monkeypatch.setattr("ray.init", init)
    monkeypatch.setenv("TOOLKIT_CONFIG_FILE", "")
    for key in ("PARALLELISM_CONFIG_PP_SIZE", "PARALLELISM_CONFIG_PP_SCHEDULE", "PARALLELISM_CONFIG_EP_SIZE"):
        monkeypatch.delenv(key, raising=False)  # launch exports the config's for the ranks


def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('trained')\n")
    return str(path)


def test_a_pipeline_on_too_few_workers_is_refused_before_a_worker_starts(tmp_path, capsys, monkeypatch):
    """pp.yaml (2 stages) on 1 worker: before, every worker raised a traceback, and Ray retried it as a crash."""
    no_cluster(monkeypatch)
    pp = str(ROOT / "accelerate_configs" / "pp.yaml")
    with pytest.raises(SystemExit) as stop:
        main(["--on", "ray", "--num_workers", "1", "--config_file", pp, script(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {pp}: its mesh pp=2 needs a multiple of 2 workers") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("workers", "gpu", "room", "ceiling", "timeout", "outcome"),
    [
        (2, False, nodes({}), None, None, 0),  # room now
        (16, True, nodes({"GPU": 8.0}, {"GPU": 8.0}, {}), None, None, 0),  # the head's CPUs hold no GPU worker
        (
            9,
            True,
            nodes({"GPU": 8.0}, {}),
            None,
            None,
            "9 Ray workers: each takes one GPU and the cluster has room "
            "for 8 (nodes of 8 GPUs): pass --num_workers 8, or add nodes",
        ),  # fmt: skip
        (
            2,
            True,
            nodes({}),
            None,
            None,
            "2 Ray workers: each takes one GPU and the cluster has no GPU: pass --cpu "
            "to train on its CPUs, or add GPU nodes",
        ),  # fmt: skip
        (12, False, nodes({}), None, None, "pass --num_workers 8, or add nodes"),
        (
            16,
            True,
            nodes({}),
            {"GPU": 8, "CPU": 64},
            None,
            "the cluster has room for none now, and for 8 once its "
            "autoscaler has added every node it may: pass --num_workers 8, or raise the cluster's maximum",
        ),  # fmt: skip
        (16, True, nodes({}), {"GPU": 32, "CPU": 64}, None, 900),  # an autoscaler that will add GPU nodes: wait
        (16, True, nodes({}), {"GPU": 32}, 60, 60),
        (16, True, nodes({}), None, 60, 60),  # an autoscaler Ray does not describe: the wait asked for
    ],
)
def test_a_placement_that_cannot_happen_is_refused(workers, gpu, room, ceiling, timeout, outcome):
    """Before, more workers than the cluster holds waited forever: Ray Train retries a worker group's start without
    end. Now one line naming the fix, or, where an autoscaler may add the nodes, a bounded wait (outcome: seconds)."""
    from toolkit.clusters.ray_checks import node_room, room_wait
    from toolkit.errors import ConfigError

    per_worker = {"GPU": 1} if gpu else {"CPU": 1}
    if isinstance(outcome, int):
        assert room_wait(workers, per_worker, node_room(room, per_worker), ceiling, timeout) == outcome
        return
    with pytest.raises(ConfigError) as refused:
        room_wait(workers, per_worker, node_room(room, per_worker), ceiling, timeout)
    assert outcome in str(refused.value), refused.value


def test_the_wait_for_an_autoscaler_is_bounded():
    from toolkit.clusters.ray_checks import wait_for_room
    from toolkit.errors import ConfigError

    clock, polls = [0.0], []

    def sleep(seconds):
        clock[0] += seconds

    def grown():  # a GPU node joins on the third look
        polls.append(clock[0])
        return nodes({}, {"GPU": 8.0}) if len(polls) >= 3 else nodes({})

    room = wait_for_room(grown, 8, {"GPU": 1}, 600, sleep=sleep, clock=lambda: clock[0])
    assert room == [8] and len(polls) == 3
    with pytest.raises(ConfigError, match="after 600 s the cluster has room for 0 of the 16 workers"):
        wait_for_room(lambda: nodes({}), 16, {"GPU": 1}, 600, sleep=sleep, clock=lambda: clock[0])


@pytest.mark.parametrize(
    ("cpu_flag", "use_cpu", "address", "cluster_gpus", "gpu"),
    [
        (False, False, "10.0.0.1:6379", 0, True),  # an autoscaling cluster with no GPU node up yet: GPU workers
        (False, False, "auto", 0, True),
        (True, False, "auto", 8, False),  # accelerate's --cpu
        (False, True, "auto", 8, False),  # the config's use_cpu: true
        (False, False, None, 0, False),  # the local cluster is this machine: its GPUs, as accelerate launch
        (False, False, None, 2, True),
    ],
)
def test_gpu_workers_unless_the_launch_says_cpu(cpu_flag, use_cpu, address, cluster_gpus, gpu):
    from toolkit.clusters.ray_checks import use_gpu

    assert use_gpu(cpu_flag, {"use_cpu": use_cpu}, address, cluster_gpus) is gpu


def test_context_parallel_is_not_refused_for_the_drivers_hardware(tmp_path, capsys, monkeypatch):
    """fsdp2_cp.yaml on a cluster, from a head node without a GPU: the workers have them (GPU workers unless the
    launch says CPU), so the driver goes on. Before, it refused with the CUDA-only message of its own machine.
    With --cpu the workers have none, and the refusal is the driver's, in one line."""
    no_cluster(monkeypatch)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cp = str(ROOT / "accelerate_configs" / "fsdp2_cp.yaml")
    with pytest.raises(NoWorkers):
        main(["--on", "ray", "--address", "auto", "--config_file", cp, script(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        main(["--on", "ray", "--address", "auto", "--cpu", "--config_file", cp, script(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: context parallelism (parallelism_config_cp_size) needs CUDA")


def test_a_config_error_in_a_worker_ends_it_without_a_restart(tmp_path, capsys, monkeypatch):
    """A script that raises the toolkit's ConfigError itself (not through `toolkit.run`, which exits 2): one line,
    exit code 2 on the board, and no exception, which Ray would restart the group for."""
    import types

    from toolkit.clusters import ray_train

    bad = tmp_path / "bad.py"
    bad.write_text("from toolkit.errors import ConfigError\nraise ConfigError('--lr 2: pass a rate below 1.')\n")
    noted = {}
    board = types.SimpleNamespace(note=types.SimpleNamespace(remote=lambda rank, c: noted.update({rank: c})))
    monkeypatch.setattr("ray.train.get_context", lambda: types.SimpleNamespace(get_world_rank=lambda: 0))
    monkeypatch.setattr("ray.get", lambda value: value)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(tmp_path)
    ray_train.run_worker({"env": {}, "cwd": str(tmp_path), "script": str(bad), "argv": [], "board": board})
    assert noted == {0: 2}
    assert capsys.readouterr().err == "error: --lr 2: pass a rate below 1.\n"


def test_the_runtime_env_ships_the_repository_and_the_credentials(tmp_path):
    """A cluster elsewhere (--address HOST:PORT or ray://) gets this directory as the workers' working_dir, without
    what is large or local (virtual environments, git, outputs), and the Hub's and W&B's variables; a cluster here
    or `ray job submit`'s (no --address, auto) has the code already."""
    from toolkit.clusters.ray_checks import job_runtime_env, worker_env_vars

    wandb = {"WANDB_API_KEY": "k", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e", "WANDB_MODE": "offline"}
    environ = {"HF_TOKEN": "hf_x", "HF_HOME": "/data/hf", **wandb, "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "no"}
    for address in (None, "auto"):
        assert job_runtime_env(address, tmp_path, ["--output_dir", "out"]) is None
    env = job_runtime_env("10.0.0.1:6379", tmp_path, ["--tiny", "--output_dir", "outputs/llama"])
    assert env["working_dir"] == str(tmp_path)
    assert {".git", ".venv*", "runs", "wandb", "outputs/llama"} <= set(env["excludes"])
    assert "/elsewhere" not in job_runtime_env("ray://head:10001", tmp_path, ["--output_dir=/elsewhere"])["excludes"]
    on_cluster = worker_env_vars("10.0.0.1:6379", environ)
    assert on_cluster == {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "HF_TOKEN": "hf_x", "HF_HOME": "/data/hf", **wandb}
    assert "HF_HOME" not in worker_env_vars("ray://head:10001", environ)  # a path of a machine off the cluster
    assert worker_env_vars(None, environ)["HF_TOKEN"] == "hf_x"


@pytest.mark.launch
def test_more_workers_than_the_cluster_holds_are_refused_in_seconds(tmp_path):
    """A local cluster started for the run, asked for more CPU workers than the machine has: before, Ray waited
    for them forever; now one line, exit 2, before any worker starts."""
    cmd = on_ray("--num_workers", "4096", "--cpu", script(tmp_path), "--output_dir", str(tmp_path / "run"))
    result = run_cmd(cmd, cwd=tmp_path, env=RAY_ENV, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        line for line in errors if "4096 Ray workers: each takes one CPU and the cluster has room" in line
    ]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.launch
def test_a_config_error_in_a_worker_is_one_line_and_not_restarted(tmp_path):
    """A worker's ConfigError on a real local cluster: the launch ends with 2 after one attempt of the worker group
    (--max_failures 2 would have run it three times)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from toolkit.errors import ConfigError\nprint('the bad script ran', flush=True)\n"
                   "raise ConfigError('--lr 2: pass a rate below 1.')\n")  # fmt: skip
    cmd = on_ray("--num_workers", "1", "--max_failures", "2", str(bad))
    result = run_cmd(cmd, cwd=tmp_path, env=RAY_ENV, timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    # counted by its own words: "attempt" also came from accelerate's warning when another job held port 29500
    output = result.stdout + result.stderr
    assert output.count("the bad script ran") == 1
    assert output.count("Attempting to start training worker group") == 1  # Ray Train's, once a group start
    assert "error: --lr 2: pass a rate below 1." in result.stdout + result.stderr
