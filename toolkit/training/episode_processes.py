"""The processes an environment's episodes play in (environments.py): each episode a fork of the class's one
instance, made by a small process of its own (Spawner), itself forked from the training process once, at the first
episode (the trial one, before the weights load).

Why not fork each episode from the training process: a fork shares the parent's every page as it was, and keeps
it alive while the episode lives; the training process, mid-step, holds gigabytes (the sampler's buffers, the
allocator's freed memory) that it then writes again, each page written copied for it while an episode pins the
old one. SmolLM2-135M's shop demo reached 23 of 24 GiB that way (16 episodes a step, each pinning the sampler's
14 GB); forked from the spawner, an episode shares only what the process held before the model loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import multiprocessing
import os
import signal
import threading
import typing
import weakref
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle, send_handle

from .tools import ended, exit_text, tool_text

# The training process's ends of the live episodes' and spawners' pipes (weakly: an episode's handle dropped closes
# its end, and its process, reading the end of its pipe, exits); a process forked from it closes them all
OPEN: weakref.WeakSet = weakref.WeakSet()


def serve(instance, connection, shapes: dict[str, Callable]) -> None:
    """The episode's process: each (method, arguments) received is called on its copy of the instance (or on the
    one it builds, given the class), and its result (shaped by `shapes`, or tool_text for a tool) or error sent
    back, until the training process's end closes (it stopped the episode, or ended)."""
    die_with_parent()
    built = None
    if isinstance(instance, type):
        try:
            instance = instance()
        except BaseException as error:  # said at each call: the episode cannot be played
            built = f"{type(error).__name__} in {instance.__name__}(): {error}"
    while True:
        try:
            name, kwargs = connection.recv()
        except (EOFError, OSError):
            return
        try:
            if built:
                raise RuntimeError(built)
            value = getattr(instance, name)(**kwargs)
            if inspect.iscoroutine(value):  # an async method, awaited here as TRL's event loop would
                value = asyncio.run(value)
            connection.send(("ok", shapes.get(name, tool_text)(value)))
        except BaseException as error:  # the environment's failure, reported to the parent as its result
            connection.send(("error", f"{type(error).__name__}: {error}"))


def die_with_parent() -> None:
    """The signals' own actions (the training process's handlers, inherited, would make a SIGTERM at its exit a
    flag no one reads); and, on Linux, this process killed when its parent ends, even where a call of the
    environment's never returns to read its pipe's end (prctl PR_SET_PDEATHSIG)."""
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(number, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def exit_words(status: int) -> str:
    """A waited-for process's end, in words (os.waitpid's status)."""
    return exit_text(os.waitstatus_to_exitcode(status))


def spawner(instance, control: Connection, shapes: dict) -> None:
    """The spawner's loop: ("episode", None) forks an episode and answers its pid, then sends its pipe's end over
    the socket; ("ended", pid) answers how that episode's process ended. Ended episodes are reaped at each request
    (their ends kept for a while, for the training process to ask)."""
    die_with_parent()
    ended: OrderedDict[int, str] = OrderedDict()
    while True:
        with contextlib.suppress(ChildProcessError):
            while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
                ended[reaped[0]] = exit_words(reaped[1])
                while len(ended) > 4096:
                    ended.popitem(last=False)
        try:
            kind, pid = control.recv()
        except (EOFError, OSError):
            os._exit(0)  # its episodes end with it (PR_SET_PDEATHSIG; elsewhere at their pipes' end)
        if kind == "ended":
            control.send(ended.pop(pid) if pid in ended else exit_words(os.waitpid(pid, 0)[1]))
            continue
        ours, theirs = multiprocessing.Pipe()
        pid = os.fork()
        if pid == 0:
            control.close()
            ours.close()
            try:
                serve(instance, theirs, shapes)
            finally:
                os._exit(0)
        theirs.close()
        control.send(pid)
        send_handle(control, ours.fileno(), os.getppid())
        ours.close()


def spawned(instance, control: Connection, parents: Connection, shapes: dict) -> None:
    """The spawner's process: the training process's ends it inherited (episodes' and spawners' pipes, and its own
    pipe's) closed first, since held here they would keep those pipes from ever seeing that end close."""
    for other in (*OPEN, parents):
        other.close()
    spawner(instance, control, shapes)


class Spawner:
    """The process a class's episodes are forked from, holding its one instance (or the class, for episodes that
    build their own); requests from several threads take turns."""

    def __init__(self, instance, shapes: dict[str, Callable]) -> None:
        with contextlib.suppress(Exception):  # glibc: the heap's freed memory given back, not shared with the fork
            ctypes.CDLL(None).malloc_trim(0)  # (a spawner started after training, for its held-out episodes)
        context = multiprocessing.get_context("fork")
        self.control, theirs = context.Pipe()
        self.process = context.Process(target=spawned, args=(instance, theirs, self.control, shapes), daemon=True)
        self.process.start()
        theirs.close()
        OPEN.add(self.control)
        self.lock = threading.Lock()

    def episode(self) -> tuple[Connection, int]:
        """A new episode's process: the pipe to it and its pid."""
        with self.lock:
            try:
                self.control.send(("episode", None))
                pid = self.control.recv()
                connection = Connection(recv_handle(self.control))
            except (EOFError, OSError):
                self.process.join(timeout=5)
                raise RuntimeError(f"the process its episodes are forked from ended ({ended(self.process)})") from None
        OPEN.add(connection)
        return connection, pid

    def ended(self, pid: int) -> str:
        """How an episode's process ended (its pipe has closed), in words."""
        with self.lock:
            self.control.send(("ended", pid))
            return self.control.recv()

    def close(self) -> None:
        OPEN.discard(self.control)
        self.control.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Episode:
    """One episode's process (forked by the spawner from the class's instance) and the pipe to it."""

    def __init__(self, spawner: Spawner) -> None:
        self.spawner = spawner
        self.connection, self.pid = spawner.episode()
        self.stopped: str | None = None  # why the episode was stopped early, if it was

    def call(self, name: str, kwargs: dict, seconds: float):
        """`name(**kwargs)` in the episode's process, within `seconds`: its result, or RuntimeError/TimeoutError
        (the episode stopped where it hung or died)."""
        if self.stopped:
            raise RuntimeError(f"this episode's environment was stopped earlier ({self.stopped})")
        try:
            self.connection.send((name, kwargs))
        except OSError:  # its process died between calls (a broken pipe): as when it dies in one, below
            self.died(name)
        if not wait([self.connection], timeout=seconds):
            self.stop(f"{name} gave no result within {seconds:g} s")
            raise TimeoutError(f"no result within {seconds:g} s (--tool_timeout): stopped")
        try:  # a result, perhaps sent just before the process ended; else the end of a pipe whose process died
            status, value = self.connection.recv()
        except EOFError:
            self.died(name)
        if status == "error":
            raise RuntimeError(value)
        return value

    def died(self, name: str) -> typing.NoReturn:
        """The episode stopped as its process is found dead during `name`'s call: how it ended, as an error."""
        how = self.spawner.ended(self.pid)
        self.stop(f"its process died ({how}) in {name}", dead=True)
        raise RuntimeError(f"the environment's process died ({how}) before {name} answered")

    def stop(self, why: str = "ended", dead: bool = False) -> None:
        """Kill the episode's process (unless it is known dead: its pid may have been reaped) and close its pipe."""
        if not (dead or self.connection.closed):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.stopped = self.stopped or why
        OPEN.discard(self.connection)
        self.connection.close()
