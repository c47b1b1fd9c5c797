"""An S3 bucket on this machine (moto's server, on the cluster's bridge) that the nodes of a Cluster
(tests/cluster.py) mount as SkyPilot's MOUNT_CACHED does: `rclone mount` with its flags (sky/data/mounting_utils.py,
get_mount_cached_cmd: a write-back VFS cache of full files, a 10 s directory cache), each node its own cache folder,
in its own mount namespace. So each node sees another node's new files only once they are uploaded (5 s after
they were closed) and its directory cache has expired, and what a node had not uploaded when it was lost is gone.

Needs moto[server] (the dev extra), Debian's rclone and fuse3 (`make cluster-tools`) and /dev/fuse; where one is
missing the tests skip with one line (and fail under CI), as cluster.unavailable does. Debian's rclone is 1.60;
SkyPilot installs 1.68.2 on its VMs, with the same flags.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path

from cluster import Cluster, free_port, unavailable, wait_for

MOUNT = "/checkpoints"  # where the nodes mount the bucket (SkyPilot's file_mounts key in the task the toolkit writes)
REMOTE = "bucket"  # the rclone remote's name, configured from RCLONE_CONFIG_BUCKET_* variables
# SkyPilot 0.14's MOUNT_CACHED command, less its log and config-file plumbing (its `--daemon-wait 10`, bare seconds,
# is what rclone 1.68 takes; 1.60 wants a unit).
SKYPILOT_FLAGS = ["--daemon", "--daemon-wait", "10s", "--allow-other", "--vfs-cache-mode", "full", "--dir-cache-time",
                  "10s", "--vfs-cache-poll-interval", "10s", "--vfs-fast-fingerprint", "--vfs-cache-max-size",
                  "10G"]  # fmt: skip


class Bucket:
    """A bucket `name` on a moto S3 server at the cluster's bridge address, its state and logs under `folder`."""

    def __init__(self, cluster: Cluster, folder: Path, name: str = "finetune-test"):
        server = Path(sys.executable).with_name("moto_server")
        needed = {"moto's S3 server (`pip install -e '.[dev]'`: moto[server])": server.exists(),
                  "rclone (`make cluster-tools` installs it as root)": shutil.which("rclone"),
                  "fuse3 (`make cluster-tools` installs it as root)": shutil.which("fusermount3"),
                  "/dev/fuse (a container started without it)": Path("/dev/fuse").exists()}  # fmt: skip
        for what, there in needed.items():
            if not there:
                unavailable(f"an object-store mount: {what}")
        import boto3

        self.cluster, self.folder, self.name = cluster, folder, name
        folder.mkdir(parents=True, exist_ok=True)
        self.address = (cluster.address(254), free_port())
        self.endpoint = f"http://{self.address[0]}:{self.address[1]}"
        cluster.start([str(server), "-H", self.address[0], "-p", str(self.address[1])], folder / "moto.log")
        wait_for(self.listening, 30, f"moto's S3 server on {self.endpoint}", every=0.2)
        self.s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test",
                               aws_secret_access_key="test", region_name="us-east-1")  # fmt: skip
        self.s3.create_bucket(Bucket=name)

    def listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(self.address) == 0

    def env(self) -> dict[str, str]:
        """rclone's remote as variables (an S3-compatible store: provider Other, this endpoint, path-style)."""
        remote = f"RCLONE_CONFIG_{REMOTE.upper()}_"
        return {f"{remote}TYPE": "s3", f"{remote}PROVIDER": "Other", f"{remote}ENDPOINT": self.endpoint,
                f"{remote}ACCESS_KEY_ID": "test", f"{remote}SECRET_ACCESS_KEY": "test",
                f"{remote}FORCE_PATH_STYLE": "true"}  # fmt: skip

    def mount(self, cache: Path, log: Path, *flags: str) -> str:
        """The shell command a node runs first: the bucket at MOUNT, `cache` its own VFS cache; `flags` added."""
        self.cluster.mount_point(MOUNT)
        argv = ["rclone", "mount", f"{REMOTE}:{self.name}", MOUNT, *SKYPILOT_FLAGS, "--cache-dir", str(cache),
                "--log-file", str(log), "--log-level", "INFO", *flags]  # fmt: skip
        return " ".join(argv)

    def objects(self, prefix: str = "") -> dict[str, int]:
        """The bucket's objects under `prefix` (key relative to it -> size), as a fresh mount would list them."""
        found, token = {}, {}
        while True:
            page = self.s3.list_objects_v2(Bucket=self.name, Prefix=prefix, **token)
            found.update({o["Key"].removeprefix(prefix): o["Size"] for o in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return found
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def json(self, key: str) -> dict:
        return json.loads(self.s3.get_object(Bucket=self.name, Key=key)["Body"].read())
