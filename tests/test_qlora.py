"""QLoRA (--load_in_4bit): bitsandbytes' 4-bit NF4 base with double quantization under a LoRA adapter, on CPU.
The planner's bytes for the 4-bit base equal what bitsandbytes really stores; a tiny run learns and saves its
adapter; the combinations that cannot work are one line before anything loads."""

from __future__ import annotations

import json

import pytest
import torch
from llama3_qlora import RECIPE as QLORA

from toolkit import train
from toolkit.errors import ConfigError
from toolkit.models import tiny
from toolkit.models.counts import ParameterCounts
from toolkit.models.loading import load_model
from toolkit.models.lora import add_lora
from toolkit.planner import Layout, Shape, Workload, meta_model, plan_memory
from toolkit.project import PROJECT_ROOT
from toolkit.settings.model_arguments import ModelArguments

pytest.importorskip("bitsandbytes")
LLAMA = "meta-llama/Meta-Llama-3-8B"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_4bit_weights_are_what_bitsandbytes_stores(dtype, llama_tokenizer):
    """Every parameter's storage plus each 4-bit weight's block scales (absmax and their fp32 scales, the NF4
    tables), against the planner's NF4 bytes per weight for the linear layers and the loaded dtype for the rest
    (embeddings, head, norms), the adapter in its own dtype; the counts are the unquantized model's."""
    folder = tiny.tiny_checkpoint(LLAMA, "sft")
    args = ModelArguments(model_name_or_path=str(folder), dtype=dtype, use_lora=True, load_in_4bit=True)
    model = add_lora(load_model(args, "sft", llama_tokenizer, None), args, "sft")
    assert type(model.base_model.model.model.layers[0].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    held = ParameterCounts.of(model)
    shape = Shape.of(meta_model(model.config, "sft", args.lora_settings()), model.config)
    assert (held.total, held.trainable) == (shape.total, shape.trainable)
    assert shape.quantizable > 0.5 * shape.frozen
    work = Workload(precision="fp32" if dtype == "float32" else "bf16", weights_4bit=True)
    planned = plan_memory(shape, Layout.from_file(PROJECT_ROOT / "accelerate_configs" / "single_gpu.yaml"), work, 1)
    # The frozen base, which is what 4 bits change (peft keeps the adapter in fp32 whatever the plan's dtype);
    # less each 4-bit tensor's fixed tables (the NF4 and nested 8-bit codes: 1,092 bytes, 0.25 MB over
    # Llama-3-8B's 224 weights), which only these 64 x 64 instances notice.
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    tables = sum(1092 for p in model.parameters() if getattr(p, "quant_state", None) is not None)
    planned_base = planned.device["parameters"] - shape.trainable * (4 if dtype == "float32" else 2)
    assert held.held_bytes - adapter - tables == pytest.approx(planned_base, rel=0.001)


def test_qlora_run_learns_and_saves_its_adapter(tmp_path):
    """The recipe's tiny run: the loss falls, the adapter alone is saved, and the run's own memory plan holds
    the 4-bit base it loaded."""
    out = tmp_path / "run"
    trainer = train(QLORA, ["--tiny", "--max_steps", "12", "--report_to", "none", "--output_dir", str(out)],
                    "llama3_qlora").trainer  # fmt: skip
    rows = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0]
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == QLORA["lora_r"]
    tables = sum(1092 for p in trainer.model.parameters() if getattr(p, "quant_state", None) is not None)
    assert tables and trainer.memory_plan.device["parameters"] == pytest.approx(  # the run planned its 4-bit base
        trainer.param_counts.held_bytes - tables, rel=0.001
    )


DEFERRED = """
import sys
from toolkit.startup import heavy_imports
with heavy_imports():
    import toolkit.runner
assert "bitsandbytes" not in sys.modules, "imported with the Trainer stack"
from transformers.utils.import_utils import is_bitsandbytes_available
from peft.import_utils import is_bnb_4bit_available
assert is_bitsandbytes_available() and is_bnb_4bit_available()
from peft.tuners.lora.bnb import Linear4bit
print("4-bit LoRA layers:", Linear4bit.__name__)
"""


