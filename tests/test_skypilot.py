"""`toolkit launch --on skypilot`: the task's resources are the plan's choice (`toolkit plan --choose`), SkyPilot's
own loader parses every task written (the client `make install` puts in .venv-skypilot), each GPU type's SkyPilot
name is in SkyPilot's catalog, and the run script trains for real on one node of 2 CPU processes."""

from __future__ import annotations

import csv
import json
import os
import subprocess

import pytest
import yaml
from conftest import BIN, ROOT, check, free_port, rank_reports, run_cmd

from toolkit.clusters.launch import main
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


def sky_parses(tmp_path, *paths) -> subprocess.CompletedProcess:
    """SkyPilot's own loader (schema, resources, mounts, secrets) on each file, offline, in its own environment."""
    code = "import sys, sky\nfor path in sys.argv[1:]:\n    task = sky.Task.from_yaml(path)\n    print(task.num_nodes, list(task.resources)[0].accelerators)"  # noqa: E501
    home = tmp_path / "home"  # SkyPilot writes ~/.sky
    home.mkdir(exist_ok=True)
    return run_cmd([str(SKY), "-c", code, *map(str, paths)], cwd=ROOT, env={"HOME": str(home)}, timeout=120)


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
    parsed = check(sky_parses(tmp_path, tmp_path / f"{recipe}.sky.yaml")).stdout.strip()
    assert parsed == f"{choice['nodes']} { ({sky_name: choice['gpus']}) }"  # as SkyPilot reads it


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
    with open(ROOT / "tests" / "skypilot" / "accelerators.csv") as f:
        catalog = {row["AcceleratorName"] for row in csv.DictReader(f)}
    names = {gpu: d["skypilot"] for gpu, d in price_table()["devices"].items() if d.get("skypilot")}
    assert len(names) >= 6 and set(names.values()) <= catalog, set(names.values()) - catalog


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
    ],
)
def test_bad_skypilot_launches_are_one_line(words, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        written(tmp_path, *words, "recipes/llama3_fft.py")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("bucket", "message"),
    [(None, "--on skypilot needs --bucket"), ("s3://acme/checkpoints", "pass the bucket's root")],
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
