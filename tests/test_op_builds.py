"""A lock left by a killed op build is removed; a lock a live build holds, or one on a shared disk, is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from toolkit.distributed import op_builds

HOLD = """
import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()  # what torch's JIT build does first
print("held", flush=True)
time.sleep(600)
"""


def test_lock_of_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, capsys):
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    builder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline() == "held\n"
        assert op_builds.clear_stale_locks(tmp_path) == []
        assert lock.exists()
    finally:
        builder.send_signal(signal.SIGKILL)  # killed mid-build: the file stays, nobody holds it
        builder.wait()
    assert lock.exists()
    assert op_builds.clear_stale_locks(tmp_path) == [lock]
    assert not lock.exists()
    assert "removed" in capsys.readouterr().err
    assert op_builds.clear_stale_locks(tmp_path) == []


def test_lock_on_a_shared_file_system_is_only_reported(tmp_path, capsys, monkeypatch):
    """Another machine may be building into a shared folder: its lock is open there, not here."""
    lock = tmp_path / "py311_cu124" / "cpu_adam" / "lock"  # torch's default layout: <root>/<python_accel>/<op>
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setattr(op_builds, "filesystem_type", lambda path: "nfs4")
    assert op_builds.clear_stale_locks(tmp_path) == []
    assert lock.exists()
    assert f"`rm {lock}`" in capsys.readouterr().err


def test_filesystem_type_reads_the_mount_table(tmp_path):
    assert op_builds.filesystem_type(tmp_path / "missing") != ""
    assert op_builds.filesystem_type(Path("/proc/self")) == "proc"


def test_install_built_the_cpu_ops_in_the_environment(monkeypatch, capsys):
    """`make install` ran `python -m toolkit build-ops`: DeepSpeed's CPU ops are in this environment's folder, so no
    launch builds them (65 s and 83 s on 2 cores); run again, it loads them. With CUDA it leaves them to first use."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert op_builds.build_main([]) == 0
    out = capsys.readouterr().out
    folder = Path(sys.prefix) / "torch_extensions"
    assert f"deepspeed.ops.adam.cpu_adam_op built in {folder / 'cpu_adam'}" in out
    assert list((folder / "cpu_adam").glob("*.so")) and list((folder / "deepspeed_shm_comm").glob("*.so"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert op_builds.build_main([]) == 0
    assert "a CUDA machine: DeepSpeed builds its ops when first used" in capsys.readouterr().out


def test_deepspeed_counts_the_local_processes_without_a_subprocess(monkeypatch):
    """A rank tells DeepSpeed's CPU accelerator how many processes share its node (LOCAL_SIZE, which DeepSpeed's own
    launcher sets and torchrun does not). Without it every count forked `numactl --hardware` from the rank: ~1,100
    times in 2 ZeRO-3 steps of SmolLM2-135M on 2 processes (counted with strace), once per gradient reduction."""
    import subprocess

    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from toolkit.distributed.launch import tell_deepspeed_the_local_processes

    def forked(*args, **kwargs):
        raise AssertionError(f"DeepSpeed ran {args[0]}")

    monkeypatch.setattr(subprocess, "check_output", forked)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as torchrun gives each rank
    tell_deepspeed_the_local_processes()
    assert CPU_Accelerator().device_count() == 2


def test_builds_run_the_environments_own_ninja(monkeypatch):
    """Whatever PATH a run starts with, torch's builds find this environment's ninja first (a log another ninja
    version wrote made every op build again from scratch: 70 s for CPU Adam)."""
    import shutil
    import sys

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    op_builds.use_environment_folder()
    own = Path(sys.executable).parent / "ninja"
    if own.is_file():
        assert shutil.which("ninja") == str(own)
    op_builds.use_environment_folder()  # once on PATH is enough
    assert os.environ["PATH"].count(str(own.parent)) == (1 if own.is_file() else 0)
