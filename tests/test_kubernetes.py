"""`toolkit launch --on kubernetes`: every config's TrainingRuntime and TrainJob validate against Kubeflow Trainer's
published CRD schemas (tests/crds/, offline), and the command a node's container runs trains for real."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
from functools import cache
from pathlib import Path

import pytest
import yaml
from conftest import BIN, ROOT, check, free_port, rank_reports, run_cmd
from jsonschema import Draft7Validator, FormatChecker

from toolkit.clusters.kubernetes import CONTAINER
from toolkit.clusters.launch import main
from toolkit.distributed.launch_check import strategy_files
from toolkit.errors import BUDGET_SPENT, DIVERGED, PREEMPTED, USER_ERROR, ConfigError

CRDS = ROOT / "tests" / "crds"


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    """Job files name paths relative to the repository, the working directory the nodes get; a launch sets
    TOOLKIT_CONFIG_FILE for its ranks."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TOOLKIT_CONFIG_FILE", "")


def closed(schema):
    """Every object that lists its properties refuses others, as the API server's strict field validation does
    (the CRDs leave additionalProperties open; plain JSON Schema would let a misspelt field through)."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema = {**schema, "additionalProperties": False}
        return {k: closed(v) for k, v in schema.items()}
    return [closed(v) for v in schema] if isinstance(schema, list) else schema


@cache
def validator(kind: str) -> Draft7Validator:
    crd = yaml.safe_load(gzip.decompress((CRDS / f"trainer.kubeflow.org_{kind.lower()}s.yaml.gz").read_bytes()))
    (version,) = crd["spec"]["versions"]
    assert crd["spec"]["names"]["kind"] == kind and version["name"] == "v1alpha1"
    return Draft7Validator(closed(version["schema"]["openAPIV3Schema"]), format_checker=FormatChecker())


def errors(document: dict) -> list[str]:
    found = validator(document["kind"]).iter_errors(document)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


def written(tmp_path, *words: str, recipe: str = "llama3_fft") -> list[dict]:
    out = tmp_path / "job.yaml"
    main(["--on", "kubernetes", "--image", "ghcr.io/acme/finetune:1", "--output", str(out), *words,
          str(ROOT / "recipes" / f"{recipe}.py")])  # fmt: skip
    return list(yaml.safe_load_all(out.read_text()))


# What JobSet's admission webhook refuses (kubernetes-sigs/jobset, pkg/webhooks/jobset_webhook.go), which the CRD
# schemas do not say: written from its code, not from the toolkit's constants.
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}  # fmt: skip


def jobset_webhook_errors(runtime: dict, trainjob: dict) -> list[str]:
    """The webhook's checks of the JobSet that Trainer makes from these: its name is the TrainJob's."""
    found, spec = [], runtime["spec"]["template"]["spec"]
    names = [rule["name"] for rule in spec["failurePolicy"]["rules"]]
    for rule in spec["failurePolicy"]["rules"]:
        if not (
            1 <= len(rule["name"]) <= 128 and re.fullmatch(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", rule["name"])
        ):
            found.append(f"invalid failure policy rule name '{rule['name']}'")
        found += [f"invalid job failure reason '{r}'" for r in rule.get("onJobFailureReasons", []) if r not in
                  JOB_FAILURE_REASONS]  # fmt: skip
        # not checked by the webhook: the controller logs a pattern Go's RE2 refuses and never matches it
        found += [f"pattern {p!r} is no RE2 regexp" for p in rule.get("onJobFailureMessagePatterns", [])
                  if re.search(r"\(\?[=!<]|\\[1-9]", p) or not re.compile(p)]  # fmt: skip
    if len(set(names)) < len(names):
        found.append("rule names are not unique")
    nodes = trainjob["spec"]["trainer"]["numNodes"]
    for job in spec["replicatedJobs"]:  # Trainer runs the nodes as one Job's indexed pods
        pod = f"{trainjob['metadata']['name']}-{job['name']}-0-{nodes - 1}-abcde"
        if len(pod) > 63 or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", pod):
            found.append(f"pod name {pod} is not an RFC 1035 label of at most 63")
    return found


def pod_failure_policy_errors(runtime: dict) -> list[str]:
    """Kubernetes' checks of the Job's podFailurePolicy when JobSet creates the Job (kubernetes/kubernetes
    pkg/apis/batch/validation/validation.go, validatePodFailurePolicyRule), which the CRD schema does not say."""
    found = []
    for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        spec = job["template"]["spec"]
        containers = {c["name"] for c in spec["template"]["spec"]["containers"]}
        if spec["template"]["spec"].get("restartPolicy") != "Never":
            found.append("a pod failure policy needs restartPolicy Never")
        for rule in spec["podFailurePolicy"]["rules"]:
            codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
            if rule["action"] not in ("FailJob", "Ignore", "Count") or (codes is None) == (conditions is None):
                found.append(f"rule {rule}: an action and one of onExitCodes, onPodConditions")
            if codes and (
                codes.get("containerName", CONTAINER) not in containers
                or codes["operator"] not in ("In", "NotIn")
                or codes["values"] != sorted(set(codes["values"]))
                or 0 in codes["values"]
            ):
                found.append(f"onExitCodes {codes}: a container's name, In or NotIn, values ordered, unique, not 0")
            for condition in conditions or []:
                if condition.get("status") not in ("True", "False", "Unknown"):
                    found.append(f"onPodConditions {condition}: status True, False or Unknown")
    return found


def job_failure(pod_rules: list[dict], exit_code: int, conditions: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """The Job's failure (reason, message) when a pod of a Job with backoffLimit 0 fails with `exit_code` and
    `conditions`, as Kubernetes' Job controller words it (kubernetes/kubernetes pkg/controller/job/
    pod_failure_policy.go, matchPodFailurePolicy; job_controller.go); None where the failure is ignored."""
    pod = "ns/job-node-0-1-abcde"
    for index, rule in enumerate(pod_rules):
        codes = rule.get("onExitCodes")
        if codes and exit_code != 0 and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            message = f"Container {codes['containerName']} for pod {pod} failed with exit code {exit_code}"
        elif matched := [c["type"] for c in rule.get("onPodConditions", []) if c["type"] in conditions]:
            message = f"Pod {pod} has condition {matched[0]}"
        else:
            continue
        if rule["action"] == "Ignore":
            return None
        if rule["action"] == "FailJob":
            return "PodFailurePolicy", f"{message} matching FailJob rule at index {index}"
        break  # Count
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def jobset_action(policy: dict, reason: str, message: str, patterns: bool = True) -> str:
    """The action JobSet takes on the Job's failure (kubernetes-sigs/jobset pkg/controllers/failure_policy.go,
    ruleIsApplicable: the first rule whose reasons and message patterns match; else RestartJobSet, counted).
    `patterns=False`: a JobSet older than v0.10.0, which has no onJobFailureMessagePatterns and drops them."""
    for rule in policy["rules"]:
        found = rule.get("onJobFailureMessagePatterns", []) if patterns else []
        if reason in rule.get("onJobFailureReasons", [reason]) and (
            not found or any(re.search(p, message) for p in found)
        ):
            return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize("config", [p.name for p in strategy_files()])
def test_every_config_validates_against_the_crds(config, tmp_path):
    settings = yaml.safe_load((ROOT / "accelerate_configs" / config).read_text())
    recipe = "qwen3_moe_fft" if config == "fsdp2_ep.yaml" else "llama3_fft"  # expert parallelism needs experts
    runtime, job = written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / config), recipe=recipe)
    assert errors(runtime) == [] and errors(job) == []
    assert jobset_webhook_errors(runtime, job) == []  # before: the rule "final-exit-codes", refused
    assert pod_failure_policy_errors(runtime) == []
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "apiGroup": "trainer.kubeflow.org",
                                         "kind": "TrainingRuntime"}  # fmt: skip
    nodes, per_node = job["spec"]["trainer"]["numNodes"], job["spec"]["trainer"]["numProcPerNode"]
    assert (nodes, nodes * per_node) == (settings.get("num_machines", 1), settings["num_processes"])
    assert job["spec"]["trainer"]["resourcesPerNode"] == {
        "requests": {"cpu": str(2 * per_node), "memory": f"{8 * per_node}Gi"},  # before: none, a BestEffort pod
        "limits": {"nvidia.com/gpu": per_node},
    }
    pod_failures = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]
    assert pod_failures["rules"][0]["onExitCodes"]["values"] == [USER_ERROR, DIVERGED, BUDGET_SPENT]  # not 75
    assert "--resume auto" in job["spec"]["trainer"]["command"][-1]


def test_the_validation_refuses_what_the_api_server_would(tmp_path):
    """The check can fail: a wrong type, a misspelt field, a field where the schema has none."""
    runtime, job = written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numNodes"] = "two"
    assert errors(bad) == ["spec.trainer.numNodes: 'two' is not of type 'integer'"]
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numNode"] = 2
    assert errors(bad) == ["spec.trainer: Additional properties are not allowed ('numNode' was unexpected)"]
    bad = copy.deepcopy(runtime)
    bad["spec"]["template"]["spec"]["failurePolicy"]["rules"][0]["action"] = "Retry"
    assert len(errors(bad)) == 1


@pytest.mark.launch
def test_a_nodes_command_trains(tmp_path):
    """The container's command, run as Kubeflow Trainer runs it on one node of 2 processes (its PET_* variables),
    in the image's working directory (this repository): a 2-process run whose output is on the claim's path."""
    out = tmp_path / "job.yaml"
    check(run_cmd([str(BIN / "python"), "-m", "toolkit", "launch", "--on", "kubernetes", "--image", "img",
                   "--output", str(out), "--checkpoint_dir", str(tmp_path / "claim"), "--config_file",
                   "accelerate_configs/ddp.yaml", "--num_processes", "2", "recipes/bert.py", "--tiny",
                   "--max_steps", "4", "--record_rank_reports", "true", "--report_to", "none"], cwd=ROOT))  # fmt: skip
    _, job = yaml.safe_load_all(out.read_text())
    command = job["spec"]["trainer"]["command"]
    env = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": str(job["spec"]["trainer"]["numProcPerNode"]),
           "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port()),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    result = check(run_cmd(command, cwd=ROOT, env=env))
    assert "strategy      MULTI_CPU, 2 process(es) on 1 machine(s)" in result.stdout
    assert "resume auto: no complete checkpoint" in result.stdout
    assert [r["process_index"] for r in rank_reports(tmp_path / "claim" / "bert-ddp")] == [0, 1]


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--gpus_per_node", "4"], "needs 8 GPUs a node and a node has 4 (--gpus_per_node): pass --num_machines 2"),
        (["--num_processes", "6", "--num_machines", "4"], "6 processes do not split over 4 nodes"),
        (["--job_name", "___"], "--job_name '___': use lower-case letters"),
        (["--job_name", "7b-run"], "--job_name '7b-run': use lower-case letters, digits and '-', a letter first"),
        (["--job_name", "a" * 49], "and at most 48 characters (JobSet names its pods <name>-node-0-0-xxxxx"),
        (["--namespace", "Team_A"], "--namespace 'Team_A': use lower-case letters, digits and '-', at most 63."),
        (["--gpus_per_node", "0"], "--gpus_per_node 0: pass the GPUs a node of the pool has, 1 or more."),
        (["--submit"], "--submit: no cluster to submit to"),
        (["--max_failures", "2"], "--max_failures is not an option of --on kubernetes (it is --on ray's)"),
        # before, each of these wrote a manifest the cluster or the kubelet refuses, or a BestEffort pod
        (["--image", ""], "--on kubernetes needs --image"),
        (["--image", "ghcr.io/Acme/finetune:1"], "--image 'ghcr.io/Acme/finetune:1': write the repository in lower"),
        (["--image", "ghcr.io/acme/fine tune:1"], "--image 'ghcr.io/acme/fine tune:1' is no image reference a node"),
        (["--image", "ghcr.io/acme/finetune:v1!"], "is no image reference a node can pull: use [registry[:port]/]"),
        (["--image", "ghcr.io/acme/finetune:-1"], "a tag of at most 128 letters, digits, '_', '.', '-'"),
        (["--image", "ghcr.io/acme/finetune@sha256:abc"], "is no image reference a node can pull"),
        (["--image", "ghcr.io/acme/finetune@sha256:" + "A" * 64], "the digest is not sha256:<64 lower-case hex"),
        (["--max_restarts", "-1"], "--max_restarts -1: pass 0 (a failure ends the job) or more."),
        (["--cpus_per_node", "8 cores"], "--cpus_per_node '8 cores' is no Kubernetes quantity: a number and an"),
        (["--cpus_per_node", "0"], "--cpus_per_node 0: pass what a node gives the pod, above 0, e.g. 32 or 500m."),
        (["--memory_per_node", "64GB"], "--memory_per_node '64GB' is no Kubernetes quantity"),
        (["--memory_per_node", "64"], "--memory_per_node 64 is under 1Gi (a bare number is bytes): pass it with"),
        (["--node_selector", "pool"], "--node_selector 'pool': use key=value; e.g. --node_selector cloud.google"),
        (["--node_selector", "gpu=H100 80GB"], "the value 'H100 80GB' is no label value ([prefix/]name; a name"),
        (["--node_selector", "Example.com/pool=a"], "the key's prefix 'Example.com' is no DNS subdomain"),
        (["--node_selector", "a" * 64 + "=b"], "the key 'aaaa"),
        (["--node_selector", "pool=a", "--node_selector", "pool=b"], "the key 'pool' is given twice with different"),
        (["--toleration", "nvidia.com/gpu"], "--toleration 'nvidia.com/gpu': use key[=value]:Effect; e.g. "),
        (["--toleration", "gpu:NoSchedul"], "the effect 'NoSchedul' is none of NoSchedule, PreferNoSchedule, NoEx"),
        (["--toleration", "=x:NoSchedule"], "--toleration '=x:NoSchedule': the key '' is no label key"),
        (["--toleration", "gpu=a/b:NoSchedule"], "the value 'a/b' is no label value"),
    ],
)
def test_bad_kubernetes_launches_are_one_line(words, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))  # no cluster configured, not inside one
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SystemExit) as stop:
        written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"), *words)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    if "--submit" not in words:  # refused before anything is written
        assert err.count("\n") == 1 and not (tmp_path / "job.yaml").exists(), err


@pytest.mark.parametrize(
    ("exit_code", "conditions", "action"),
    [
        (PREEMPTED, (), "RestartJobSetAndIgnoreMaxRestarts"),  # every node saved a checkpoint and exited 75
        (137, ("DisruptionTarget",), "RestartJobSetAndIgnoreMaxRestarts"),  # its node went before the save ended
        (1, ("DisruptionTarget",), "RestartJobSetAndIgnoreMaxRestarts"),  # evicted while a peer's save failed
        (USER_ERROR, (), "FailJobSet"),
        (DIVERGED, ("DisruptionTarget",), "FailJobSet"),
        (BUDGET_SPENT, (), "FailJobSet"),
        (1, (), "RestartJobSet"),  # a crash: counted against --max_restarts
        (137, (), "RestartJobSet"),  # killed for its memory
    ],
)
def test_a_preemption_restarts_the_job_without_spending_max_restarts(exit_code, conditions, action, tmp_path):
    """What Kubernetes' Job controller and JobSet's controller do with a node's failure, from their code
    (job_failure, jobset_action). Before, a preemption's exit 75 matched no pod failure rule, so the Job failed
    with BackoffLimitExceeded, and JobSet's default restart counted it: the third preemption of a spot pool ended
    the run. A JobSet older than v0.10.0, which drops the message patterns, fails a preemption, and never restarts
    exits 2, 3 and 4 without end."""
    runtime, _ = written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    spec = runtime["spec"]["template"]["spec"]
    pod_rules = spec["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    reason, message = job_failure(pod_rules, exit_code, conditions)
    assert jobset_action(spec["failurePolicy"], reason, message) == action, (reason, message)
    old = jobset_action(spec["failurePolicy"], reason, message, patterns=False)
    assert old == ("FailJobSet" if reason == "PodFailurePolicy" else "RestartJobSet")


def test_requests_and_placement_reach_the_pods(tmp_path):
    """CPU and memory requests (with any, a pod is Burstable, not BestEffort: Kubernetes' QoS counts only these
    two), a node selector and tolerations for a GPU pool, in the runtime's pod template, valid against the CRDs.
    Before, none of these options existed."""
    runtime, job = written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
                           "--cpus_per_node", "96", "--memory_per_node", "1.5Ti",
                           "--node_selector", "cloud.google.com/gke-accelerator=nvidia-h100-80gb",
                           "--node_selector", "pool=", "--toleration", "nvidia.com/gpu=present:NoSchedule",
                           "--toleration", "cloud.google.com/gke-spot:NoExecute")  # fmt: skip
    assert errors(runtime) == [] and errors(job) == [] and jobset_webhook_errors(runtime, job) == []
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "pool": ""}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"},
        {"key": "cloud.google.com/gke-spot", "operator": "Exists", "effect": "NoExecute"},
    ]
    assert job["spec"]["trainer"]["resourcesPerNode"] == {
        "requests": {"cpu": "96", "memory": "1.5Ti"}, "limits": {"nvidia.com/gpu": 8}
    }  # fmt: skip
    plain, _ = written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    assert not {"nodeSelector", "tolerations"} & set(plain["spec"]["template"]["spec"]["replicatedJobs"][0]
                                                      ["template"]["spec"]["template"]["spec"])  # fmt: skip


GRAMMATICAL = ["500m", "96", "1.5Ti", "64Gi", "1e3", "2.5E-2", "+8Gi", "-1", ".5", "1.", "64G", "100k", "1u", "3n"]
UNGRAMMATICAL = [" 8Gi", "8Gi ", "1e3Gi", "NaN", "Infinity", "1_000", "64GB", "8gi", "1ki", "1e", "e3", "", "1..5"]


@pytest.mark.parametrize("text", GRAMMATICAL + UNGRAMMATICAL)
def test_quantities_are_what_the_api_server_takes_valued_as_the_client_values_them(text):
    """The grammar is the TrainJob CRD's own pattern for a quantity; the value, the official client's
    kubernetes.utils.parse_quantity's, which alone takes ' 8Gi', '1e3Gi', 'NaN', '1_000' (the server does not)."""
    from toolkit.clusters.kubernetes_rules import QUANTITY, quantity

    parse_quantity = pytest.importorskip("kubernetes.utils").parse_quantity
    schema = validator("TrainJob").schema["properties"]["spec"]["properties"]["trainer"]["properties"]
    pattern = schema["resourcesPerNode"]["properties"]["requests"]["additionalProperties"]["pattern"]
    assert bool(re.fullmatch(pattern.strip("^$"), text)) == bool(QUANTITY.fullmatch(text))
    if QUANTITY.fullmatch(text) and parse_quantity(text) > 0:
        assert quantity(text, "--cpus_per_node", "1") == parse_quantity(text)
    else:
        with pytest.raises(ConfigError):
            quantity(text, "--cpus_per_node", "1")


