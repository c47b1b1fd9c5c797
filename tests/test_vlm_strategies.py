"""An image-text recipe (gemma3_vlm_lora, tiny: Gemma 3's architecture with its SigLIP tower) on 2 processes under
each data-parallel engine, as the docs launch it: each step's loss and the exported weights equal one process's on
the same global batches. LoRA (the recipe) under DDP and ZeRO-2, a full fine-tune of the projector and language
model under FSDP2 (the tower's encoder layers and the decoder's layers each wrapped; RAM-efficient loading on) and
ZeRO-3 (its partitioned loading of a composite model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import check, launch, rank_reports, reference_run
from safetensors.torch import load_file

RECIPE = "gemma3_vlm_lora"
FULL = ("--use_lora", "false")


def flags(out: Path, per_device_batch: int, *more: str) -> list[str]:
    return ["--tiny", "--max_steps", "3", "--per_device_train_batch_size", str(per_device_batch),
            "--record_rank_reports", "true", "--report_to", "none", "--output_dir", str(out), *more]  # fmt: skip


def exported(folder: Path) -> dict[str, torch.Tensor]:
    adapter = folder / "adapter_model.safetensors"
    return load_file(adapter if adapter.is_file() else folder / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The recipe's 1-process tiny runs, global batch 8: LoRA, and the full fine-tune."""
    runs = {}

    def get(full: bool) -> Path:
        if full not in runs:
            out = tmp_path_factory.mktemp("vlm") / ("full" if full else "lora")
            runs[full] = reference_run(RECIPE, flags(out, 8, *(FULL if full else ())), out)
        return runs[full]

    return get


@pytest.mark.launch
@pytest.mark.parametrize(("config", "full"), [("ddp", False), ("zero2", False), ("fsdp2", True), ("zero3", True)])
def test_two_processes_train_the_vlm_as_one(config, full, one_process, tmp_path):
    one = one_process(full)
    out = tmp_path / "run"
    result = check(launch(config, RECIPE, *flags(out, 4, *(FULL if full else ())), cwd=tmp_path))
    assert "trains        " in result.stdout
    assert rank_reports(out)[0]["losses"] == pytest.approx(rank_reports(one)[0]["losses"], rel=1e-5)
    ours, reference = exported(out), exported(one)
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-3, atol=5e-5, msg=name)