def test_bitsandbytes_waits_for_a_4bit_run():
    """A process's start (toolkit.startup.heavy_imports) leaves bitsandbytes out of the Trainer stack's import
    (~1.1 s of CPU a rank); it is still installed for transformers and peft, and their 4-bit layers import it."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", DEFERRED], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4-bit LoRA layers: Linear4bit" in result.stdout


@pytest.mark.launch
def test_qlora_under_ddp_trains_as_one_process(tmp_path):
    """2 processes x 4 rows under DDP (the 4-bit base replicated on each, the adapter's gradients averaged) take
    the losses and the adapter of 1 process x 8."""
    from conftest import check, launch, rank_reports
    from safetensors.torch import load_file

    flags = ["--tiny", "--max_steps", "4", "--packing", "false", "--record_rank_reports", "true", "--report_to",
             "none"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    train(QLORA, [*flags, "--per_device_train_batch_size", "8", "--output_dir", str(one)], "llama3_qlora")
    check(launch("ddp", "llama3_qlora", *flags, "--per_device_train_batch_size", "4", "--output_dir", str(two),
                 cwd=tmp_path))  # fmt: skip
    assert rank_reports(two)[0]["losses"] == pytest.approx(rank_reports(one)[0]["losses"], rel=1e-4)
    ours, reference = load_file(two / "adapter_model.safetensors"), load_file(one / "adapter_model.safetensors")
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-3, atol=2e-4, msg=name)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--use_lora", "false"], {}, "add --use_lora true \\(QLoRA\\), or drop --load_in_4bit"),
        (["--merge_lora", "true"], {}, "--merge_lora would merge the adapter into 4-bit rounded weights"),
        ([], {"ACCELERATE_USE_FSDP": "true"}, "QLoRA \\(--load_in_4bit\\) trains under single_gpu.yaml or ddp.yaml"),
    ],
    ids=["without-lora", "merge", "fsdp"],
)
def test_impossible_qlora_is_one_line(flags, env, message, tmp_path, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=message):
        train(QLORA, ["--tiny", *flags, "--output_dir", str(tmp_path / "run")], "llama3_qlora")


def test_qlora_plan_is_the_h100s_measurement():
    """llama3_qlora's adapter over a 4-bit Llama-3.2-1B-shaped base, packed rows of 4,096 tokens x 2, the fused loss:
    one H100 measured a peak of 18.25 GiB (torch.cuda.max_memory_allocated; ../shared/gpu/README.md, bench/mfu.py's
    qlora row, 2026-11-25), where the plan said 14.83 and "fits" could run out of memory. Its activations had been
    measured on the base model without the adapters: peft's LoRA saves a 16-bit copy of every adapted input for
    lora_A's backward (under the run's autocast) and CUDA's dropout a 1-byte mask over it. The plan within 10%."""
    import sys
    from dataclasses import replace

    from conftest import ROOT

    from toolkit.planner import Shape, meta_model
    from toolkit.planner.activations import measured_activations
    from toolkit.planner.layout import Layout
    from toolkit.planner.memory import plan_memory
    from toolkit.planner.workload import Workload

    sys.path.insert(0, str(ROOT / "bench"))
    import mfu

    config = mfu.model_config(toy=False)
    settings = mfu.qlora_settings()
    lora = {"r": settings["lora_r"], "lora_alpha": settings["lora_alpha"], "target_modules": "all-linear"}
    shape = Shape.of(meta_model(config, "sft", lora), config)
    work = Workload(precision="bf16", micro_batch=2, seq_length=4096, fused_head=True, weights_4bit=True,
                    master_weights=True, trainable_fp32=True, lora_dropout=QLORA["lora_dropout"],
                    cuda_context_gib=0)  # fmt: skip
    fit, note = measured_activations(config, "sft", "bf16", True, True, lora, autocast=True)
    planned = plan_memory(replace(shape, activations=fit), Layout.replicated("single_gpu", 1), work, 1)
    assert planned.device_total / 2**30 == pytest.approx(18.25, rel=0.10), planned.device
    assert planned.device["lora_dropout"] / 2**30 == pytest.approx(2.5, rel=0.01)  # 20,480 inputs x 16 x 8,192
