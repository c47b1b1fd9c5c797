"""What a node of a multi-node launch checks of the network before its processes start (toolkit/distributed/
network.py), and the launcher's exit code when it is stopped. The real thing, across network namespaces with their
own hostnames: tests/test_cluster_slurm.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import BIN, ROOT, free_port, run_cmd

from toolkit.distributed import network
from toolkit.distributed.launcher import signalled_exit
from toolkit.errors import PREEMPTED, ConfigError


def test_a_head_that_does_not_resolve_is_one_line_in_seconds(tmp_path):
    """Before, c10d printed a warning a second and nothing ended it."""
    start = time.monotonic()
    result = run_cmd([str(BIN / "python"), "-m", "toolkit", "launch", "--config_file", "accelerate_configs/ddp.yaml",
                      "--num_machines", "2", "--num_processes", "2", "--machine_rank", "1", "--main_process_ip",
                      "no-such-node.invalid", str(ROOT / "recipes" / "llama3_fft.py"), "--tiny"], cwd=ROOT,
                     timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: the head node 'no-such-node.invalid' does not resolve on {os.uname().nodename} "
        f"({result.stderr.split('(', 1)[1].split(')', 1)[0]}): pass --main_process_ip as an address, or a name every "
        "node resolves (SLURM's node names need DNS or /etc/hosts on each node)."
    ]
    assert time.monotonic() - start < 60


def test_a_head_that_is_loopback_on_another_node_waits_then_says_so(monkeypatch):
    """A node other than the head that resolves the head's name to loopback reaches only this host: the nodes of
    a test on one machine meet there, other hosts' do not, and the wait for the head ends in one line saying why."""
    for variable in network.SOCKET_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TOOLKIT_HEAD_TIMEOUT_S", "2")
    with pytest.raises(ConfigError, match=r"did not answer within 2 s .*\(a loopback address here: does this node's"):
        network.prepare("localhost", free_port(), nodes=2, machine_rank=1)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    for variable in network.SOCKET_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    network.prepare("localhost", 29500, nodes=1, machine_rank=0)  # one node: nothing to check, nothing set
    assert not any(os.environ.get(v) for v in network.SOCKET_VARIABLES)


def test_the_interface_is_the_one_toward_the_head(monkeypatch, capsys):
    """Toward an address of this host's own, the interface holding it, named for gloo and NCCL unless set."""
    import psutil

    interface, address = next((name, a.address) for name, found in psutil.net_if_addrs().items() for a in found
                              if a.family == 2 and not a.address.startswith("127."))  # fmt: skip
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's own choice stays
    network.prepare(address, 29500, nodes=2, machine_rank=0)
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == (interface, "ib0")
    assert f"{address} toward the head {address}:29500; GLOO_SOCKET_IFNAME={interface}" in capsys.readouterr().err


def test_a_head_that_does_not_answer_is_one_line_after_its_timeout():
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"did not answer within 2 s .*TOOLKIT_HEAD_TIMEOUT_S"):
        network.wait_for_head("127.0.0.1", free_port(), 2)
    assert 2 <= time.monotonic() - start < 10


def test_a_stopped_launcher_says_preempted_only_where_every_process_saved(tmp_path, capsys):
    """75 (requeue, resume) only where each of this node's processes wrote its checkpoint; a launcher stopped
    because a peer failed (srun's SIGTERM to the other nodes) ends with 1, below any crash's code."""
    assert signalled_exit(signal.SIGTERM, tmp_path, 2) == 1
    assert "before this node's processes wrote a checkpoint (0 of 2)" in capsys.readouterr().err
    (tmp_path / "rank-0").touch()
    assert signalled_exit(signal.SIGUSR1, tmp_path, 2) == 1
    (tmp_path / "rank-1").touch()
    assert signalled_exit(signal.SIGUSR1, tmp_path, 2) == PREEMPTED
    assert signalled_exit(signal.SIGINT, tmp_path, 2) == 128 + signal.SIGINT


