"""The network a multi-node launch runs over, checked on each node before its processes start: the head resolves
within seconds to an address other nodes can reach, answers (nodes other than the head's), and gloo and NCCL are
told which interface leads to it.

Why: gloo takes its own address from this host's name unless GLOO_SOCKET_IFNAME names an interface, and where the
name resolves to loopback (Debian's /etc/hosts maps it to 127.0.1.1, containers' often to 127.0.0.1) it tells the
other nodes to connect to 127.0.0.1: the job dies in a traceback on one node, or hangs. A head name that does not
resolve has c10d print a warning a second and never give up. The interface chosen is the one this host would send
to the head from (the route toward it; the head's own address on the head), named unless the user set it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import ConfigError

RESOLVE_TIMEOUT_S = 10.0
HEAD_TIMEOUT_S = 300.0  # how long a node waits for the head's launch to listen (TOOLKIT_HEAD_TIMEOUT_S)
SOCKET_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT_S) -> str:
    """host's IPv4 address, or one line saying it does not resolve (a resolver that hangs counts as no answer)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        infos = pool.submit(socket.getaddrinfo, host, None, socket.AF_INET, socket.SOCK_STREAM).result(timeout)
    except (OSError, concurrent.futures.TimeoutError) as error:
        why = "no answer" if isinstance(error, concurrent.futures.TimeoutError) else str(error)
        raise ConfigError(
            f"the head node {host!r} does not resolve on {socket.gethostname()} ({why}): pass --main_process_ip as "
            "an address, or a name every node resolves (SLURM's node names need DNS or /etc/hosts on each node)."
        ) from None
    finally:
        pool.shutdown(wait=False)
    return infos[0][4][0]


def local_interface(address: str) -> tuple[str, str]:
    """(interface, this host's address on it) that packets to `address` leave from."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP: no packet is sent; the kernel picks the route and source address
        source = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addresses):
            return name, source
    raise ConfigError(f"no interface holds {source}, this host's address toward {address}: set GLOO_SOCKET_IFNAME.")


def wait_for_head(address: str, port: int, timeout: float) -> None:
    """Until the head's rendezvous port accepts a connection; one line naming it after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=5):
                return
        except OSError as error:
            if time.monotonic() > end:
                loopback = " (a loopback address here: does this node's /etc/hosts give the head's name as its own?)"
                raise ConfigError(
                    f"the head node {address}:{port} did not answer within {timeout:.0f} s ({error})"
                    f"{loopback if ipaddress.ip_address(address).is_loopback else ''}: is node 0's launch running, and "
                    "the port open between the nodes? (TOOLKIT_HEAD_TIMEOUT_S waits longer)"
                ) from None
        time.sleep(1)


def own_interface() -> tuple[str, str]:
    """(interface, address) other nodes reach this host by, where its own name gives loopback: the default route's
    interface, else the one interface up with an IPv4 address other than loopback; one line naming
    GLOO_SOCKET_IFNAME where that is not one."""
    import psutil

    addresses = {name: [a.address for a in found if a.family == socket.AF_INET and not a.address.startswith("127.")]
                 for name, found in psutil.net_if_addrs().items()}  # fmt: skip
    stats = psutil.net_if_stats()
    up = [name for name, found in addresses.items() if found and name in stats and stats[name].isup]
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            name, destination = line.split()[:2]
            if destination == "00000000" and name in up:
                return name, addresses[name][0]
    if len(up) == 1:
        return up[0], addresses[up[0]][0]
    if not up:  # no network: the job's nodes can only be this host's (a test of several nodes on one machine)
        return "lo", "127.0.0.1"
    raise ConfigError(
        f"this host's name gives loopback, and of its interfaces ({', '.join(up)}) none is the default "
        "route's: set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the one the other nodes reach it by."
    )


def prepare(head: str | None, port: int, nodes: int, machine_rank: int) -> None:
    """A node of a multi-node launch: the head resolved and reachable, GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
    set to the interface toward it (unless set), said on one line; nothing for a one-node launch."""
    if nodes <= 1:
        return
    if not head:
        raise ConfigError(f"a launch on {nodes} machines needs --main_process_ip, the head node's address.")
    address = resolve(head)
    unset = [v for v in SOCKET_VARIABLES if not os.environ.get(v)]
    if ipaddress.ip_address(address).is_loopback and machine_rank == 0:
        # the head's own name, as Debian's /etc/hosts maps it (127.0.1.1): its interface toward the others
        interface, source = own_interface() if unset else (os.environ[SOCKET_VARIABLES[0]], address)
    else:  # on a node that resolves the head to loopback, only nodes of this one host can meet (wait_for_head)
        interface, source = local_interface(address)
    for variable in unset:
        os.environ[variable] = interface
    said = ", ".join(f"{v}={os.environ[v]}" for v in SOCKET_VARIABLES)
    print(f"network      node {machine_rank} of {nodes}, {source} toward the head {head}:{port}; {said}",
          file=sys.stderr, flush=True)  # fmt: skip
    if machine_rank > 0:
        wait_for_head(address, port, float(os.environ.get("TOOLKIT_HEAD_TIMEOUT_S", HEAD_TIMEOUT_S)))
