"""`python -m toolkit launch --on kubernetes --image IMAGE [--submit] ...`: the launch as a Kubeflow Trainer (v2)
TrainJob, with a TrainingRuntime of its own, written to a file (and applied with --submit, through the official
`kubernetes` client).

- Nodes and GPUs per node from the config (`num_machines`, `num_processes`, the command line's over them); each
  node's container runs `toolkit launch` with Trainer's torch variables (PET_NNODES, PET_NPROC_PER_NODE,
  PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) as accelerate's machine flags, the mesh sized by `toolkit mesh`
  as slurm/launch_node.sh does.
- Checkpoints on a shared volume (a PersistentVolumeClaim, `--checkpoint_claim`), the output folder in it.
- Preemption: Kubernetes sends SIGTERM, the run saves a checkpoint (terminationGracePeriodSeconds covers torch's
  300 s shutdown) and exits 75. The runtime's JobSet restarts the job without counting it against --max_restarts,
  and the recipe's `--resume auto` continues it; exits 2, 3 and 4 (bad input, diverged, budget spent) fail it, as a
  restart would only repeat them; any other failure restarts it, up to --max_restarts (failure_policy()). Needs
  JobSet v0.10 or later (Kubeflow Trainer v2.1 or later installs it) and Kubernetes 1.26 or later.
- Placement: CPU and memory requests (--cpus_per_node, --memory_per_node: a pod without them is BestEffort, the
  first evicted), GPU limits, and --node_selector, --toleration for a GPU pool; every value checked as the API
  server would, and the image reference as the kubelet would (kubernetes_rules.py), before the file is written.
Validated against the CRDs' published schemas, for every config (tests/test_kubernetes.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..distributed.launcher import SHUTDOWN_TIMEOUT_S, launch_shape
from ..errors import BUDGET_SPENT, DIVERGED, PREEMPTED, USER_ERROR, ConfigError, first_line
from .kubernetes_rules import check_image, node_selector, quantity, tolerations
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
    group.add_argument("--cpus_per_node", help="the CPUs a node's pod requests, a Kubernetes quantity (default: 2 a "
                       "GPU, which the smallest GPU nodes give)")  # fmt: skip
    group.add_argument("--memory_per_node", help="the memory a node's pod requests, e.g. 400Gi (default: 8Gi "
                       "a GPU, as small GPU nodes give; more keeps it from eviction on memory pressure)")  # fmt: skip
    group.add_argument("--node_selector", action="append", default=[], metavar="KEY=VALUE",
                       help="a label the nodes must have, e.g. cloud.google.com/gke-accelerator=nvidia-h100-80gb "
                       "(repeatable)")  # fmt: skip
    group.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT",
                       help="a node taint the pods tolerate, as `kubectl taint` writes it, e.g. "
                       "nvidia.com/gpu=present:NoSchedule (repeatable)")  # fmt: skip
    group.add_argument("--max_restarts", type=int, default=3, help="JobSet restarts after a failure (a preemption "
                       "restarts it without counting)")  # fmt: skip
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
FINAL_RULE, PREEMPTED_RULE = "FinalExitCodes", "Preempted"


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


def failure_policy(max_restarts: int) -> tuple[dict, dict]:
    """The Job's podFailurePolicy and the JobSet's failurePolicy: exits 2, 3, 4 fail the JobSet, a preemption
    restarts it without counting against `max_restarts`, anything else restarts it, counted.

    Both final codes and a preemption fail the Job with the one reason PodFailurePolicy, so the JobSet's rules
    tell them apart by the Job's failure message, which Kubernetes writes as "Container <c> for pod <ns>/<pod>
    failed with exit code <n> matching FailJob rule at index <i>", or "Pod <ns>/<pod> has condition <type>
    matching FailJob rule at index <i>" (kubernetes/kubernetes pkg/controller/job/pod_failure_policy.go,
    matchPodFailurePolicy; the Failed condition copies it, job_controller.go newFailedConditionForFailureTarget),
    which JobSet matches a rule's onJobFailureMessagePatterns against (kubernetes-sigs/jobset
    pkg/controllers/failure_policy.go, ruleIsApplicable; released in v0.10.0). A preemption is exit 75 on every
    node (the ranks agree to stop, training/stopping.py), or a pod whose node went before it saved: Kubernetes
    gives a pod evicted, preempted by the scheduler or stopped by a node shutdown the DisruptionTarget condition.
    Not podFailurePolicy's `Ignore` on DisruptionTarget: it would replace the one pod inside a running Job, while
    the other nodes exit 75 without that condition and torch's fixed world needs every node started again, which
    the JobSet's restart does. The final rule comes first: a JobSet older than v0.10 drops the patterns, and then
    fails a preemption rather than restarting exits 2, 3, 4 without end."""
    exits = {"containerName": CONTAINER, "operator": "In"}
    pods = {"rules": [
        {"action": "FailJob", "onExitCodes": {**exits, "values": sorted(FINAL)}},
        {"action": "FailJob", "onExitCodes": {**exits, "values": [PREEMPTED]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}  # fmt: skip
    jobset = {"maxRestarts": max_restarts, "rules": [
        {"name": FINAL_RULE, "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": [f"failed with exit code ({'|'.join(map(str, FINAL))}) matching FailJob rule"]},
        {"name": PREEMPTED_RULE, "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": [f"failed with exit code {PREEMPTED} matching FailJob rule",
                                         "has condition DisruptionTarget matching FailJob rule"]},
    ]}  # fmt: skip
    return pods, jobset


def requests(options, per_node: int) -> dict[str, str]:
    """The pod's CPU and memory requests: the options' (checked), else 2 CPUs and 8Gi a GPU, what the smallest GPU
    nodes (4 vCPUs, 16 GiB a GPU) give, so that the default schedules everywhere; none would make it BestEffort."""
    cpus = str(2 * per_node) if options.cpus_per_node is None else options.cpus_per_node
    memory = f"{8 * per_node}Gi" if options.memory_per_node is None else options.memory_per_node
    quantity(cpus, "--cpus_per_node", "32 or 500m")
    if quantity(memory, "--memory_per_node", "256Gi") < 2**30:
        raise ConfigError(f"--memory_per_node {memory} is under 1Gi (a bare number is bytes): pass it with its "
                          "unit, e.g. 256Gi.")  # fmt: skip
    return {"cpu": cpus, "memory": memory}


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
    check_image(options.image)
    nodes, per_node = node_shape(args, options)
    stem = Path(args.training_script).stem + (f"-{Path(args.config_file).stem}" if args.config_file else "")
    name = job_name(options.job_name, stem, nodes)
    check_namespace(options.namespace)
    if options.max_restarts < 0:
        raise ConfigError(f"--max_restarts {options.max_restarts}: pass 0 (a failure ends the job) or more.")
    resources = {"requests": requests(options, per_node), "limits": {"nvidia.com/gpu": per_node}}
    placement = {"nodeSelector": node_selector(options.node_selector), "tolerations": tolerations(options.toleration)}
    pod_failures, failures = failure_policy(options.max_restarts)
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
        **{key: value for key, value in placement.items() if value},  # the runtime is this job's own
    }  # fmt: skip
    job = {"backoffLimit": 0, "podFailurePolicy": pod_failures, "template": {"spec": pod}}
    runtime = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingRuntime",
        "metadata": {**metadata, "labels": {f"{GROUP}/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": nodes, "torch": {}},
            "template": {"spec": {
                "failurePolicy": failures,
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
                "resourcesPerNode": resources,
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
