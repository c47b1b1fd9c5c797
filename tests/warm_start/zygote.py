"""The suite's warm start for launches: one process per test worker imports the Trainer stack once, then forks a
copy of itself for each launcher (`accelerate launch`, `python -m toolkit launch`) and each rank that torchrun starts
for a recipe; the copy runs it as the process would have, in its working directory, environment and streams.

Why: a tiny launch spends most of its CPU importing torch, transformers, peft and datasets, in the launcher and in
every rank (~4 of a rank's ~5.5 CPU-s, docs/benchmarks.md), and the suite launches ~90 times. The launcher, torchrun
and the rank processes stay real; only the import is shared. Each such process (sitecustomize.py in this folder, run
by Python before anything else) hands over its arguments, environment and streams, forwards the signals it gets
(preemption's SIGTERM and SIGUSR1, torchrun's to its ranks) and exits as the copy exits. One whose environment
differs from this process's in a variable read at import time (HF_HUB_OFFLINE, WANDB_MODE, the CPU kernel caps, ...)
starts cold, as do single-process runs of a recipe (the demos) and every other command: what they import is then
what a user's process imports. What forked copies share that cold ones would not: the string hash seed and numpy's
global random state (the runs seed what they draw), and pages of memory, which is why the test that measures a
rank's PSS launches cold.

    python tests/warm_start/zygote.py SOCKET   # the suite's conftest starts it; it ends when its stdin closes
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import threading

# Environment variables read when the stack is imported (by torch, transformers, huggingface_hub, datasets, the C
# runtimes; WANDB_MODE by transformers' W&B integration, wandb itself being imported by the run): a rank whose values
# differ starts cold. Everything else (RANK, MASTER_PORT, ACCELERATE_*, FSDP_*, TOOLKIT_*, SLURM_*, WANDB_DIR, PATH,
# ...) is read at run time, by the run itself.
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "WANDB_MODE", "TORCH_", "PYTORCH_",
               "USE_", "ATEN_", "ONEDNN_", "DNNL_", "MKL", "OMP_", "KMP_", "GOMP_", "OPENBLAS", "PYTHON", "LD_",
               "LC_", "LANG", "HOME", "XDG_", "TMPDIR", "CUDA", "BNB_")  # fmt: skip
# KMP_DUPLICATE_LIB_OK: Intel's OpenMP reads it as it loads (torch's CPU wheel loads GNU's); scikit-learn sets it in
# the suite's process when a test imports it. PYTHONPATH: the rank's own entries are put in place (become).
RUN_TIME = ("TORCH_NCCL_", "TORCH_ELASTIC_", "PYTORCH_NVML_BASED_CUDA_CHECK", "KMP_DUPLICATE_LIB_OK",
            "PYTHONUNBUFFERED", "PYTHONPATH")  # fmt: skip


def import_time(key: str) -> bool:
    return key.startswith(IMPORT_TIME) and not key.startswith(RUN_TIME)


def differs(env: dict[str, str]) -> str | None:
    """The first import-time variable whose value the asking process does not share with this one, if any."""
    for key in sorted(set(env) | set(os.environ)):
        if import_time(key) and env.get(key) != os.environ.get(key):
            return key
    return None


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
    (size,) = struct.unpack("!I", header)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return json.loads(body), fds


def serve(path: str) -> tuple[socket.socket, dict, list[int]]:
    """Answer requests until stdin closes (then exit); return only in a forked copy, with its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: dict[int, socket.socket] = {}  # pid -> its asker's connection, for the exit status
    while True:
        ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return sys.exit(0)
        if wake_r in ready:
            os.read(wake_r, 512)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = running.pop(pid)
            try:
                conn.sendall(f"exit {status}\n".encode())
            except OSError:
                pass  # the process that asked is gone (killed): nothing to tell
            conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = receive(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        key = differs(request["env"])
        print(*(["cold", request["argv"][0], key] if key else ["warm", request["argv"][0]]), flush=True)  # the log
        if key is not None:
            conn.sendall(f"cold {key}\n".encode())
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for other in (listener, *running.values()):
                other.close()
            os.close(wake_r)
            os.close(wake_w)
            return conn, request, fds
        for fd in fds:
            os.close(fd)
        running[pid] = conn
        conn.sendall(f"ok {pid}\n".encode())


def entries(env) -> tuple[str, ...]:
    return tuple(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)


def become(conn: socket.socket, request: dict, fds: list[int]) -> list[str]:
    """Turn this copy into the process that asked: its streams, directory, environment and arguments."""
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    # PYTHONPATH's entries follow the script's folder (accelerate adds its working directory for DeepSpeed's ranks)
    ours = entries(os.environ)
    os.chdir(request["cwd"])
    theirs = entries(request["env"])  # made absolute from the rank's directory, as its interpreter would
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.argv = argv[1:] if argv[0] == "-m" else argv  # -m: runpy puts the module's path first
    sys.path[0] = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    if tuple(sys.path[1 : 1 + len(ours)]) == ours:
        sys.path[1 : 1 + len(ours)] = theirs

    def orphaned() -> None:  # the process that asked died (SIGKILL, a timeout): so does its copy
        while conn.recv(1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=orphaned, daemon=True).start()
    return argv


if __name__ == "__main__":
    from toolkit.startup import heavy_imports

    with heavy_imports():
        import toolkit.runner  # noqa: F401  # what a recipe's first line imports, ~4 CPU-s

    import runpy

    argv = become(*serve(sys.argv[1]))
    if argv[0] == "-m":
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")
