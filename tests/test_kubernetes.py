"""`toolkit launch --on kubernetes`: every config's TrainingRuntime and TrainJob validate against Kubeflow Trainer's
published CRD schemas (tests/crds/, offline), and the command a node's container runs trains for real."""

from __future__ import annotations

import copy
import gzip
import json
import os
from functools import cache

import pytest
import yaml
from conftest import BIN, ROOT, check, free_port, rank_reports, run_cmd
from jsonschema import Draft7Validator, FormatChecker

from toolkit.clusters.launch import main
from toolkit.distributed.launch_check import strategy_files
from toolkit.errors import BUDGET_SPENT, DIVERGED, USER_ERROR

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
    import re

    found, spec = [], runtime["spec"]["template"]["spec"]
    names = [rule["name"] for rule in spec["failurePolicy"]["rules"]]
    for rule in spec["failurePolicy"]["rules"]:
        if not (
            1 <= len(rule["name"]) <= 128 and re.fullmatch(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", rule["name"])
        ):
            found.append(f"invalid failure policy rule name '{rule['name']}'")
        found += [f"invalid job failure reason '{r}'" for r in rule.get("onJobFailureReasons", []) if r not in
                  JOB_FAILURE_REASONS]  # fmt: skip
    if len(set(names)) < len(names):
        found.append("rule names are not unique")
    nodes = trainjob["spec"]["trainer"]["numNodes"]
    for job in spec["replicatedJobs"]:  # Trainer runs the nodes as one Job's indexed pods
        pod = f"{trainjob['metadata']['name']}-{job['name']}-0-{nodes - 1}-abcde"
        if len(pod) > 63 or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", pod):
            found.append(f"pod name {pod} is not an RFC 1035 label of at most 63")
    return found


@pytest.mark.parametrize("config", [p.name for p in strategy_files()])
def test_every_config_validates_against_the_crds(config, tmp_path):
    settings = yaml.safe_load((ROOT / "accelerate_configs" / config).read_text())
    recipe = "qwen3_moe_fft" if config == "fsdp2_ep.yaml" else "llama3_fft"  # expert parallelism needs experts
    runtime, job = written(tmp_path, "--config_file", str(ROOT / "accelerate_configs" / config), recipe=recipe)
    assert errors(runtime) == [] and errors(job) == []
    assert jobset_webhook_errors(runtime, job) == []  # before: the rule "final-exit-codes", refused
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "apiGroup": "trainer.kubeflow.org",
                                         "kind": "TrainingRuntime"}  # fmt: skip
    nodes, per_node = job["spec"]["trainer"]["numNodes"], job["spec"]["trainer"]["numProcPerNode"]
    assert (nodes, nodes * per_node) == (settings.get("num_machines", 1), settings["num_processes"])
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == per_node
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


@pytest.mark.parametrize("nodes", [1, 16])
def test_a_long_recipe_name_makes_a_name_jobset_accepts(nodes):
    """The name made from a long recipe file's name (a digit first) is cut to what JobSet's pod names leave (48 for
    up to 10 nodes, 47 from 11); a name given with --job_name is never cut, but refused (above)."""
    from toolkit.clusters.kubernetes import CONTAINER, job_name

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
