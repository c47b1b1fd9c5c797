"""slurm/finetune.sbatch on a real SLURM cluster of 2 nodes on this machine (tests/cluster.py): slurmctld, a slurmd
per network namespace with its own hostname and address, munge. Submitted as the docs show it for a CPU (one
process per node, `--gpus-per-node=0`), from a shell with the venv active, as a user's."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from cluster import Cluster, Slurm, node_local, read_only, wait_for
from conftest import BIN, ROOT, rank_reports

pytestmark = pytest.mark.launch

FAULT_BOUND_S = 60  # a lost node to every process ended: docs/faults-and-resume.md states it
STEPS = 200  # ~0.03 s a step here: time for a signal to cross slurmctld, slurmd, the batch script and srun
FLAGS = ["--tiny", "--record_rank_reports", "true", "--report_to", "none", "--max_steps", str(STEPS),
         "--save_strategy", "steps", "--save_steps", "50", "--dropout", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = Cluster("tks", 71).up()
    try:
        yield Slurm(cluster, tmp_path_factory.mktemp("slurm"))
    finally:
        cluster.down()


def submit(slurm: Slurm, config: str, out: Path, *flags: str) -> str:
    """`sbatch slurm/finetune.sbatch` as docs/strategies.md shows it for CPU nodes; the job's id."""
    env = {**slurm.env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "GPUS_PER_NODE": "1"}
    command = ["sbatch", "--parsable", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}", f"--output={out}.log",
               "slurm/finetune.sbatch", f"accelerate_configs/{config}.yaml", "recipes/llama3_fft.py", *FLAGS,
               "--output_dir", str(out), *flags]  # fmt: skip
    result = slurm.run(*command, cwd=ROOT, env=env)
    return result.stdout.strip().split(";")[0]


def ended(slurm: Slurm, job: str, timeout: float = 240) -> dict[str, str]:
    return wait_for(lambda: (j := slurm.job(job)).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") and j,
                    timeout, f"job {job} to end")  # fmt: skip


def requeued(slurm: Slurm, job: str) -> bool:
    """Back in the queue: a requeued job passes through CANCELLED and COMPLETING on its way to PENDING."""
    state = slurm.job(job)
    return state.get("Restarts") == "1" and state.get("JobState") in ("PENDING", "RUNNING")


def log(out: Path) -> str:
    path = Path(f"{out}.log")
    return path.read_text(errors="replace") if path.exists() else ""


def training(out: Path) -> bool:
    return "'loss':" in log(out)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "run"
    job = ended(slurm, submit(slurm, "ddp", out))
    assert job["JobState"] == "COMPLETED", log(out)[-3000:]
    return out


def test_ddp_trains_across_two_nodes(slurm, uninterrupted):
    """Each node's launcher found the interface toward the head on its own (no GLOO_SOCKET_IFNAME set): before,
    gloo on the second node took the hostname's loopback address and the job died there."""
    text = log(uninterrupted)
    for k in (1, 2):
        assert f"network      node {k - 1} of 2, {slurm.cluster.address(k)} toward the head " in text, text[-3000:]
    assert "GLOO_SOCKET_IFNAME=eth0" in text
    assert "strategy      MULTI_CPU, 2 process(es) on 2 machine(s)" in text
    reports = rank_reports(uninterrupted)
    assert len(reports) == 2 and reports[0]["weights_sha256"] == reports[1]["weights_sha256"]
    assert len(reports[0]["losses"]) == STEPS


def test_a_sharded_config_trains_across_two_nodes(slurm, uninterrupted, tmp_path):
    """FSDP2 with one shard a node: each holds half the weights and optimizer state of the DDP run's ranks, and
    the losses are the DDP run's (the same global batch; reductions in another order round apart)."""
    out = tmp_path / "run"
    job = ended(slurm, submit(slurm, "fsdp2", out))
    assert job["JobState"] == "COMPLETED", log(out)[-3000:]
    reports, replicated = rank_reports(out), rank_reports(uninterrupted)
    assert [r["strategy"]["sharding"] for r in reports] == ["FSDP2 FULL_SHARD"] * 2, reports[0]["strategy"]
    for r in reports:
        for key in ("param_bytes", "optimizer_state_bytes"):
            assert 0.45 <= r[key] / replicated[0][key] <= 0.6, key
        assert r["losses"] == pytest.approx(replicated[0]["losses"], rel=1e-3)