HEX = "f" * 64


@pytest.mark.parametrize(
    ("image", "problem"),
    [  # distribution/reference v0.6.0's own cases (reference_test.go), then ours
        ("test.com:5000", None),
        ("test:5000/repo:tag@sha256:" + HEX, None),
        ("192.168.1.1:5000/repo:5050", None),
        ("[2001:db8::1]:5000/repo:tag@sha256:" + HEX, None),
        ("xn--7o8h.com/myimage:xn--7o8h.com@sha512:" + "f" * 128, None),
        ("b.gcr.io/test.example.com/my-app:test.example.com", None),
        ("example.com/" + "a" * 255 + ":tag", None),
        ("lowercase:Uppercase", None),
        ("Registry.Example.com:443/acme/finetune:V1_2.3", None),
        (":justtag", "is no image reference"),
        ("@sha256:" + HEX, "is no image reference"),
        ("repo@sha256:" + "f" * 34, "the digest is not sha256"),
        ("validname@invaliddigest:" + HEX, "the digest is not sha256"),
        ("Uppercase:tag", "write the repository in lower case"),
        ("test:5000/Uppercase/lowercase:tag", "write the repository in lower case"),
        ("domain/" + "a" * 256 + ":tag", "the repository path has 263 characters, at most 255"),
        ("aa/asdf$$^/aa", "is no image reference"),
        ("[2001:db8::1]", "is no image reference"),
        ("[fe80::1%eth0]:5000/repo", "is no image reference"),
        (HEX, "a 64-hex string is an image ID"),
        ("ghcr.io/acme/finetune:" + "a" * 129, "is no image reference"),
        ("ghcr.io/acme/finetune:", "is no image reference"),
        ("ghcr.io/acme/finetune:1\n", "is no image reference"),
        ("ghcr.io/acme//finetune:1", "is no image reference"),
    ],
)
def test_image_references_follow_the_distribution_grammar(image, problem):
    from toolkit.clusters.kubernetes_rules import check_image

    if problem is None:
        check_image(image)
    else:
        with pytest.raises(ConfigError, match=re.escape(problem)) as refused:
            check_image(image)
        assert "\n" not in str(refused.value).replace(repr(image), "")


