"""Run by Python at the start of every process the suite starts (PYTHONPATH holds this folder): a launcher
(`accelerate launch ...`, `python -m toolkit launch ...`) and each rank torchrun starts for a recipe
(`python -u recipes/NAME.py ...`) ask the worker's warm process (zygote.py) to run them in a forked copy, forward the
signals they get, and exit as the copy did. Anything else, or any failure to hand over, goes on as a cold start:
this file then changed nothing."""

import os
import sys


def _request() -> list[str] | None:
    """What to run warm (a script or `-m MODULE`, with its arguments), for a launcher or a rank of a recipe."""
    if not os.environ.get("TOOLKIT_TEST_ZYGOTE"):
        return None
    argv = sys.orig_argv[1:]
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank: its recipe
        recipe = argv[:1] and argv[0].endswith(".py") and os.path.basename(os.path.dirname(argv[0])) == "recipes"
        return argv if recipe else None
    if argv[:2] == ["-m", "toolkit"] and argv[2:3] == ["launch"]:
        return argv
    if argv[:1] and os.path.basename(argv[0]) == "accelerate" and argv[1:2] == ["launch"]:
        return argv
    return None


def _line(conn) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise EOFError("the warm process closed the connection")
        data += chunk
    return data.decode().strip()


def _hand_over(argv: list[str]) -> None:
    import json
    import signal
    import socket
    import struct

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.environ["TOOLKIT_TEST_ZYGOTE"])
        body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
        conn.sendall(body)
        answer, _, rest = _line(conn).partition(" ")
    except (OSError, EOFError):
        conn.close()
        return  # no warm process (not started yet, or gone): a cold start
    if answer != "ok":
        conn.close()
        return
    pid = int(rest)

    def forward(signum, _frame):
        os.kill(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    try:
        status = int(_line(conn).removeprefix("exit "))
    except (OSError, EOFError, ValueError):
        os._exit(70)  # the warm process died under the rank: an internal error, as sysexits.h names it
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: die of the same one, so torchrun reports what it would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


_argv = _request()
if _argv is not None:
    _hand_over(_argv)
del _argv
