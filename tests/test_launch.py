"""Real 2-process launches over gloo through `accelerate launch`: the recipes train as one distributed job."""

from __future__ import annotations

import pytest
from conftest import BIN, ROOT, check, launch, run_cmd

pytestmark = pytest.mark.launch


def test_collapsed_launch_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process: the toolkit refuses to train."""
    result = launch("", "bert", "--tiny", "--output_dir", str(tmp_path / "run"), cwd=tmp_path, launcher_args=("--cpu",))
    assert result.returncode != 0
    assert "asked for several processes but started only this one" in result.stderr
    assert "accelerate_configs/ddp.yaml" in result.stderr
    assert not (tmp_path / "run").exists()


def test_fsdp_fallback_to_ddp_is_refused(tmp_path):
    """Without the toolkit's CPU FSDP support, accelerate quietly trains an FSDP config as DDP: refused.

    Also the guard of toolkit/distributed/patches/fsdp_cpu.py: the day accelerate shards on CPU by itself, this
    run trains as FSDP, the test fails, and that module can go.
    """
    result = launch("fsdp2", "bert", "--tiny", "--output_dir", str(tmp_path / "run"), cwd=tmp_path,
                    env={"TOOLKIT_CPU_FSDP": "0"})  # fmt: skip
    assert result.returncode != 0, result.stderr[-3000:]
    assert "The config asks for FSDP but accelerate set up MULTI_CPU" in result.stderr
    assert not list((tmp_path / "run").glob("*.safetensors"))


def test_make_finetune_offline_fails_fast_then_trains_tiny(tmp_path):
    # An unreachable endpoint, without HF_HUB_OFFLINE: the reachability probe must catch it, not 30 s of retries.
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    result = run_cmd(
        ["make", "-s", "finetune", "MODEL=bert", f"BIN={BIN}", f"ARGS=--output_dir {tmp_path / 'hub'}"],
        cwd=ROOT,
        env=env,
    )
    assert result.returncode != 0
    ours = result.stderr.split("Traceback")[0]  # accelerate's launcher adds its own traceback after ours
    for way in ("--model_name_or_path", "--tiny", "make demo", "google-bert/bert-base-cased"):
        assert way in ours
    assert f'File "{ROOT / "toolkit"}' not in result.stderr  # no traceback through our code

    out = tmp_path / "tiny"
    result = check(
        run_cmd(
            [
                "make",
                "-s",
                "finetune",
                "MODEL=bert",
                f"BIN={BIN}",
                f"ARGS=--tiny --max_steps 4 --report_to none --output_dir {out}",
            ],
            cwd=ROOT,
            env=env,
        )
    )
    assert "saved to" in result.stdout
    assert (out / "model.safetensors").exists()


def test_launch_help_names_the_engines_and_each_engine_lists_its_own_options(capsys):
    """Before, `launch --help` was accelerate's alone (no engine named) and `launch --on kubernetes --help` too."""
    from toolkit.clusters.launch import ENGINES, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--num_processes" in out and all(f"  --on {name} " in out for name in ENGINES)
    for name, own in (("kubernetes", "--job_name"), ("ray", "--num_workers"), ("skypilot", "--bucket")):
        assert main(["--on", name, "--help", "recipes/llama3_fft.py", "--tiny"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m toolkit launch --on {name} ") and own in out, out
        assert "--mixed_precision" not in out  # accelerate's