def test_two_nodes_writing_one_cache_entry_never_share_a_scratch_folder(tmp_path):
    """The cache (tiny models, prepared data) is shared by every node of a job, and another machine's process can
    have this one's PID. Before, the scratch folder was named by the PID alone: a second node writing the same
    entry meanwhile wrote into the first one's folder and renamed it away half-written (a Ray worker then found
    the tiny model without its config.json)."""
    from toolkit.models.tiny_data import save_atomically

    path = tmp_path / "model"

    def this_node(scratch):
        scratch.mkdir()
        (scratch / "weights").write_text("w")
        save_atomically(path, other_node)  # the other node, same PID, writes the same entry meanwhile
        (scratch / "config.json").write_text("{}")

    def other_node(scratch):
        scratch.mkdir(exist_ok=True)
        (scratch / "weights").write_text("w")
        (scratch / "config.json").write_text("{}")

    save_atomically(path, this_node)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "weights"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no scratch folder left behind


def tiny_model_on(rank: int, store: str, cache: str, found: dict) -> None:
    """One of 2 processes of a group that exists before the run (a Ray worker's): rank 1 asks for the tiny model
    first, rank 0 a moment later."""
    import torch.distributed as dist

    os.environ["TOOLKIT_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from toolkit.models.tiny import tiny_checkpoint

    if rank == 0:
        time.sleep(3)
    path = tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft")
    found[rank] = sorted(p.name for p in path.iterdir())
    dist.barrier()
    dist.destroy_process_group()


def test_the_tiny_model_of_a_hosted_process_group_is_written_whole(tmp_path):
    """transformers' save_pretrained writes only on rank 0 once a process group exists: before, rank 1's scratch
    folder held the tokenizer alone, and renamed into place first it stood for the model (config.json missing)."""
    import torch.multiprocessing as mp

    found = mp.Manager().dict()
    mp.spawn(tiny_model_on, args=(str(tmp_path / "store"), str(tmp_path / "cache"), found), nprocs=2)
    assert found[0] == found[1] and {"config.json", "model.safetensors"} <= set(found[1]), dict(found)


def resume_points_on(rank: int, store: str, points: list, found: dict) -> None:
    """One process of a 2-node job (one process a node) whose ranks found `points[rank]` to resume from."""
    import torch.distributed as dist

    from toolkit.distributed.shared_folder import check_agreed

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        check_agreed(points[rank], "/shared/run")
        found[rank] = "agreed"
    except ConfigError as error:
        found[rank] = str(error)
    dist.destroy_process_group()


@pytest.mark.parametrize("points", [["/shared/run/checkpoint-8"] * 2, ["/shared/run/checkpoint-8", None]])
def test_every_rank_resumes_from_the_same_checkpoint_or_none_starts(points, tmp_path):
    """`--resume auto` is decided by each rank from what it sees: ranks that found different checkpoints (one
    still being written, one copied in by hand) stop with the same line, never start from different steps."""
    import torch.multiprocessing as mp

    found = mp.Manager().dict()
    mp.spawn(resume_points_on, args=(str(tmp_path / "store"), points, found), nprocs=2)
    if points[0] == points[1]:
        assert dict(found) == {0: "agreed", 1: "agreed"}
    else:
        assert found[0] == found[1] == ("the ranks see different checkpoints in /shared/run (rank 0: "
                                        "/shared/run/checkpoint-8, rank 1: none): is a checkpoint still being written, "
                                        "or copied in by hand? Relaunch once it is complete.")  # fmt: skip


def test_rank_zero_names_the_first_rank_gone_silent_and_never_one_that_is_done(monkeypatch):
    """liveness.Watch over a real TCPStore: a rank whose beats stop is lost once TOOLKIT_NODE_TIMEOUT_S passes (not
    before); one that said it is done never is. The cut link itself: tests/test_cluster_nodes.py."""
    from datetime import timedelta

    import torch.distributed as dist

    from toolkit.distributed import liveness

    monkeypatch.setenv("TOOLKIT_NODE_TIMEOUT_S", "0.5")
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    hosts = ["n1", "n2", "n3"]
    zero, one, two = (liveness.Watch(rank, 3, hosts, ("127.0.0.1", port)) for rank in range(3))
    assert all(w.beat() for w in (zero, one, two))
    assert zero.silent() is None
    time.sleep(0.3)
    assert zero.beat() and one.beat() and zero.silent() is None  # rank 2 silent for 0.3 s: not yet
    time.sleep(0.3)
    assert zero.beat() and one.beat() and zero.silent() == 2
    two.stop()
    assert zero.silent() is None  # done, not lost
    time.sleep(0.6)
    assert zero.silent() == 1  # the one still expected, silent past the bound
    assert not liveness.Watch(1, 3, hosts, ("127.0.0.1", free_port())).beat()  # no head: no answer
    del server