@pytest.mark.parametrize(
    ("image", "warned"),
    [
        ("ghcr.io/acme/finetune", "is untagged, so :latest, which the kubelet pulls anew on each restart"),
        ("ghcr.io/acme/finetune:latest", "is :latest, which the kubelet pulls anew on each restart: nodes restarted"),
        ("ghcr.io/acme/finetune:1", None),
        ("ghcr.io/acme/finetune:latest@sha256:" + "a" * 64, None),  # the digest is what runs
    ],
)
def test_a_mutable_image_is_a_warning(image, warned, tmp_path, capsys):
    """Before, an untagged or :latest image was written as is: a restarted node could run other code."""
    written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"), "--image", image)
    err = capsys.readouterr().err
    if warned:
        assert err.startswith(f"warning: --image {image} ") and warned in err and err.count("\n") == 1, err
    else:
        assert "warning" not in err, err


@pytest.mark.parametrize("nodes", [1, 16])
def test_a_long_recipe_name_makes_a_name_jobset_accepts(nodes):
    """The name made from a long recipe file's name (a digit first) is cut to what JobSet's pod names leave (48 for
    up to 10 nodes, 47 from 11); a name given with --job_name is never cut, but refused (above)."""
    from toolkit.clusters.kubernetes import job_name

    name = job_name(None, "7b-" + "x" * 70 + "-fsdp2", nodes)
    runtime = {
        "spec": {"template": {"spec": {"failurePolicy": {"rules": []}, "replicatedJobs": [{"name": CONTAINER}]}}}
    }
    assert name.startswith("b-xxx") and len(name) == (48 if nodes <= 10 else 47)
    assert jobset_webhook_errors(runtime, {"metadata": {"name": name}, "spec": {"trainer": {"numNodes": nodes}}}) == []


