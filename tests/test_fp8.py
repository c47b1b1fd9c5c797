"""FP8 (accelerate_configs/fsdp2_fp8.yaml, torchao float8): launched for real on CPU, where torchao's float8
training runs (TOOLKIT_FP8_ON_CPU=1 passes the capability refusal), through train, checkpoint, resume and export at
the recipe's bf16; each GPU defect of ../shared/gpu/README.md tested at its cause (accelerate's own refusal of the
file as first shipped, float8 weight wrappers in the state dict, accelerate's upcast of a wrapper, compile);
refused where it cannot run, in one line; planned with torchao's published speed-up, which assumes compile."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from conftest import BIN, ROOT, check, free_port, launch, rank_reports, run_cmd
from safetensors.torch import load_file

from toolkit.distributed.strategy import check_fp8
from toolkit.errors import ConfigError
from toolkit.settings.compile import choose_compile

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


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


def test_what_accelerate_refuses_after_loading_is_refused_before():
    """accelerate's Accelerator refuses torchao under FSDP with RAM-efficient loading, and MS-AMP under FSDP, once
    the weights have loaded (the file as first shipped crashed so on the H100): the toolkit refuses both first,
    and passes the file as shipped now. The conditions are read from accelerate's own source, which a new
    accelerate that drops them fails here."""
    import inspect

    from accelerate import Accelerator

    source = inspect.getsource(Accelerator.__init__)
    assert "torchao with FSDP2 and cpu_ram_efficient_loading is not supported" in source
    assert "`accelerate` + `MS-AMP` + `FSDP` is not supported" in source
    with pytest.raises(ConfigError, match="set fsdp_cpu_ram_efficient_loading: false"):
        check_fp8("AO", False, (9, 0), "FSDP", ram_efficient_loading=True)
    with pytest.raises(ConfigError, match="MSAMP under FSDP"):
        check_fp8("MSAMP", False, (9, 0), "FSDP")
    shipped = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2_fp8.yaml").read_text())
    assert shipped["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is False
    check_fp8(shipped["fp8_config"]["backend"], False, (9, 0), "FSDP", False)  # an H100: accepted


@pytest.mark.parametrize(
    ("setting", "fp8", "on_gpu", "processes", "lora", "attention", "liger", "on", "why"),
    [
        ("auto", True, True, 8, False, "flex_attention", False, True, "0.46x of bf16 without"),
        ("auto", True, False, 2, False, "sdpa", False, True, "FP8"),  # FP8 compiles on any device
        ("auto", False, True, 1, False, "flex_attention", False, True, "measured 1.27x"),
        ("auto", False, True, 1, True, "flex_attention", False, False, "not yet measured"),  # LoRA
        ("auto", False, True, 8, False, "flex_attention", False, False, "not yet measured"),  # sharded / DDP
        ("auto", False, True, 1, False, "flex_attention", True, False, "Liger"),
        ("auto", False, False, 1, False, "sdpa", False, False, "no GPU"),
        (True, False, False, 1, False, "sdpa", False, True, ""),  # asked for: honoured
        (False, True, False, 2, False, "sdpa", False, False, ""),  # a CPU (the tests): eager FP8 allowed
    ],
)  # fmt: skip
def test_compile_auto_table(setting, fp8, on_gpu, processes, lora, attention, liger, on, why):
    """--torch_compile auto from the H100's measurements (settings/compile.py): on under FP8 and for a
    single-GPU full fine-tune with flex attention, off where not measured faster or stacked on Liger."""
    chosen, note = choose_compile(setting, fp8=fp8, on_gpu=on_gpu, processes=processes, replicated=processes == 1,
                                  lora=lora, attention=attention, liger=liger)  # fmt: skip
    assert chosen is on and why in note and bool(note) == bool(why), note


def test_fp8_without_compile_on_a_gpu_is_refused_with_the_measurement():
    with pytest.raises(ConfigError, match="0.46x of bf16's speed on an H100"):
        choose_compile(False, fp8=True, on_gpu=True, processes=8, replicated=False, lora=False,
                       attention="flex_attention", liger=False)  # fmt: skip


def tiny_float8_model(convert: bool = True):
    """A tiny Llama in bf16 with accelerate's own float8 conversion (its AO recipe's defaults)."""
    from accelerate.utils.ao import convert_model_to_fp8_ao
    from torchao.float8 import Float8LinearConfig
    from transformers import AutoModelForCausalLM

    from toolkit.models import tiny

    model = AutoModelForCausalLM.from_pretrained(tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft"),
                                                 dtype=torch.bfloat16)  # fmt: skip
    if convert:
        convert_model_to_fp8_ao(model, Float8LinearConfig(enable_fsdp_float8_all_gather=True, pad_inner_dim=True))
    return model


def test_float8_weights_save_and_reload_as_plain_tensors(tmp_path):
    """torchao's float8 layers hold their weights in a wrapper (WeightWithDynamicFloat8CastTensor): saved as the
    model's state dict, safetensors fails on it ("invalid python storage", the H100's final save); the trainer's
    save writes the plain tensors inside, which load back into a model without float8."""
    from transformers import AutoModelForCausalLM

    from toolkit.training.checkpoints import plain_state_dict

    model = tiny_float8_model()
    model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()  # a real float8 step
    assert any(type(p).__name__ == "WeightWithDynamicFloat8CastTensor" for p in model.parameters())
    with pytest.raises(RuntimeError, match="invalid python storage"):
        model.save_pretrained(tmp_path / "as_is")
    model.save_pretrained(tmp_path / "plain", state_dict=plain_state_dict(model, None))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.bfloat16)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(getattr(ours, "_tensor", ours), theirs), name
    assert plain_state_dict(reloaded, None) is None  # nothing to unwrap: the Trainer's own save


def test_master_weights_under_fp8_are_fp32_inside_the_float8_wrappers():
    """accelerate upcasts FSDP's trainable weights with `param.data = param.data.to(fp32)`, after its float8
    conversion has wrapped them: the wrapper then says float32 and holds bf16, and FSDP2 fails on the mixed
    dtypes at its first forward. The toolkit upcasts the plain weights first (under FP8), so every weight and
    the tensor inside every wrapper is fp32 when accelerate gets there."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from accelerate.utils.ao import convert_model_to_fp8_ao

    from toolkit.training.precision import keep_master_weights

    def upcast_as_accelerate_does(model):  # accelerate/utils/fsdp_utils.py, fsdp2_prepare_model
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)

    inner = lambda p: getattr(p, "_tensor", p).dtype  # noqa: E731
    model = tiny_float8_model()
    upcast_as_accelerate_does(model)
    assert {inner(p) for p in model.parameters()} == {torch.float32, torch.bfloat16}  # the defect

    model = tiny_float8_model(convert=False)
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(distributed_type=DistributedType.FSDP),
                              args=SimpleNamespace(bf16=True, fp16=False, mixed_precision="fp8"))  # fmt: skip
    masters, note = keep_master_weights(trainer, None)
    assert masters is None and "fp32 master weights (FSDP" in note
    convert_model_to_fp8_ao(model)  # accelerate's prepare: float8 conversion, then the upcast
    upcast_as_accelerate_does(model)
    assert {(p.dtype, inner(p)) for p in model.parameters()} == {(torch.float32, torch.float32)}


