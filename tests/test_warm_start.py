"""The suite's warm start (warm_start/): ranks forked from a worker's warm process compute what cold ranks compute,
and a setting read at import time that a rank does not share with the warm process starts it cold."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import BIN, ROOT, check, launch, rank_reports, warm_log, warm_start

sys.path.insert(0, str(ROOT / "tests" / "warm_start"))
from zygote import differs  # noqa: E402

pytestmark = pytest.mark.skipif(bool(os.environ.get("TOOLKIT_TEST_COLD")), reason="TOOLKIT_TEST_COLD: no warm start")


def test_only_settings_read_at_import_send_a_rank_cold():
    env = dict(os.environ)
    assert differs(env) is None
    launched = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29501", "ACCELERATE_USE_FSDP": "true",
                "FSDP_VERSION": "2", "TORCHELASTIC_RUN_ID": "none", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30", "PYTHONUNBUFFERED": "1",
                "KMP_DUPLICATE_LIB_OK": "True", "WANDB_SERVICE": "2-1-tcp-localhost-1", "TOOLKIT_FP8_ON_CPU": "1",
                "PYTHONPATH": f"{env.get('PYTHONPATH')}:/elsewhere"}  # fmt: skip
    assert differs({**env, **launched}) is None  # what accelerate and torchrun set, read by the run itself
    for key, value in {"HF_HUB_OFFLINE": "0", "WANDB_MODE": "offline", "ATEN_CPU_CAPABILITY": "avx2",
                       "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "7"}.items():  # fmt: skip
        if env.get(key) == value:  # the suite itself runs with it (the kernel caps on a Xeon): another value
            value = "default"
        assert differs({**env, key: value}) == key
    assert differs({k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}) == "HF_HUB_OFFLINE"


@pytest.mark.launch
def test_warm_ranks_train_as_cold_ones(tmp_path):
    """The same 2-rank launch, warm and then cold (no warm process named): the launcher and both ranks forked warm
    the first time, and the two runs' losses and weights bit-identical."""
    flags = ["--tiny", "--max_steps", "3", "--record_rank_reports", "true", "--report_to", "none"]
    warm_start()
    seen = len(warm_log().read_text().splitlines())
    check(launch("ddp", "llama3_fft", *flags, "--output_dir", str(tmp_path / "warm"), cwd=tmp_path))
    started = warm_log().read_text().splitlines()[seen:]
    # The warm process has torchrun's thread count (1); a launcher shares it where the session set it (2 workers)
    launcher = "warm" if os.environ.get("OMP_NUM_THREADS") == "1" else "cold"
    expected = f"{launcher} {BIN / 'accelerate'}" + ("" if launcher == "warm" else " OMP_NUM_THREADS")
    assert started == [expected, *[f"warm {ROOT / 'recipes' / 'llama3_fft.py'}"] * 2]
    check(launch("ddp", "llama3_fft", *flags, "--output_dir", str(tmp_path / "cold"), cwd=tmp_path,
                 env={"TOOLKIT_TEST_ZYGOTE": None}))  # fmt: skip
    assert len(warm_log().read_text().splitlines()) == seen + 3
    warm, cold = rank_reports(tmp_path / "warm"), rank_reports(tmp_path / "cold")
    for a, b in zip(warm, cold, strict=True):
        assert a["losses"] == b["losses"] and len(a["losses"]) == 3
        assert a["weights_sha256"] == b["weights_sha256"]
