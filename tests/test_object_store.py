"""Checkpoints on an object store, as SkyPilot mounts a bucket (MOUNT_CACHED: rclone's write-back cache, each node
its own): 2 nodes of a cluster on this machine (tests/cluster.py) run the Kubernetes node command of a 2-node DDP
job in a container's environment (as tests/test_cluster_nodes.py does), the output folder in a moto S3 bucket that
each node mounts at /checkpoints (tests/object_store.py).

There a rename is neither atomic nor ordered with the uploads: rank 0's rename moved only what its mount saw, and
rank 1's files, uploaded later, stayed under .staging. Every checkpoint in the bucket lacked rank 1's RNG state
(which the damage checks did not read), and one whose node was lost mid-upload lacked whatever that node had not
uploaded."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from cluster import Cluster, wait_for
from conftest import BIN, ROOT, rank_reports
from object_store import MOUNT, Bucket

from toolkit.outputs import OWNER
from toolkit.training.checkpoint_damage import MANIFEST

pytestmark = pytest.mark.launch

HOME = "/tmp/tko-home"  # each node's own home folder is mounted here, on that node
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # Debian's, as in python:3.11-slim
FLAGS = ["--tiny", "--max_steps", "4", "--save_steps", "2", "--record_rank_reports", "true", "--report_to", "none"]
LOST_AT = 4  # node 1 is lost right after rank 0 published checkpoint-4, before its uploads finished
NODE_BOUND_S = 240  # both nodes' imports, rendezvous and 4 tiny steps on 2 shared cores, checkpoint waits included
FAULT_BOUND_S = 60  # node 1 lost to every process of the job ended: docs/faults-and-resume.md states it
# A whole checkpoint of this 2-rank DDP job, by what the Trainer and the toolkit write (not by what its marker says).
WHOLE = {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
         "rng_state_1.pth", "toolkit_cost.json", OWNER}  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster("tko", 75).up()
    try:
        yield cluster
    finally:
        cluster.down()


def trainjob(folder: Path) -> tuple[str, str]:
    """The name and node command of the TrainJob `toolkit launch --on kubernetes` writes for a 2-node ddp job."""
    path = folder / "trainjob.yaml"
    command = [str(BIN / "python"), "-m", "toolkit", "launch", "--on", "kubernetes", "--config_file",
               "accelerate_configs/ddp.yaml", "--output", str(path), "--image", "finetune:1", "--gpus_per_node", "1",
               "--num_machines", "2", "--num_processes", "2", "recipes/llama3_fft.py", *FLAGS]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    job = list(yaml.safe_load_all(path.read_text()))[-1]
    return job["metadata"]["name"], job["spec"]["trainer"]["command"][2]


def pod_envs(head: str, **more: str) -> list[dict[str, str]]:
    """Each node's environment as Trainer's torch plugin gives its pods: the image's PATH, its home (HOME, a folder of
    its own: start), the PET_* variables; `more` added (the bucket's rclone remote)."""
    return [{"PATH": IMAGE_PATH, "HOME": HOME, "LANG": "C.UTF-8", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1",
             "PET_NODE_RANK": str(k - 1), "PET_MASTER_ADDR": head, "PET_MASTER_PORT": "29400", **more}
            for k in (1, 2)]  # fmt: skip


def start(cluster: Cluster, scripts: list[str], envs: list[dict], logs: Path, binds: dict | None = None) -> list:
    """`bash -c script` on each node, its output in logs/node<k>.log; HOME each node's own folder, at the same path
    on every node as in an image (the tiny model's path, which a checkpoint records, is the same on all)."""
    logs.mkdir(parents=True, exist_ok=True)
    cluster.mount_point(HOME)
    nodes = []
    for k, (script, env) in enumerate(zip(scripts, envs, strict=True), 1):
        home = logs.parent / f"home{k}"
        home.mkdir(exist_ok=True)
        nodes.append(cluster.start(cluster.argv(k, ["bash", "-c", script], {**(binds or {}), HOME: home}),
                                   logs / f"node{k}.log", env=env))  # fmt: skip
    return nodes


def ended(nodes: list, logs: Path) -> list[str]:
    """Every node's output, each having ended with 0 within NODE_BOUND_S."""
    wait_for(lambda: all(n.poll() is not None for n in nodes), NODE_BOUND_S, "every node to end")
    outputs = [(logs / f"node{k}.log").read_text(errors="replace") for k in range(1, len(nodes) + 1)]
    for k, (node, out) in enumerate(zip(nodes, outputs, strict=True), 1):
        assert node.returncode == 0, f"node {k} exit {node.returncode}:\n{out[-3000:]}"
    return outputs


def job_processes(cluster: Cluster) -> list[str]:
    """The job's processes still on either node (their bucket mounts aside), each with its state and where it waits."""
    left = []
    for k in (1, 2):
        for pid, command in cluster.pids(k):
            if "rclone mount" not in command:
                with contextlib.suppress(OSError):
                    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    left.append(f"node {k} pid {pid} {state} in {Path(f'/proc/{pid}/wchan').read_text()}: {command}")
    return left


def whole_checkpoints(bucket: Bucket, name: str) -> list[int]:
    """The steps of the checkpoints in the bucket that hold every file a whole one does, each at the size its marker
    lists: what a relaunch, on new machines, can resume from."""
    objects = bucket.objects(f"{name}/")
    steps = sorted({int(key.split("/")[0].split("-")[1]) for key in objects if key.startswith("checkpoint-")})
    whole = []
    for step in steps:
        files = {key.split("/", 1)[1]: size for key, size in objects.items() if key.startswith(f"checkpoint-{step}/")}
        if WHOLE <= set(files):
            listed = bucket.json(f"{name}/checkpoint-{step}/{OWNER}").get(MANIFEST, {})
            if listed and all(files.get(file) == size for file, size in listed.items()):
                whole.append(step)
    return whole


def test_a_node_lost_during_a_checkpoint_upload_resumes_from_the_newest_whole_checkpoint(cluster, tmp_path):
    """Node 1 (rank 0) is lost right after it published checkpoint-4, before its mount uploaded it: every process
    of the job ends within FAULT_BOUND_S, checkpoint-2 in the bucket is whole, and the relaunch on new machines
    (fresh mounts and caches) skips checkpoint-4, naming why, resumes from checkpoint-2 and ends with the
    uninterrupted run's losses and weights. Before, rank 0 renamed the staging folder without waiting for rank 1's
    files, which its mount did not see yet: after the loss the bucket held no whole checkpoint, only rank 1's RNG
    states, stranded under .staging."""
    name, command = trainjob(tmp_path)
    head = f"{name}-node-0-0.{name}"
    cluster.alias(head, 1)
    cluster.mount_point(MOUNT)

    shared = tmp_path / "shared"  # the uninterrupted run, on a folder both nodes share
    shared.mkdir()
    reference = start(cluster, [f"cd {ROOT} && {command}"] * 2, pod_envs(head), tmp_path / "reference",
                      {MOUNT: shared})  # fmt: skip
    ended(reference, tmp_path / "reference")
    full = rank_reports(shared / name)

    bucket = Bucket(cluster, tmp_path / "bucket")
    envs = pod_envs(head, **bucket.env())

    def on_new_machines(launch: str) -> list:
        """Both nodes mount the bucket, each with a new cache, and run the job's command."""
        folder = tmp_path / launch
        scripts = [f"{bucket.mount(folder / f'cache{k}', folder / f'rclone{k}.log')} && cd {ROOT} && {command}"
                   for k in (1, 2)]  # fmt: skip
        return start(cluster, scripts, envs, folder)

    first = on_new_machines("first")
    published = Path(f"/proc/{first[0].pid}/root{MOUNT}/{name}/checkpoint-{LOST_AT}")  # node 1's own view
    wait_for(lambda: published.is_dir() or first[0].poll() is not None, NODE_BOUND_S, f"checkpoint-{LOST_AT}",
             every=0.05)  # fmt: skip
    assert first[0].poll() is None, (tmp_path / "first" / "node1.log").read_text()[-3000:]
    lost = time.monotonic()
    cluster.kill_node(1)
    while (any(n.poll() is None for n in first) or job_processes(cluster)) and time.monotonic() < lost + FAULT_BOUND_S:
        time.sleep(0.2)
    assert not job_processes(cluster), f"{FAULT_BOUND_S} s after node 1 was lost: {job_processes(cluster)}"
    print(f"node 1 lost to every process of the job ended: {time.monotonic() - lost:.1f} s")
    cluster.kill_node(2)  # its mount too: the relaunch gets new machines
    assert whole_checkpoints(bucket, name) == [2], bucket.objects(f"{name}/")

    second = on_new_machines("second")
    outputs = ended(second, tmp_path / "second")
    line = next(line for line in outputs[0].splitlines() if "resume auto:" in line)
    assert f"resume auto: continuing from {MOUNT}/{name}/checkpoint-2" in line, line
    if any(key.startswith(f"checkpoint-{LOST_AT}/") for key in bucket.objects(f"{name}/")):
        assert f"skipped checkpoint-{LOST_AT}: " in line, line
    reports = [f"{name}/rank_reports/rank{r}.json" for r in (0, 1)]
    wait_for(lambda: set(reports) <= {f"{name}/{key}" for key in bucket.objects(f"{name}/")}, 60,
             "the relaunch's rank reports uploaded")  # fmt: skip
    for before, after in zip(full, [bucket.json(key) for key in reports], strict=True):
        assert after["losses"] == before["losses"] and after["weights_sha256"] == before["weights_sha256"]
    wait_for(lambda: whole_checkpoints(bucket, name) == [2, 4], 60, "checkpoint-4 whole in the bucket")
