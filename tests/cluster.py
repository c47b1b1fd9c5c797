"""A cluster on this one machine, for the tests of what crosses a network: nodes as network namespaces, each with
its own IP on `eth0`, its own hostname (a UTS namespace) and /etc/hosts (a mount namespace), the disk shared as
NFS would share it; and real engines on them (SLURM's slurmctld, one slurmd per node, munge).

Everything made here is named by the cluster's prefix and torn down by name and PID, also after a failed test; a
cluster left by a killed run (its namespaces, bridge) is cleared when the next one with the same prefix starts;
nothing outside them changes. Needs root, `ip` and `unshare`; SLURM needs Debian's slurm-wlm and munge (`make
install` brings them as root). Where that is missing the tests skip with one line, and fail under CI, which must
run them.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest


def unavailable(reason: str):
    """Skip with one line; under CI (which must run these tests) fail instead."""
    if os.environ.get("CI"):
        pytest.fail(f"the multi-node tests cannot run here: {reason}", pytrace=False)
    pytest.skip(f"the multi-node tests need {reason}")


def engine_env() -> dict[str, str]:
    """This environment as an engine's processes get it: cold. The suite's warm start (warm_start/) hands a
    `toolkit launch` to a process forked in this machine's own namespaces: a node's launcher or driver would run
    outside its node (a Ray driver then found no raylet in its /tmp/ray)."""
    return {k: v for k, v in os.environ.items() if k != "TOOLKIT_TEST_ZYGOTE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


class Cluster:
    """`nodes` nodes named {prefix}1..N at 10.78.{subnet}.1..N behind a bridge at .254 in this namespace."""

    def __init__(self, prefix: str, subnet: int, nodes: int = 2):
        self.prefix, self.subnet, self.count = prefix, subnet, nodes
        self.bridge = f"{prefix}br"
        self.names = [f"{prefix}{k}" for k in range(1, nodes + 1)]
        self.processes: list[subprocess.Popen] = []
        self.cleanups: list = []  # what else to remove at teardown

    def address(self, k: int) -> str:
        """Node k's address (1-based); 254 is this namespace's, on the bridge."""
        return f"10.78.{self.subnet}.{k}"

    def up(self) -> Cluster:
        if os.geteuid() != 0:
            unavailable("root (network namespaces, a bridge, mounts)")
        for tool in ("ip", "unshare"):
            if not shutil.which(tool):
                unavailable(f"`{tool}` (Debian's iproute2, util-linux)")
        self.down()  # what a killed run left
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
        except subprocess.CalledProcessError as error:
            unavailable(f"network namespaces and bridges ({error.stderr.strip()})")
        sh("ip", "addr", "add", f"{self.address(254)}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for k, name in enumerate(self.names, 1):
            host, peer = f"{self.prefix}v{k}", f"{self.prefix}p{k}"
            sh("ip", "netns", "add", name)
            sh("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            sh("ip", "link", "set", host, "master", self.bridge)
            sh("ip", "link", "set", host, "up")
            sh("ip", "link", "set", peer, "netns", name)
            sh("ip", "-n", name, "link", "set", peer, "name", "eth0")
            sh("ip", "-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
        self.hosts = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-hosts-"))
        self.hosts.chmod(0o755)
        self.cleanups.append(lambda: shutil.rmtree(self.hosts, ignore_errors=True))
        nodes = "".join(f"{self.address(k)} {name}\n" for k, name in enumerate(self.names, 1))
        for name in self.names:  # Debian's own line first: a node's name is loopback to itself
            (self.hosts / name).write_text(f"127.0.0.1 localhost\n127.0.1.1 {name}\n{nodes}")
        return self

    def mount_point(self, path: str) -> None:
        """An empty folder at `path` for the nodes' mounts (a pod's volume, a VM's bucket), removed at teardown
        where this made it; nothing is mounted on it outside the nodes."""
        if not Path(path).exists():
            Path(path).mkdir()
            self.cleanups.append(lambda: Path(path).rmdir())

    def alias(self, name: str, k: int) -> None:
        """`name` resolves to node k's address on every node (a Service's DNS name for a pod, say)."""
        for node in self.names:
            with open(self.hosts / node, "a") as hosts:  # in place: the nodes' bind mounts see it
                hosts.write(f"{self.address(k)} {name}\n")

    def argv(self, k: int, argv: list[str], binds: dict[str, Path] | None = None) -> list[str]:
        """argv run on node k: in its network namespace, with its own hostname and /etc/hosts (a mount namespace),
        which maps its own name to 127.0.1.1 as Debian's installer writes it, and the other nodes' to their
        addresses; `binds` (path: this node's own folder for it) are its node-local disks."""
        name = self.names[k - 1]
        mounts = {"/etc/hosts": self.hosts / name, **(binds or {})}
        script = " && ".join([f'hostname "{name}"', *(f"mount --bind {shlex.quote(str(own))} {shlex.quote(path)}"
                                                       for path, own in mounts.items()), 'exec "$@"'])  # fmt: skip
        return ["ip", "netns", "exec", name, "unshare", "--uts", "--mount", "--", "sh", "-c", script, name, *argv]

    def start(self, argv: list[str], log: Path, **kwargs) -> subprocess.Popen:
        """A daemon (in the foreground), ended by PID at teardown; its output in `log`."""
        with open(log, "ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def pids(self, k: int) -> list[tuple[int, str]]:
        """(pid, command line) of every process in node k's namespace."""
        found = []
        for pid in sh("ip", "netns", "pids", self.names[k - 1], check=False).stdout.split():
            with contextlib.suppress(OSError):
                found.append((int(pid), Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")))
        return found

    def kill_node(self, k: int, sig: int = signal.SIGKILL) -> list[int]:
        """Every process in node k's namespace (a node lost), the PIDs it signalled."""
        pids = [pid for pid, _ in self.pids(k)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def down(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.processes.clear()
        while self.cleanups:
            self.cleanups.pop()()
        for k, name in enumerate(self.names, 1):
            if Path(f"/run/netns/{name}").exists():
                self.kill_node(k)
                sh("ip", "netns", "del", name, check=False)
            sh("ip", "link", "del", f"{self.prefix}v{k}", check=False)
        sh("ip", "link", "del", self.bridge, check=False)


def read_only(pid: int, folder: Path) -> None:
    """`folder` turned read-only for the processes of pid's mount namespace (a node's failed NFS mount)."""
    for flags in (["--bind"], ["-o", "remount,ro,bind"]):
        sh("nsenter", "-t", str(pid), "-m", "mount", *flags, str(folder), str(folder))


def node_local(pid: int, folder: Path) -> Path:
    """`folder` replaced, for the processes of pid's mount namespace, by an empty folder of that node's own (a
    node-local disk where the others have the shared one); the folder it sees, from outside."""
    own = folder.with_name(f"{folder.name}-node-local")
    own.mkdir()
    sh("nsenter", "-t", str(pid), "-m", "mount", "--bind", str(own), str(folder))
    return own


def wait_for(predicate, timeout: float, what: str, every: float = 0.5):
    """predicate()'s first truthy value within `timeout` seconds, or a failed test naming `what`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"{what}: not within {timeout:.0f} s", pytrace=False)


# How long a requeued job waits before it starts again (SLURM's default is 120 s: the job's old credential must
# expire first; a job started before that is killed, "Job credential revoked").
CRED_EXPIRE_S = 10


class Slurm:
    """SLURM on a Cluster: munge (its own daemon and socket), slurmctld in this namespace, a slurmd on each node,
    state and logs under `folder`. `env` is what a user's shell has to run sbatch, squeue and scontrol."""

    def __init__(self, cluster: Cluster, folder: Path):
        for tool in ("slurmctld", "slurmd", "sbatch", "munged"):
            if not shutil.which(tool):
                unavailable(f"SLURM and munge (`apt-get install slurm-wlm munge`; `make install` does it as root): "
                            f"no {tool}")  # fmt: skip
        self.cluster, self.folder = cluster, folder
        folder.mkdir(parents=True, exist_ok=True)
        # munged runs as its user, who cannot enter pytest's folders (0700): its own, removed at teardown
        munge = Path(tempfile.mkdtemp(prefix=f"{cluster.prefix}-munge-"))
        munge.chmod(0o755)
        shutil.chown(munge, "munge", "munge")
        cluster.cleanups.append(lambda: shutil.rmtree(munge, ignore_errors=True))
        self.socket = munge / "munge.sock"
        cluster.start(["runuser", "-u", "munge", "--", "munged", "--foreground", "--force", f"--socket={self.socket}",
                       f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed", f"--log-file={munge}/log"],
                      folder / "munged.out")  # fmt: skip
        wait_for(self.socket.exists, 20, "munged's socket")
        self.conf = folder / "slurm.conf"
        self.conf.write_text(self.config())
        (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # slurmd refuses to start without one
        self.env = {**engine_env(), "SLURM_CONF": str(self.conf)}
        cluster.start(["slurmctld", "-D", "-f", str(self.conf)], folder / "slurmctld.out", env=self.env)
        self.slurmd = [cluster.start(cluster.argv(k, ["slurmd", "-D", "-f", str(self.conf), "-N", name]),
                                     folder / f"slurmd_{name}.out", env=self.env)
                       for k, name in enumerate(cluster.names, 1)]  # fmt: skip  # each a node's namespaces
        wait_for(lambda: self.states() == ["idle"] * cluster.count, 60, "every slurmd idle in sinfo")

    def config(self) -> str:
        c, f = self.cluster, self.folder
        nodes = "\n".join(f"NodeName={name} NodeAddr={c.address(k)} CPUs={os.cpu_count()}"
                          for k, name in enumerate(c.names, 1))  # fmt: skip
        return f"""ClusterName={c.prefix}
SlurmctldHost={socket.gethostname()}({c.address(254)})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool_%n
SlurmdLogFile={f}/slurmd_%n.log
SlurmdPidFile={f}/slurmd_%n.pid
SlurmctldLogFile={f}/slurmctld.log
SlurmctldPidFile={f}/slurmctld.pid
{nodes}
PartitionName=test Nodes={",".join(c.names)} Default=YES MaxTime=INFINITE State=UP
"""

    def run(self, *argv: str, check: bool = True, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM command as a user's shell runs it (`env`: that shell's, SLURM_CONF set)."""
        result = subprocess.run(argv, capture_output=True, text=True, env=env or self.env, timeout=60, **kwargs)
        if check and result.returncode:
            pytest.fail(f"{' '.join(argv[:3])} ... exit {result.returncode}: {result.stderr.strip()}", pytrace=False)
        return result

    def states(self) -> list[str]:
        """Each node's state in sinfo (idle, allocated, down, ...)."""
        return self.run("sinfo", "-N", "-h", "-o", "%T", check=False).stdout.split()

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of a job (JobState, ExitCode, Restarts, Reason, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)


class Ray:
    """A Ray cluster on a Cluster: `ray start --head` on node 1, `ray start --address` on the others, each node's
    /tmp/ray a disk of its own (as on separate machines; here it would be one session folder for all), token
    authentication on as `ray start` has it by default. `env` is what a driver or `ray status` needs."""

    def __init__(self, cluster: Cluster, folder: Path, cpus: int = 2):
        self.cluster, self.head = cluster, f"{cluster.address(1)}:{free_port()}"
        self.env = {**engine_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
        self.ray, self.folder, self.cpus = str(Path(sys.executable).with_name("ray")), folder, cpus
        self.nodes: list[subprocess.Popen] = []
        self.own: dict[int, Path] = {}  # each node's /tmp/ray
        for k in range(1, cluster.count + 1):
            self.nodes.append(self.join(k))
            wait_for(lambda k=k: self.alive() == k, 120, f"{k} Ray node(s) in `ray status`")

    def join(self, k: int) -> subprocess.Popen:
        """Node k's `ray start` (the head's on node 1), in the foreground, with a /tmp/ray of its own."""
        own = self.own[k] = Path(tempfile.mkdtemp(prefix=f"ray-{self.cluster.names[k - 1]}-", dir=self.folder))
        where = ["--head", "--port", self.head.split(":")[1], "--include-dashboard=false"] if k == 1 else \
            ["--address", self.head]  # fmt: skip
        command = [self.ray, "start", "--block", *where, "--node-ip-address", self.cluster.address(k), "--num-cpus",
                   str(self.cpus), "--disable-usage-stats"]  # fmt: skip
        return self.cluster.start(self.cluster.argv(k, command, {"/tmp/ray": own}), own / "ray.out", env=self.env)

    def rejoin(self, k: int) -> None:
        """Node k back in the cluster after it was lost (a new `ray start --address` there)."""
        self.nodes[k - 1] = self.join(k)
        wait_for(lambda: self.alive() == self.cluster.count, 120, f"node {k} back in `ray status`")

    def alive(self) -> int:
        """The nodes `ray status` counts as active."""
        out = subprocess.run([str(Path(sys.executable).with_name("ray")), "status", "--address", self.head],
                             capture_output=True, text=True, env=self.env, timeout=60).stdout  # fmt: skip
        section = out.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in out else ""
        return section.count("node_")

    def driver(self, argv: list[str], cwd: Path) -> list[str]:
        """argv run in `cwd` on the head node, as a user logged in there runs a driver: its network, hostname and
        /tmp/ray (where the driver finds its node's raylet)."""
        return self.cluster.argv(1, ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd), *argv], {"/tmp/ray": self.own[1]})
