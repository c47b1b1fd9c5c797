"""An image-text recipe (gemma3_vlm_lora, tiny: Gemma 3's architecture with its SigLIP tower) launched under
single_gpu.yaml and on 2 processes under each data-parallel engine, as the docs launch it: each step's loss and
the exported weights equal one process's on the same global batches. LoRA (the recipe) under single_gpu, DDP and
ZeRO-2, a full fine-tune of the projector and language model under FSDP2 (the tower's encoder layers and the
decoder's layers each wrapped; RAM-efficient loading on) and ZeRO-3 (its partitioned loading of a composite
model). Preempted, a run resumes bit-identically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import check, launch, preempt_at, rank_reports, reference_run
from safetensors.torch import load_file

from toolkit import run, train
from toolkit.project import load_recipe

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
@pytest.mark.parametrize(
    ("config", "full"), [("single_gpu", False), ("ddp", False), ("zero2", False), ("fsdp2", True), ("zero3", True)]
)
def test_each_engine_trains_the_vlm_as_one_process(config, full, one_process, tmp_path):
    one = one_process(full)
    out = tmp_path / "run"
    processes = 1 if config == "single_gpu" else 2
    more = FULL if full else ()
    result = check(launch(config, RECIPE, *flags(out, 8 // processes, *more), cwd=tmp_path, num_processes=processes))
    assert "trains        " in result.stdout
    assert rank_reports(out)[0]["losses"] == pytest.approx(rank_reports(one)[0]["losses"], rel=1e-5)
    ours, reference = exported(out), exported(one)
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-3, atol=5e-5, msg=name)


@pytest.mark.launch
def test_qwen2_5_vl_trains_under_fsdp2_as_one_process(tmp_path):
    """The Qwen2.5-VL recipe, tiny (M-RoPE positions from each image's grid; a tower deeper than the decoder, whose
    layers FSDP wraps by the decoder's own list, not the longest one: test_vlm_task.py), a full fine-tune on 2
    processes under FSDP2: each step's loss and the exported weights equal one process's."""
    recipe = "qwen2_5_vl_lora"
    one = reference_run(recipe, flags(tmp_path / "one", 8, *FULL), tmp_path / "one")
    out = tmp_path / "run"
    check(launch("fsdp2", recipe, *flags(out, 4, *FULL), cwd=tmp_path))
    assert rank_reports(out)[0]["losses"] == pytest.approx(rank_reports(one)[0]["losses"], rel=1e-5)
    ours, reference = exported(out), exported(one)
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-3, atol=5e-5, msg=name)


def test_a_preempted_vlm_run_resumes_bit_identically(one_process, tmp_path, monkeypatch):
    """SIGTERM at step 2: checkpoint-2, exit 75; resumed with --resume auto, the same losses and bit-identical
    weights as the uninterrupted run (the image rows' order and the optimizer come back)."""
    from toolkit.training.stopping import PREEMPTED

    preempt_at(monkeypatch, 2)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(load_recipe(RECIPE), flags(out, 8, *FULL), RECIPE)
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    train(load_recipe(RECIPE), [*flags(out, 8, *FULL), "--resume", "auto"], RECIPE)
    full, resumed = rank_reports(one_process(True))[0], rank_reports(out)[0]
    assert resumed["losses"] == full["losses"] and resumed["weights_sha256"] == full["weights_sha256"]
