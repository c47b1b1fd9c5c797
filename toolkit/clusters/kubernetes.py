"""`python -m toolkit launch --on kubernetes --image IMAGE [--submit] ...`: the launch as a Kubeflow Trainer (v2)
TrainJob, with a TrainingRuntime of its own, written to a file (and applied with --submit, through the official
`kubernetes` client).

- Nodes and GPUs per node from the config (`num_machines`, `num_processes`, the command line's over them); each
  node's container runs `toolkit launch` with Trainer's torch variables (PET_NNODES, PET_NPROC_PER_NODE,
  PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) as accelerate's machine flags, the mesh sized by `toolkit mesh`
  as slurm/launch_node.sh does.
- Checkpoints on a shared volume (a PersistentVolumeClaim, `--checkpoint_claim`), the output folder in it.
- Preemption: Kubernetes sends SIGTERM, the run saves a checkpoint (terminationGracePeriodSeconds covers torch's
  300 s shutdown) and exits 75. The runtime's JobSet restarts the job (up to --max_restarts), and the recipe's
  `--resume auto` continues it; exits 2, 3 and 4 (bad input, diverged, budget spent) fail it instead, as a
  restart would only repeat them (a Job pod failure policy, then a JobSet failure rule).
Validated against the CRDs' published schemas, for every config (tests/test_kubernetes.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..distributed.launcher import SHUTDOWN_TIMEOUT_S, launch_shape
from ..errors import BUDGET_SPENT, DIVERGED, USER_ERROR, ConfigError, first_line
from .workdir import dump, node_launch, portable, resumable, write_job

NAME = "kubernetes"
RUNS_HERE = False  # a manifest: the cluster loads the model
GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
CONTAINER = "node"  # the torch runtime's trainer container, which gets the PET_* variables
FINAL = (USER_ERROR, DIVERGED, BUDGET_SPENT)


def add_options(group) -> None:
    group.add_argument("--image", help="the container image: this repository installed (`make install`) in its "
                       "working directory")  # fmt: skip
    group.add_argument("--namespace", default="default")
    group.add_argument(
        "--checkpoint_claim",
        default="finetune-checkpoints",
        help="the PersistentVolumeClaim (ReadWriteMany) the nodes share for checkpoints",
    )
    group.add_argument("--checkpoint_dir", default="/checkpoints", help="where the claim is mounted")
    group.add_argument("--gpus_per_node", type=int, default=8, help="the GPUs a node of the pool has (default 8)")
    group.add_argument("--max_restarts", type=int, default=3, help="JobSet restarts after a failure or preemption")
    group.add_argument("--job_name", help="the TrainJob's name (default: the recipe's and the config's)")
    group.add_argument("--output", help="the manifest file (default: <job name>.yaml)")
    group.add_argument("--submit", action="store_true", help="apply it to the cluster of the current kubeconfig")


def accelerate_words(options, words: list[str]) -> list[str]:
    return words


# JobSet's admission webhook (pkg/webhooks/jobset_webhook.go), which the CRD schemas do not show: the JobSet (the
# TrainJob's name) makes pods named <name>-<replicated job>-<job index>-<pod index>-<5 random>, each an RFC 1035
# label (a letter first, at most 63); a failure-policy rule's name is letters, digits and '_,:' (no '-').
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # a namespace
FINAL_RULE = "FinalExitCodes"


def longest_pod(name: str, nodes: int) -> str:
    """The longest pod name JobSet makes for a TrainJob `name` of `nodes` nodes (one replicated job, CONTAINER)."""
    return f"{name}-{CONTAINER}-0-{nodes - 1}-abcde"


def dns_name(text: str, nodes: int = 1) -> str:
    """A default TrainJob name from `text`: lower-case letters, digits and '-', a letter first, short enough for
    JobSet's pod names."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-").lstrip("0123456789-") or "finetune"
    return name[: 63 - len(longest_pod("", nodes))].rstrip("-")


def job_name(given: str | None, stem: str, nodes: int) -> str:
    """--job_name as given, refused in one line where JobSet would refuse it; else one made from `stem`."""
    if given is None:
        return dns_name(stem, nodes)
    most = 63 - len(longest_pod("", nodes))
    if not DNS_1035.fullmatch(given) or len(given) > most:
        raise ConfigError(f"--job_name {given!r}: use lower-case letters, digits and '-', a letter first and at most "
                          f"{most} characters (JobSet names its pods {longest_pod('<name>', nodes)[:-5]}xxxxx, which "
                          "must fit 63).")  # fmt: skip
    return given


def check_namespace(namespace: str) -> None:
    if not DNS_1123.fullmatch(namespace) or len(namespace) > 63:
        raise ConfigError(f"--namespace {namespace!r}: use lower-case letters, digits and '-', at most 63.")


def node_shape(args, options) -> tuple[int, int]:
    """(nodes, processes per node) from the config, the command line's counts over it; refused where a node of
    the pool has fewer GPUs."""
    shape = launch_shape(args)
    processes, nodes = shape["processes"], shape["nodes"]
    if processes % nodes:
        raise ConfigError(f"{processes} processes do not split over {nodes} nodes: pass --num_processes as a "
                          "multiple of --num_machines.")  # fmt: skip
    per_node = processes // nodes
    if options.gpus_per_node < 1:
        raise ConfigError(f"--gpus_per_node {options.gpus_per_node}: pass the GPUs a node of the pool has, 1 or more.")
    if per_node > options.gpus_per_node:
        raise ConfigError(f"{args.config_file or 'the launch'} needs {per_node} GPUs a node and a node has "
                          f"{options.gpus_per_node} (--gpus_per_node): pass --num_machines "
                          f"{-(-processes // options.gpus_per_node)} to spread the {processes} processes.")  # fmt: skip
    return nodes, per_node


