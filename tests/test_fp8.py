"""FP8 (accelerate_configs/fsdp2_fp8.yaml, torchao float8): refused where it cannot run, in one line, before
accelerate's launcher (which stops with a traceback without an FP8 library) or the run (which on a pre-Hopper GPU
quietly trains in fp16); planned with torchao's published speed-up. The GPU measurement belongs to issue #33."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import BIN, ROOT, free_port, run_cmd

from toolkit.distributed.strategy import check_fp8
from toolkit.errors import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_fp8_is_refused_on_cpu_in_one_line(tmp_path):
    """Launched as `make finetune` launches: the toolkit's launcher checks the config first."""
    result = run_cmd([str(BIN / "python"), "-m", "toolkit", "launch", "--config_file",
                      str(ROOT / "accelerate_configs" / "fsdp2_fp8.yaml"), "--num_processes", "2",
                      "--main_process_port", str(free_port()), str(ROOT / "recipes" / "llama3_fft.py"), "--tiny",
                      "--output_dir", str(tmp_path / "o")], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if not line.startswith("[INFO]")] == [
        "error: mixed_precision fp8 needs GPUs with FP8 tensor cores (compute capability 8.9+: H100, H200, L40S, "
        "B200) and this machine has no CUDA GPU: use the same strategy without FP8 (fsdp2.yaml), in bf16."
    ]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("backend", "qlora", "capability", "message"),
    [
        ("AO", True, (9, 0), "QLoRA .* with mixed_precision fp8: the 4-bit base has no float8 path"),
        ("XX", False, (9, 0), "fp8_config backend XX: accelerate knows AO, TE, MSAMP"),
        ("AO", False, (8, 0), "this GPU is 8.0"),  # A100: accelerate would train in fp16
        ("TE", False, (9, 0), r"needs transformer_engine: `pip install transformer-engine\[pytorch\]`"),
    ],
)
def test_fp8_refusals_name_the_fix(backend, qlora, capability, message):
    with pytest.raises(ConfigError, match=message):
        check_fp8(backend, qlora, capability)


def test_planner_fp8_row_assumes_torchaos_published_speedup(capsys):
    """On H100s the fsdp2_fp8 row takes fsdp2's time divided by 1.25: torchao's end-to-end float8 speed-up at 8
    GPUs / 8B parameters (docs.pytorch.org/ao, Quantized Training: "up to 1.25x at 8 GPU / 8B parameter count
    scale"); its memory is planned as fsdp2's (torchao keeps the bf16 weights and states; FSDP2's largest gathered
    unit, Llama's embeddings and head, is not float8). On A100s (no FP8 tensor cores) there is no FP8 row."""
    from toolkit.planner.cli import main

    assert main(["llama3_fft", "--gpu", "H100-80GB", "--gpus", "8", "--json"]) == 0
    configs = {c["config"]: c for c in json.loads(capsys.readouterr().out)["configs"]}
    fp8, bf16 = configs["fsdp2_fp8"], configs["fsdp2"]
    assert fp8["device_hours"] == pytest.approx(bf16["device_hours"] / 1.25)
    assert fp8["usd"] == pytest.approx(bf16["usd"] / 1.25)
    assert fp8["device_gib"] == bf16["device_gib"]
    assert main(["llama3_fft", "--gpu", "A100-80GB", "--gpus", "8", "--json"]) == 0
    assert "fsdp2_fp8" not in {c["config"] for c in json.loads(capsys.readouterr().out)["configs"]}
