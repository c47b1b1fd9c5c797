"""The SLURM scripts' own logic, without SLURM: stand-ins for `srun` and `scontrol` report what each node would get,
what the launcher would be given, and whether the job would be requeued."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import yaml
from conftest import BIN, ROOT, run_cmd

from toolkit.distributed.launch_check import check_mesh
from toolkit.settings.mesh import job_mesh


def tools(folder, **scripts):
    folder.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def test_head_address_is_the_first_host_even_in_a_large_allocation(tmp_path):
    """The rendezvous host is the allocation's first. Taken with `scontrol ... | head -n 1` under pipefail, the
    script died with SIGPIPE (exit 141) whenever head finished before scontrol had written every name: with
    100,000 names every time, with the two-node test's two names once in a while."""
    fake_bin = tools(tmp_path / "bin", scontrol="#!/bin/sh\nseq -f 'node%g' 1 100000\n",
                     srun='#!/bin/sh\necho "MAIN_ADDR=$MAIN_ADDR"\n')  # fmt: skip
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node[1-100000]", "SLURM_SUBMIT_DIR": str(ROOT)}
    result = run_cmd(["bash", str(ROOT / "slurm" / "finetune.sbatch"), "accelerate_configs/ddp.yaml",
                      "recipes/bert.py"], cwd=tmp_path, env=env, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "MAIN_ADDR=node1"


@pytest.mark.parametrize(
    ("exit_code", "signalled", "requeued"),
    [(0, True, False), (2, True, False), (3, True, False), (4, True, False), (75, True, True), (75, False, True),
     (137, True, True), (1, False, False)],
)  # fmt: skip
def test_only_what_can_resume_is_requeued(exit_code, signalled, requeued, tmp_path):
    """The batch script after its job step ends: requeued on 75 (preempted, checkpoint written) or when a signal
    arrived and the job died otherwise (killed mid-save); not on a finished run, nor on bad input (2), a diverged
    loss (3) or a spent budget (4), which a requeue would only repeat. Before, any signal meant a requeue."""
    # the job step gets the forwarded signal and ends with its own code, as a real srun's tasks would
    signal = 'trap "" USR1; kill -USR1 "$PPID"; sleep 0.5\n' if signalled else ""
    fake_bin = tools(tmp_path / "bin", scontrol=f"#!/bin/sh\n[ \"$1\" = requeue ] && touch {tmp_path}/requeued\n"
                     "echo 127.0.0.1\n", srun=f"#!/bin/sh\n{signal}exit {exit_code}\n")  # fmt: skip
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_ID": "42"}  # fmt: skip
    result = run_cmd(["bash", str(ROOT / "slurm" / "finetune.sbatch"), "accelerate_configs/ddp.yaml",
                      "recipes/bert.py"], cwd=tmp_path, env=env, timeout=60)  # fmt: skip
    assert (tmp_path / "requeued").exists() == requeued, result.stdout + result.stderr
    assert result.returncode == (0 if requeued else exit_code)


MESH_CONFIGS = {  # config -> MESH_FLAGS fitting 2 GPUs per node (the shipped sp and cp are 8)
    "tp": "", "fsdp2_tp": "", "fsdp_hybrid": "", "zero3_sp": "--parallelism_config_sp_size=2",
    "fsdp2_cp": "--parallelism_config_cp_size=2", "pp": "", "pp_ddp": "", "fsdp2_ep": "",
}  # fmt: skip


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("config", MESH_CONFIGS)
def test_launch_node_sizes_each_mesh_config_for_the_job(config, nodes, tmp_path):
    """slurm/launch_node.sh on each node of a job of `nodes` x 2 GPUs: the launcher gets the config's model-parallel
    axes and data-parallel sizes for the job, which `toolkit check`'s mesh checks accept (before, every launch got
    dp_replicate=nodes x dp_shard=GPUs per node whatever the file's mesh: tp.yaml on one node of 2 ended in "the
    mesh dp_shard=2 x tp=2 covers 4 processes and the launch has 2")."""
    python = tools(tmp_path / "bin", python=f'#!/bin/sh\nif [ "$3" = launch ]; then echo "$@"; exit 0; fi\n'
                   f'exec {BIN / "python"} "$@"\n')  # fmt: skip
    path = ROOT / "accelerate_configs" / f"{config}.yaml"
    for node in range(nodes):
        env = {"SLURM_NODEID": str(node), "SLURM_NNODES": str(nodes), "MAIN_ADDR": "127.0.0.1", "GPUS_PER_NODE": "2",
               "MESH_FLAGS": MESH_CONFIGS[config], "PATH": f"{python}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
        result = run_cmd(["bash", str(ROOT / "slurm" / "launch_node.sh"), str(path), "recipes/llama3_fft.py"],
                         cwd=tmp_path, env=env, timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stderr
        flags = [f for f in result.stdout.split() if f.startswith("--parallelism_config_")]
        file = yaml.safe_load(path.read_text())
        section = dict(file["parallelism_config"])
        for flag in MESH_CONFIGS[config].split():
            key, value = flag.removeprefix("--").split("=")
            section[key] = int(value)
        mesh = job_mesh(section, nodes, 2)
        assert flags == [f"--parallelism_config_{axis}_size={size}" for axis, size in mesh.items()]
        assert f"--num_processes {2 * nodes}" in result.stdout and f"--machine_rank {node}" in result.stdout
        launched = {
            **file,
            "num_processes": 2 * nodes,
            "parallelism_config": {**section, **{f"parallelism_config_{a}_size": s for a, s in mesh.items()}},
        }
        check_mesh(launched, path, "qwen3_moe_fft" if config == "fsdp2_ep" else "llama3_fft")  # EP: a MoE


def test_a_mesh_that_cannot_fit_the_nodes_is_one_line(tmp_path):
    env = {"SLURM_NODEID": "0", "SLURM_NNODES": "1", "MAIN_ADDR": "127.0.0.1", "GPUS_PER_NODE": "2",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    result = run_cmd(["bash", str(ROOT / "slurm" / "launch_node.sh"), str(ROOT / "accelerate_configs" /
                      "zero3_sp.yaml"), "recipes/llama3_fft.py"], cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: the mesh sp=8 does not divide the job's 2 ")
    assert "MESH_FLAGS=--parallelism_config_<axis>_size=N" in result.stderr


def node_env(tmp_path, **values):
    """launch_node.sh's environment on one node, with `python` a stand-in that prints the launch it is given."""
    python = tools(tmp_path / "bin", python=f'#!/bin/sh\nif [ "$3" = launch ]; then echo "$@"; exit 0; fi\n'
                   f'exec {BIN / "python"} "$@"\n')  # fmt: skip
    env = {"SLURM_NODEID": "0", "SLURM_NNODES": "1", "MAIN_ADDR": "127.0.0.1", "GPUS_PER_NODE": "2",
           "SLURM_GPUS_ON_NODE": None, "MESH_FLAGS": None,
           "PATH": f"{python}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    return {**env, **values}


def run_launch_node(tmp_path, env):
    return run_cmd([shutil.which("bash"), str(ROOT / "slurm" / "launch_node.sh"), str(ROOT / "accelerate_configs" /
                    "ddp.yaml"), "recipes/llama3_fft.py"], cwd=tmp_path, env=env, timeout=120)  # fmt: skip


def test_launch_node_without_a_gpu_count_says_what_to_set(tmp_path):
    """No GPUS_PER_NODE, no SLURM_GPUS_ON_NODE and no nvidia-smi (a CPU host, a login node): one line naming the
    variable to set. Before, the failed `nvidia-smi | wc -l` under pipefail ended the script with 127 and nothing
    said."""
    only = tools(tmp_path / "only")  # PATH: grep and hostname, and no nvidia-smi
    for name in ("grep", "hostname"):
        (only / name).symlink_to(shutil.which(name))
    result = run_launch_node(tmp_path, node_env(tmp_path, GPUS_PER_NODE=None, PATH=str(only)))
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: ") and "export GPUS_PER_NODE=" in result.stderr


@pytest.mark.parametrize(
    ("variables", "named"),
    [({"SLURM_NODEID": "2", "SLURM_NNODES": "2"}, "SLURM_NODEID=2"),  # counted from 1
     ({"SLURM_NODEID": "-1", "SLURM_NNODES": "2"}, "SLURM_NODEID=-1"),
     ({"SLURM_NODEID": "one", "SLURM_NNODES": "2"}, "SLURM_NODEID=one"),
     ({"SLURM_NODEID": "0", "SLURM_NNODES": "0"}, "SLURM_NNODES=0"),
     ({"SLURM_NODEID": "0", "SLURM_NNODES": "two"}, "SLURM_NNODES=two"),
     ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE=0"),
     ({"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE=eight")],
)  # fmt: skip
def test_launch_node_refuses_ids_and_counts_out_of_range(variables, named, tmp_path):
    """A node id outside 0..SLURM_NNODES-1 (ids counted from 1, by hand), a node or GPU count that is not a positive
    integer: one line naming the fix before anything starts. Before, SLURM_NODEID=N of N nodes was launched and
    waited out the rendezvous (60 s) for a rank that no node has."""
    result = run_launch_node(tmp_path, node_env(tmp_path, **variables))
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: ") and named in result.stderr
    if "SLURM_NODEID" in named:
        assert "from 0 to 1" in result.stderr  # the ids of 2 nodes


def test_launch_node_accepts_the_last_node_and_leading_zeros(tmp_path):
    """Leading zeros are decimal (bash's arithmetic took 08 as a bad octal number)."""
    result = run_launch_node(tmp_path, node_env(tmp_path, SLURM_NODEID="01", SLURM_NNODES="2", GPUS_PER_NODE="08"))
    assert result.returncode == 0, result.stderr
    assert "--num_processes 16 --machine_rank 1 " in result.stdout


def test_arrays_expand_under_set_u_on_bash_before_4_4():
    """bash before 4.4 (CentOS 7, Amazon Linux 2) takes an empty array's "${a[@]}" as unbound under set -u: every
    first submission of finetune.sbatch (no --resume yet) died there. No bash that old is on this machine: this reads
    the scripts for any array expansion not in the form safe since bash 4.2, ${a[@]+"${a[@]}"}."""
    for script in sorted((ROOT / "slurm").iterdir()):
        text = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
        unguarded = re.sub(r'\$\{(\w+)\[@\]\+"\$\{\1\[@\]\}"\}', "", text)
        assert not re.findall(r"\$\{\w+\[[@*]\]\}", unguarded), script


@pytest.mark.parametrize("restarts", [None, "1"])
def test_batch_script_passes_resume_only_on_a_requeue(restarts, tmp_path):
    """The script under this machine's bash: the first submission passes the recipe flags alone, a requeued job
    adds --resume auto."""
    fake_bin = tools(tmp_path / "bin", scontrol="#!/bin/sh\necho node1\n", srun='#!/bin/sh\necho "$@"\n')
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_RESTART_COUNT": restarts}  # fmt: skip
    result = run_cmd(["bash", str(ROOT / "slurm" / "finetune.sbatch"), "accelerate_configs/ddp.yaml",
                      "recipes/bert.py", "--max_steps", "5"], cwd=tmp_path, env=env, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    resume = " --resume auto" if restarts else ""
    assert result.stdout.strip().endswith(f"recipes/bert.py --max_steps 5{resume}"), result.stdout
