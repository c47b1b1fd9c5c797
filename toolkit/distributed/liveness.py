"""A node lost in silence ends a multi-node run within a bound, naming it.

A node that crashes closes its sockets, and its peers' collectives fail at once. One whose link is cut, or that
loses power, says nothing: its peers wait in the collective for the process group's timeout (ddp_timeout, 30
minutes; transformers does not even pass it to a CPU group), and gloo's TCP notices nothing until the kernel gives
up, after about 15 minutes. Measured on the test cluster: a cut link left both nodes waiting, silent, for as long
as anyone watched.

So every rank beats, every BEAT_S, in the run's rendezvous store (the TCPStore on the head that torchrun and Ray
Train already start, over a connection of its own). Rank 0 watches every rank's beat; the others watch that theirs
reach the head. Silence past TOOLKIT_NODE_TIMEOUT_S (LOST_AFTER_S): one `error:` line naming the node, and the
process exits 1, a crash (not requeued, not retried as a preemption), its launcher ending the rest. A rank that
ended on its own (done) is never called lost."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .shared_folder import gathered, multi_node

BEAT_S = 5.0
LOST_AFTER_S = 60.0
LOST_EXIT = 1  # a crash: the engines must not take it for a preemption
KEY = "toolkit/liveness"


def lost_after() -> float:
    return float(os.environ.get("TOOLKIT_NODE_TIMEOUT_S") or LOST_AFTER_S)


class Watch:
    """One rank's beats, and what it watches: every rank's on rank 0, the head's answer elsewhere."""

    def __init__(self, rank: int, world: int, hosts: list[str], head: tuple[str, int]):
        self.rank, self.world, self.hosts, self.head = rank, world, hosts, head
        self.stopped = threading.Event()
        self.store = None
        self.heard = {r: time.monotonic() for r in range(world)}  # rank 0: when each rank's count last moved
        self.counts: dict[int, int] = {}

    def connect(self):
        """A store client of this watch's own: the process group's is busy inside a collective that may hang."""
        host, port = self.head
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=BEAT_S),
                             wait_for_workers=False)  # fmt: skip

    def beat(self) -> bool:
        """This rank's beat; False where the head did not answer."""
        try:
            self.store = self.store or self.connect()
            self.store.add(f"{KEY}/beat/{self.rank}", 1)
            return True
        except Exception:  # noqa: BLE001 - no answer (timeout, refused, reset): a new connection next time
            self.store = None
            return False

    def silent(self) -> int | None:
        """Rank 0: the first rank not heard from for lost_after() and not done, else None."""
        now = time.monotonic()
        for rank in range(1, self.world):
            try:
                if self.store.check([f"{KEY}/done/{rank}"]):
                    self.heard[rank] = now
                    continue
                count = self.store.add(f"{KEY}/beat/{rank}", 0)
            except Exception:  # noqa: BLE001 - its own store: rank 0's own beat failing is reported by run()
                return None
            if count != self.counts.get(rank):
                self.counts[rank], self.heard[rank] = count, now
            elif now - self.heard[rank] > lost_after():
                return rank
        return None

    def run(self) -> None:
        answered = time.monotonic()
        while not self.stopped.wait(BEAT_S):
            now = time.monotonic()
            if self.beat():
                answered = now
                lost = self.silent() if self.rank == 0 else None
                if lost is not None:
                    self.end(f"lost node {self.hosts[lost]} (rank {lost}): not heard from for {lost_after():.0f} s "
                             "(the node or its link is down)")  # fmt: skip
            elif now - answered > lost_after():
                host, port = self.head
                self.end(f"lost the head node {self.hosts[0]} ({host}:{port}): no answer for {lost_after():.0f} s "
                         "(the node or this node's link to it is down)")  # fmt: skip

    def end(self, why: str) -> None:
        if self.stopped.is_set():
            return
        print(f"\nerror: {why}; ending this rank (exit {LOST_EXIT}). Relaunch with --resume auto once every node "
              "is back: the newest complete checkpoint is kept.", file=sys.stderr, flush=True)  # fmt: skip
        os._exit(LOST_EXIT)

    def stop(self) -> None:
        """This rank is done: never called lost, and it calls none lost."""
        self.stopped.set()
        try:
            (self.store or self.connect()).set(f"{KEY}/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the head already gone: nobody is left to watch for this rank
            pass


_watch: Watch | None = None


def start() -> None:
    """Beats and watching for this rank of a multi-node run (a no-op on one machine)."""
    global _watch
    if _watch is not None or not multi_node():
        return
    hosts = gathered(socket.gethostname())
    head = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    _watch = Watch(dist.get_rank(), dist.get_world_size(), hosts, head)
    threading.Thread(target=_watch.run, name="toolkit-liveness", daemon=True).start()


def stop() -> None:
    """This rank ended (trained, stopped, or refused), whatever its peers do next."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None