def node_command(args, options, name: str) -> str:
    """The bash line each node's container runs: this node's `toolkit launch`, from Trainer's torch variables."""
    config = portable(args.config_file, "--config_file") if args.config_file else None
    flags = resumable(["--output_dir", f"{options.checkpoint_dir}/{name}", *args.training_script_args])
    return "exec " + node_launch(
        config,
        portable(args.training_script, "the script"),
        flags,
        "PET_NNODES",
        "PET_NPROC_PER_NODE",
        '"$PET_NODE_RANK"',
        '"$PET_MASTER_ADDR"',
        '"$PET_MASTER_PORT"',
    )


def manifests(args, options) -> list[dict]:
    """The TrainingRuntime and the TrainJob that uses it."""
    if not options.image:
        raise ConfigError("--on kubernetes needs --image: a container image with this repository installed in its "
                          "working directory (`make install`).")  # fmt: skip
    nodes, per_node = node_shape(args, options)
    stem = Path(args.training_script).stem + (f"-{Path(args.config_file).stem}" if args.config_file else "")
    name = job_name(options.job_name, stem, nodes)
    check_namespace(options.namespace)
    metadata = {"name": name, "namespace": options.namespace}
    pod = {
        "restartPolicy": "Never",  # the Job's pod failure policy needs it; the JobSet restarts the whole job
        "terminationGracePeriodSeconds": SHUTDOWN_TIMEOUT_S + 30,  # torch's shutdown wait, then the launcher's own
        "containers": [{"name": CONTAINER, "image": options.image,
                        "volumeMounts": [{"name": "checkpoints", "mountPath": options.checkpoint_dir},
                                         {"name": "shm", "mountPath": "/dev/shm"}]}],
        # a container's /dev/shm is 64 MB: too small for NCCL's buffers and the data loader's workers
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": options.checkpoint_claim}},
                    {"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }  # fmt: skip
    job = {
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
            "containerName": CONTAINER, "operator": "In", "values": list(FINAL)}}]},
        "template": {"spec": pod},
    }  # fmt: skip
    runtime = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingRuntime",
        "metadata": {**metadata, "labels": {f"{GROUP}/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": nodes, "torch": {}},
            "template": {"spec": {
                "failurePolicy": {"maxRestarts": options.max_restarts, "rules": [
                    {"name": FINAL_RULE, "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
                "replicatedJobs": [{"name": CONTAINER, "template": {
                    "metadata": {"labels": {f"{GROUP}/trainjob-ancestor-step": "trainer"}}, "spec": job}}],
            }},
        },
    }  # fmt: skip
    trainjob = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob", "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": name, "apiGroup": GROUP, "kind": "TrainingRuntime"},
            "trainer": {
                "image": options.image,
                "command": ["bash", "-c", node_command(args, options, name)],
                "numNodes": nodes, "numProcPerNode": per_node,
                "resourcesPerNode": {"limits": {"nvidia.com/gpu": per_node}},
                "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token",
                                                                            "optional": True}}}],
            },
        },
    }  # fmt: skip
    return [runtime, trainjob]


def launch(options, args) -> int:
    documents = manifests(args, options)
    name = documents[1]["metadata"]["name"]
    path = Path(options.output or f"{name}.yaml")
    write_job(path, dump(documents))
    print(f"wrote {path}: TrainJob {name}, {documents[0]['spec']['mlPolicy']['numNodes']} node(s) x "
          f"{documents[1]['spec']['trainer']['numProcPerNode']} GPU(s), checkpoints on claim "
          f"{options.checkpoint_claim}")  # fmt: skip
    if not options.submit:
        print(f"apply it with: kubectl apply -f {path}  (or add --submit)")
        return 0
    submit(documents, options.namespace)
    print(f"submitted TrainJob {name} to namespace {options.namespace}: kubectl get trainjob {name} -n "
          f"{options.namespace}")  # fmt: skip
    return 0


def submit(documents: list[dict], namespace: str) -> None:
    """Both objects created through the official client, from the current kubeconfig (or in-cluster)."""
    try:
        import urllib3
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
    except ImportError:
        raise ConfigError("--submit needs the kubernetes client: pip install kubernetes (`make install` has "
                          "it), or apply the file with kubectl.") from None  # fmt: skip
    try:  # KUBECONFIG read now: the client reads it once, when first imported
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except Exception as error:  # noqa: BLE001 - no usable kubeconfig: a pod's own service account, else one line
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise ConfigError(
                f"--submit: no cluster to submit to (kubeconfig: {first_line(error)}; not inside a "
                "cluster). Point KUBECONFIG at one, or apply the file with kubectl."
            ) from None
    api = client.CustomObjectsApi()
    for document in documents:
        plural = {"TrainingRuntime": "trainingruntimes", "TrainJob": "trainjobs"}[document["kind"]]
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, document)
        except (ApiException, OSError, urllib3.exceptions.HTTPError) as error:
            raise ConfigError(f"--submit: the cluster refused the {document['kind']} "
                              f"({first_line(error)}). Is Kubeflow Trainer v2 installed?") from None  # fmt: skip
