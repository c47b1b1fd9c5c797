"""`toolkit launch --on ray --address HEAD` on a real Ray cluster of 2 nodes on this machine (tests/cluster.py): `ray
start --head` in one network namespace, `ray start --address` in the other, each node its own hostname, /etc/hosts
and /tmp/ray; one CPU a node, so Ray places one worker on each. The driver runs on the head node, as a user logged in
there runs it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from cluster import Cluster, Ray, node_local, wait_for
from conftest import BIN, ROOT, rank_reports

pytestmark = pytest.mark.launch

STEPS = 100
FLAGS = ["--tiny", "--record_rank_reports", "true", "--report_to", "none", "--max_steps", str(STEPS),
         "--save_strategy", "steps", "--save_steps", "10", "--dropout", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def ray(tmp_path_factory):
    cluster = Cluster("tkr", 72).up()
    try:
        yield Ray(cluster, tmp_path_factory.mktemp("ray"), cpus=1)
    finally:
        cluster.down()


def start(ray: Ray, out: Path, *flags: str) -> subprocess.Popen:
    """The documented launch against the running cluster, its output in OUT.log; `--cpu`: a cluster of CPU nodes
    (without it, workers are given GPUs, which the launch refuses in one line here)."""
    argv = [str(BIN / "python"), "-m", "toolkit", "launch", "--on", "ray", "--address", ray.head, "--num_workers", "2",
            "--max_failures", "3", "--cpu", "--config_file", "accelerate_configs/ddp.yaml", "recipes/llama3_fft.py",
            *FLAGS,
            "--output_dir", str(out), *flags]  # fmt: skip
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(ray.driver(argv, ROOT), cwd=ROOT, env=ray.env, stdout=log, stderr=subprocess.STDOUT)


def log(out: Path) -> str:
    return Path(f"{out}.log").read_text(errors="replace")


def finished(process: subprocess.Popen, out: Path, timeout: float = 300) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the Ray launch did not end within {timeout:.0f} s\n{log(out)[-3000:]}", pytrace=False)


@pytest.fixture(scope="module")
def uninterrupted(ray, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ray-run") / "run"
    code = finished(start(ray, out), out)
    assert code == 0, log(out)[-3000:]
    return out


def test_ray_trains_across_two_nodes(ray, uninterrupted):
    """A worker on each node, their process group over the nodes' own addresses. Before, gloo on each worker took
    the hostname's address (127.0.1.1 here, as Debian maps it) and the group never formed."""
    text = log(uninterrupted)
    for k in (1, 2):
        assert f"ip={ray.cluster.address(k)}" in text, text[-3000:]  # Ray's prefix on each worker's lines
    reports = rank_reports(uninterrupted)
    assert len(reports) == 2 and reports[0]["weights_sha256"] == reports[1]["weights_sha256"]
    assert len(reports[0]["losses"]) == STEPS


def test_a_node_lost_mid_run_is_resumed_exactly(ray, uninterrupted, tmp_path):
    """Every process of the second node killed mid-run (its raylet and its worker); the node comes back (a new
    `ray start` there); Ray restarts the worker group, which resumes from the newest checkpoint and ends with the
    uninterrupted run's losses and weights."""
    out = tmp_path / "run"
    driver = start(ray, out)
    wait_for(lambda: log(out).count("'loss':") >= 15, 180, "15 steps")
    lost = time.monotonic()
    ray.cluster.kill_node(2)
    ray.nodes[1].wait(timeout=30)
    ray.rejoin(2)
    assert finished(driver, out) == 0, log(out)[-3000:]
    print(f"node lost to the run's end: {time.monotonic() - lost:.1f} s")
    assert "resume auto: continuing from" in log(out)
    full, resumed = rank_reports(uninterrupted), rank_reports(out)
    for a, b in zip(full, resumed, strict=True):
        assert b["losses"] == a["losses"] and b["weights_sha256"] == a["weights_sha256"]


def test_an_output_folder_not_every_node_shares_is_refused_in_one_line(ray, tmp_path):
    """Ray's workers on a node-local disk: before, each node kept its own ranks' checkpoint files and a restart's
    `--resume auto` was decided by each rank from its own disk. Now one line, exit 2, not restarted."""
    shared = tmp_path / "shared"
    shared.mkdir()
    node_local(ray.nodes[1].pid, shared)
    out = shared / "run"
    code = finished(start(ray, out), out)
    assert code == 2, log(out)[-3000:]
    errors = [line[line.index("error: the output folder"):] for line in log(out).splitlines()
              if "error: the output folder" in line]  # fmt: skip
    first, second = ray.cluster.names  # Ray puts rank 0 on either node
    said = [f"error: the output folder {out} is not shared by every node: {blind} cannot see what rank 0 ({zero})"
            for blind, zero in ((second, first), (first, second))]  # fmt: skip
    assert errors and all(e.startswith(tuple(said)) for e in errors), log(out)[-3000:]
    assert "Traceback" not in log(out)
