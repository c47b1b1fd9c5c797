"""The SLURM batch script's own logic, without training: a stand-in `srun` reports what each node would get."""

from __future__ import annotations

from conftest import ROOT, run_cmd


def test_head_address_is_the_first_host_even_in_a_large_allocation(tmp_path):
    """The rendezvous host is the allocation's first. Taken with `scontrol ... | head -n 1` under pipefail, the
    script died with SIGPIPE (exit 141) whenever head finished before scontrol had written every name: with
    100,000 names every time, with the two-node test's two names once in a while."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text("#!/bin/sh\nseq -f 'node%g' 1 100000\n")  # show hostnames
    (fake_bin / "srun").write_text('#!/bin/sh\necho "MAIN_ADDR=$MAIN_ADDR"\n')
    for tool in fake_bin.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node[1-100000]", "SLURM_SUBMIT_DIR": str(ROOT)}
    result = run_cmd(["bash", str(ROOT / "slurm" / "finetune.sbatch"), "accelerate_configs/ddp.yaml",
                      "recipes/bert.py"], cwd=tmp_path, env=env, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "MAIN_ADDR=node1"