def test_a_manifest_the_writer_did_not_write_is_kept(tmp_path, capsys):
    """--output over a file of the user's: one line, the file as it was. Before, it was replaced without a word.
    The writer's own file is replaced when it runs again."""
    out = tmp_path / "job.yaml"
    out.write_text("kind: Job  # mine\n")
    with pytest.raises(SystemExit) as stop:
        written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    assert stop.value.code == 2 and out.read_text() == "kind: Job  # mine\n"
    assert capsys.readouterr().err.startswith(f"error: {out} exists and was not written by `toolkit launch`: pass ")
    out.unlink()
    first = written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    assert written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / "fsdp2.yaml")) != first


def test_no_image_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--on", "kubernetes", "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
              str(ROOT / "recipes" / "bert.py")])  # fmt: skip
    assert capsys.readouterr().err.startswith("error: --on kubernetes needs --image")


def test_submit_creates_both_objects_through_the_client(tmp_path, capsys, monkeypatch):
    """--submit with a kubeconfig whose API server is a stand-in on loopback: the official client POSTs the
    TrainingRuntime, then the TrainJob, to their resource paths in the namespace, as the file has them."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    received = []

    class APIServer(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, json.loads(body)))
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), APIServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "me"}}],
    }))  # fmt: skip
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    try:
        documents = written(tmp_path, "--config_file", "accelerate_configs/fsdp2.yaml", "--namespace", "ml", "--submit")
    finally:
        server.shutdown()
    prefix = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml"
    assert [path for path, _ in received] == [f"{prefix}/trainingruntimes", f"{prefix}/trainjobs"]
    assert [body for _, body in received] == documents
    assert "submitted TrainJob llama3-fft-fsdp2 to namespace ml" in capsys.readouterr().out


def test_the_dockerfile_gives_the_node_command_its_venv():
    """No image is built here (no Docker): what the node command relies on is read from the Dockerfile. Its working
    directory holds the repository and the .venv `make install-node` builds (the command calls .venv/bin/python,
    relative to it), and PATH has that venv first. The command itself runs in a container's environment in
    tests/test_cluster_nodes.py."""
    from toolkit.clusters.workdir import PYTHON

    lines = [line.split(maxsplit=1) for line in (ROOT / "Dockerfile").read_text().splitlines()
             if line and not line.startswith(("#", " "))]  # fmt: skip
    steps = [(word.upper(), rest.strip()) for word, rest in lines]
    workdir = next(rest for word, rest in steps if word == "WORKDIR")
    assert steps.index(("COPY", ". .")) > steps.index(("WORKDIR", workdir))
    assert any(word == "RUN" and rest.startswith("make install-node") for word, rest in steps)
    assert ("ENV", f"PATH={workdir}/{Path(PYTHON).parent}:$PATH") in steps
    assert "install-node:" in (ROOT / "Makefile").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)  # the image builds its own venv, for its own Python