@pytest.mark.launch
def test_fp8_config_trains_checkpoints_resumes_and_exports_on_cpu(tmp_path):
    """accelerate_configs/fsdp2_fp8.yaml as shipped, on 2 CPU processes over gloo, at llama3_fft's own precision
    (bf16 weights; tiny mode's fp32 on a CPU would hide the dtype defects): accelerate accepts the file, every
    float8-able layer trains in float8, the masters are fp32 shards (as the header says) with fp32 AdamW states,
    a checkpoint written half-way resumes to the same losses and bit-identical weights, and the export is plain
    tensors that load anywhere. Eager (--torch_compile false): compile on a CPU recompiles for ~90 s per batch
    width; on a GPU FP8 compiles (test_compile_auto_table), which make gpu-check launches."""
    from transformers import AutoModelForCausalLM

    env = {"TOOLKIT_FP8_ON_CPU": "1"}
    flags = [
        "--tiny",
        "--bf16",
        "true",
        "--dtype",
        "bfloat16",
        "--torch_compile",
        "false",
        "--report_to",
        "none",
        "--max_steps",
        "6",
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
        "--record_rank_reports",
        "true",
    ]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = check(launch("fsdp2_fp8", "llama3_fft", *flags, "--output_dir", str(whole), cwd=tmp_path, env=env))
    assert "precision     fp8, weights bfloat16, fp32 master weights (FSDP" in result.stdout
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-3", resumed / "checkpoint-3")
    check(launch("fsdp2_fp8", "llama3_fft", *flags, "--output_dir", str(resumed), "--resume", "auto",
                 cwd=tmp_path, env=env))  # fmt: skip

    reports = [rank_reports(d) for d in (whole, resumed)]
    total = sum(t.numel() for t in load_file(whole / "model.safetensors").values())
    for rank in reports[0]:
        assert rank["float8_layers"] == 13  # of 15 linear layers: all but the first and the head (accelerate's rule)
        assert rank["param_bytes"] == 4 * total // 2  # fp32 master shards
        assert rank["optimizer_state_bytes"] == 2 * rank["param_bytes"]  # fp32 AdamW moments of them
    for a, b in zip(*reports, strict=True):
        assert a["losses"] == b["losses"] and a["weights_sha256"] == b["weights_sha256"]
    exported = [load_file(d / "model.safetensors") for d in (whole, resumed)]
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])
    model = AutoModelForCausalLM.from_pretrained(whole)
    for name, param in model.named_parameters():
        assert type(param) is torch.nn.Parameter and torch.equal(param.detach(), exported[0][name]), name


def test_fp8_speedup_scales_by_the_flops_its_float8_linears_run():
    """torchao's published 1.25x is a dense 8B model's, whose float8 linears run 93% of its FLOPs; a mixture of
    experts' fused experts are not linear layers and stay 16-bit (Qwen3-30B-A3B: 30% converted, 1.07x). The share
    is counted as accelerate converts: a tiny Qwen3-MoE converted for real by `convert_model_to_fp8_ao` has exactly
    the float8 weights the share counts. (The plan's fsdp2_fp8 row is fsdp2's times it: tests/test_choose.py.)"""
    from accelerate.utils.ao import convert_model_to_fp8_ao
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.data.sources import stored_config
    from toolkit.models import tiny
    from toolkit.planner.compiled import float8_share, float8_speedup
    from toolkit.planner.shape import Shape

    llama = float8_share(stored_config("meta-llama/Meta-Llama-3-8B"), "sft")
    assert llama > 0.9 and float8_speedup(llama, 1.25) == pytest.approx(1.25)
    moe = float8_share(stored_config("Qwen/Qwen3-30B-A3B"), "sft")
    assert 0.25 < moe < 0.35 and 1.05 < float8_speedup(moe, 1.25) < 1.1
    config = AutoConfig.from_pretrained(tiny.tiny_checkpoint("Qwen/Qwen3-30B-A3B", "sft"))
    model = AutoModelForCausalLM.from_config(config)
    shape = Shape.of(model, config)
    convert_model_to_fp8_ao(model)
    converted = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Float8Linear")
    assert 0 < converted and float8_share(config, "sft") == pytest.approx(converted / (shape.active - shape.lookups))