def test_usr1_to_the_batch_script_checkpoints_requeues_and_resumes_exactly(slurm, uninterrupted, tmp_path):
    """SLURM's warning before the time limit (here `scancel --signal=USR1 --batch`): the batch script passes it on,
    every rank writes a checkpoint and exits 75, the job is requeued, and the second start resumes to the
    uninterrupted run's weights."""
    out = tmp_path / "run"
    job = submit(slurm, "ddp", out)
    wait_for(lambda: training(out), 120, "the first step")
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    wait_for(lambda: requeued(slurm, job), 120, f"job {job} requeued\n{log(out)[-3000:]}")
    stopped = int(re.search(r"preempted at step (\d+)", log(out)).group(1))
    assert stopped < STEPS
    state = ended(slurm, job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), (state, log(out)[-3000:])
    assert f"resume auto: continuing from {out / f'checkpoint-{stopped}'}" in log(out)
    full, resumed = rank_reports(uninterrupted), rank_reports(out)
    for a, b in zip(full, resumed, strict=True):
        assert b["losses"] == a["losses"] and b["weights_sha256"] == a["weights_sha256"]


def failed_not_requeued(slurm: Slurm, job: str, out: Path, code: int, fault: str) -> None:
    """The job, after `fault` on the second node, ends within the bound with that node's exit code, the node named
    by srun, and no requeue."""
    lost = time.monotonic()
    ended(slurm, job, timeout=FAULT_BOUND_S)
    print(f"{fault} to the job's end: {time.monotonic() - lost:.1f} s")
    time.sleep(2)  # a requeue would show now
    state = slurm.job(job)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("FAILED", f"{code}:0", "0"), log(out)[-3000:]
    assert f"srun: error: {slurm.cluster.names[1]}: task 1: Exited with exit code {code}" in log(out)  # the node
    assert "requeueing" not in log(out)


def test_a_killed_training_process_ends_the_job_with_its_code_not_requeued(slurm, tmp_path):
    """The second node's training process SIGKILLed mid-run: the job fails with 137, no requeue. Before, the first
    node's launcher, stopped by srun's SIGTERM, exited 75 (preempted) and the batch script requeued the crash."""
    out = tmp_path / "run"
    job = submit(slurm, "ddp", out)
    wait_for(lambda: training(out), 120, "the first step")
    node = slurm.cluster.names[1]
    workers = [p for p in slurm.cluster.pids(2) if "recipes/llama3_fft.py" in p[1] and "-m toolkit" not in p[1]]
    assert workers, f"no training process on {node}"
    os.kill(workers[0][0], signal.SIGKILL)
    failed_not_requeued(slurm, job, out, 137, "killed process")


def test_a_crash_on_one_node_ends_the_job_with_its_code_not_requeued(slurm, tmp_path):
    """The output folder turns read-only on the second node mid-run (its NFS mount failed): its rank dies in a
    traceback at the first checkpoint, exit 1, and so does the job, not requeued. Before, the first node's launcher,
    stopped by srun's SIGTERM, exited 75 (preempted; srun's code is its tasks' highest) and the batch script
    requeued the crash, to fail again."""
    out = tmp_path / "run"
    job = submit(slurm, "ddp", out, "--save_steps", "100")
    wait_for(lambda: training(out), 120, "the first step")
    read_only(slurm.slurmd[1].pid, tmp_path)
    failed_not_requeued(slurm, job, out, 1, "read-only disk")
    assert "Read-only file system" in log(out)


def test_an_output_folder_not_every_node_shares_is_refused_in_one_line(slurm, tmp_path):
    """The second node has a disk of its own where the output folder is: refused on every rank before any weights
    load, exit 2, not requeued. Before, each node kept its own ranks' checkpoint files, and a resume was decided
    by each rank from its own disk."""
    shared = tmp_path / "shared"
    shared.mkdir()
    node_local(slurm.slurmd[1].pid, shared)
    out = shared / "run"
    job = submit(slurm, "ddp", out)
    state = ended(slurm, job)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), log(out)[-3000:]
    errors = [line for line in log(out).splitlines() if line.startswith("error: ")]
    assert errors == [f"error: the output folder {out} is not shared by every node: {slurm.cluster.names[1]} cannot "
                      f"see what rank 0 ({slurm.cluster.names[0]}) wrote there, so checkpoints would be split across "
                      "the nodes' disks and a resume would not hold. Pass an --output_dir on storage every node "
                      "mounts (NFS, a shared volume)."], log(out)[-3000:]  # fmt: skip
    assert not (out / "checkpoint-50").exists()
