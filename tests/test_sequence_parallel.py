"""Long rows split over ranks: DeepSpeed's Ulysses sequence parallelism (accelerate_configs/zero3_sp.yaml) trains
on CPU over gloo, for real; torch's context parallelism (fsdp2_cp.yaml) is refused there in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import BIN, ROOT, assert_updates_agree, check, free_port, launch, rank_reports, reference_run, run_cmd
from safetensors.torch import load_file
from transformers import LlamaConfig

from toolkit.errors import ConfigError
from toolkit.models.parallel import CP_ON_CPU, check_mesh_size, check_sequence_split
from toolkit.settings.parser import parse

# Unpacked rows: under sdpa a split does not pack (its mask is one causal row), so the reference does not either.
# The recipe's precision (bf16 weights; tiny mode's fp32 on a CPU would hide what bf16 meets), and rows much
# shorter than max_seq_length, which a split pads only to a multiple of sp.
FLAGS = ["--tiny", "--report_to", "none", "--max_steps", "4", "--logging_steps", "1", "--packing", "false",
         "--record_rank_reports", "true", "--save_strategy", "no", "--bf16", "true", "--dtype", "bfloat16",
         "--max_seq_length", "256"]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    return reference_run("llama3_fft", FLAGS, tmp_path_factory.mktemp("sp-reference"))


@pytest.mark.launch
def test_sequence_parallel_matches_one_process(one_process, tmp_path):
    """zero3_sp.yaml, 2 ranks, sp=2, against 1 process with the same global batch (8 rows a step): a step trains
    one rank's rows cut across both, so the losses and gradient norms are the 1-process run's step for step, the
    tokens are counted once, the export is the same model; each rank holds half the parameters (ZeRO-3) and,
    measured in the first step's forward, the activations the plan gives at half the sequence."""
    one, out = one_process, tmp_path / "out"
    result = check(launch("zero3_sp", "llama3_fft", *FLAGS, "--output_dir", str(out), cwd=tmp_path,
                          launcher_args=("--parallelism_config_sp_size", "2")))  # fmt: skip
    assert "mesh          sp=2\n" in result.stdout
    assert "8 per device x 1 accumulation x 1 data-parallel replicas = 8 global" in result.stdout

    (reference,) = rank_reports(one)
    ranks = rank_reports(out)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=2e-3, abs=1e-4)
    logs = [[json.loads(line) for line in (d / "run_log.jsonl").read_text().splitlines()] for d in (one, out)]
    norms = [[e["grad_norm"] for e in log if "grad_norm" in e] for log in logs]
    # The split computes each gradient through bf16 roundings in another order (attention by heads after the
    # all-to-all, ZeRO-3's reduce-scatter): each element, and so the norm, within a couple of bf16 steps (eps 2^-8)
    # of one process's, whichever kernels round them (oneDNN's native bf16, or the reference kernels of an AVX2 CPU:
    # 0.35% apart measured on a Xeon, within 0.2% on an EPYC).
    assert norms[1] == pytest.approx(norms[0], rel=2 * torch.finfo(torch.bfloat16).eps)
    summaries = [json.loads((d / "run_summary.json").read_text()) for d in (one, out)]
    assert summaries[1]["summary"]["tokens"] == summaries[0]["summary"]["tokens"]  # slices add up to the rows

    weights = load_file(one / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    start = load_file(Path(summaries[0]["config"]["toolkit"]["model_name_or_path"]) / "model.safetensors")
    assert_updates_agree(exported, weights, start)
    total = 2 * sum(t.numel() for t in weights.values())  # bf16 weights (DeepSpeed's; its fp32 masters apart)
    for rank in ranks:
        assert rank["param_bytes"] == pytest.approx(total / 2, rel=0.01)  # ZeRO-3 over both ranks (padding)

    # On a CPU every row is max_seq_length (gloo gathers equal shapes only: test_split_padding below), each rank's
    # slice half of it.
    assert [rank["saved_width"] for rank in ranks] == [128, 128]
    # Activations per token: what each rank saved in the first step's forward, at its slice of that batch, against
    # the plan at its slice of max_seq_length (linear in the tokens under sdpa).
    planned = summaries[1]["config"]["memory_plan"]["device"]["activations"]
    whole_rows = reference["memory_plan"]["device"]["activations"]  # the same model at the whole 256 tokens
    assert planned < 0.6 * whole_rows
    for rank in ranks:
        assert rank["saved_bytes"] / rank["saved_width"] == pytest.approx(planned / 128, rel=0.15)


@pytest.mark.launch
def test_context_parallel_is_refused_on_cpu_in_one_line(tmp_path):
    """fsdp2_cp.yaml, launched (by the toolkit's launcher, as `make finetune` does): torch's ring attention
    shards only the GPU kernels, so on a CPU the launcher refuses it before any process starts (the ranks' own
    refusal, for `accelerate launch`: test_sequence_split_refusals_name_the_fix), with the reason and the config
    that does run here."""
    cache = tmp_path / "cache"  # where a started process would build its tiny model first
    result = run_cmd([str(BIN / "python"), "-m", "toolkit", "launch", "--config_file",
                      str(ROOT / "accelerate_configs" / "fsdp2_cp.yaml"), "--num_processes", "2",
                      "--parallelism_config_cp_size", "2", "--main_process_port", str(free_port()),
                      str(ROOT / "recipes" / "llama3_fft.py"), "--tiny", "--output_dir", str(tmp_path / "o")],
                     cwd=tmp_path, env={"TOOLKIT_CACHE": str(cache)})  # fmt: skip
    assert result.returncode == 2  # bad input, as the toolkit's launcher passes it on
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[0] == f"error: {CP_ON_CPU}"
    assert "Traceback" not in result.stderr
    assert not cache.exists() or not any(cache.rglob("config.json"))  # no process was started


def recipe_args(*flags: str):
    from llama3_fft import RECIPE

    return parse(RECIPE, "llama3_fft", ["--output_dir", "/tmp/unused", "--tiny", *flags])


@pytest.mark.parametrize(
    ("mesh", "flags", "on_gpu", "message"),
    [
        ({"cp": 2}, [], False, "context parallelism .* needs CUDA GPUs"),
        ({"sp": 2}, ["--max_seq_length", "127"], False, "pass --max_seq_length 128"),
        ({"cp": 2}, ["--max_seq_length", "130"], True, r"cut into 4 equal slices\): pass --max_seq_length 132"),
        ({"sp": 3}, ["--max_seq_length", "129"], False, "sp_size 3 does not divide the model's 4 attention heads"),
        ({"sp": 2}, ["--packing", "true"], False, "packed conversations would attend to each other"),
        ({"sp": 2}, ["--attn_implementation", "eager"], False, "set parallelism_config_sp_attn_implementation"),
        ({"cp": 2}, ["--attn_implementation", "eager"], True, "torch's ring attention shards sdpa only"),
    ],
)  # fmt: skip
def test_sequence_split_refusals_name_the_fix(mesh, flags, on_gpu, message):
    """Before any weight loads: what DeepSpeed, torch or accelerate would fail on later, or train wrongly."""
    args = recipe_args(*flags)
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ConfigError, match=message):
        check_sequence_split(config, mesh, args, on_gpu=on_gpu, world_size=2 if mesh != {"sp": 3} else 3)


def test_sequence_split_settles_packing_and_attention():
    """Left open by the recipe: no packing under sdpa, Ulysses' kernel named as the run's attention; with
    flash attention as Ulysses' kernel, packed rows stay (its varlen path keeps conversations apart)."""
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=1)
    args = recipe_args()
    check_sequence_split(config, {"sp": 2}, args, on_gpu=False, world_size=2)
    assert (args.data.packing, args.model.attn_implementation) == (False, "sdpa")
    args = recipe_args()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "flash_attention_2")
        check_sequence_split(config, {"sp": 2}, args, on_gpu=True, world_size=2)
    assert (args.data.packing, args.model.attn_implementation) == (True, "flash_attention_2")
    args.data.task = "dpo"
    with pytest.raises(ConfigError, match="a dpo recipe.s trainer does not take split rows"):
        check_sequence_split(config, {"sp": 2}, args, on_gpu=False, world_size=2)


def test_mesh_sizes():
    """Ulysses forms its data-parallel axis from the rest of the ranks: its mesh need only divide them."""
    check_mesh_size({"sp": 2}, 8, "fix")
    check_mesh_size({"cp": 4, "dp_shard": 2}, 8, "fix")
    with pytest.raises(ConfigError, match="covers 4 processes and the launch has 8: fix"):
        check_mesh_size({"cp": 4}, 8, "fix")
    with pytest.raises(ConfigError, match="covers 3 processes"):
        check_mesh_size({"sp": 3}, 8, "fix")


@pytest.mark.parametrize(
    ("base", "sizes", "message"),
    [
        ("fsdp2", {"parallelism_config_sp_size": 2}, r"sp_size is DeepSpeed.s sequence parallelism .*zero3_sp"),
        ("zero3", {"parallelism_config_cp_size": 2}, "cp_size is torch's context parallelism: it needs FSDP2"),
        ("zero3_sp", {"parallelism_config_sp_size": 3}, "covers 3 processes and the launch has 8: .*divide it"),
    ],
)  # fmt: skip
def test_check_refuses_a_split_without_its_engine(base, sizes, message, tmp_path):
    """`toolkit check` (and so `make finetune`, `toolkit launch`): a split in a config of the other engine, or one
    that divides the processes unevenly, in one line before anything starts."""
    import yaml

    from toolkit.distributed.launch_check import check as check_file

    config = yaml.safe_load((ROOT / "accelerate_configs" / f"{base}.yaml").read_text())
    config["parallelism_config"] = {**(config.get("parallelism_config") or {}), **sizes}
    path = tmp_path / f"{base}_split.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=message):
        check_file(path)


@pytest.mark.parametrize(
    ("mesh", "on_gpu", "attention", "multiple"),
    [
        ({"sp": 2}, True, "sdpa", 2),  # Ulysses on NCCL: each batch to a multiple of sp, no further
        ({"sp": 2}, False, "sdpa", 256),  # on gloo: every row at max_seq_length (equal shapes to gather)
        ({"cp": 2}, True, "sdpa", 4),  # the ring's two chunks per rank
        ({"sp": 4}, True, "flex_attention", 128),  # flex's block covers the split's 4
        ({}, True, "flex_attention", 128),
        ({}, True, "sdpa", None),
    ],
)  # fmt: skip
def test_split_padding(mesh, on_gpu, attention, multiple, monkeypatch):
    """Long rows under a split were padded to max_seq_length whatever their length: at 131,072 tokens a 20k-token
    row cost six times its compute. Now a batch is padded to what the split needs (and the attention kernel), and
    to max_seq_length only where the backend cannot gather unequal batches (gloo, a CPU)."""
    from llama3_fft import RECIPE

    from toolkit.runner import padding_multiple

    for axis, size in mesh.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", str(size))
    args = parse(RECIPE, "llama3_fft", ["--max_seq_length", "256", "--output_dir", "/tmp/unused"])
    args.model.attn_implementation = attention
    assert padding_multiple(args, on_gpu=on_gpu) == multiple


def test_the_launcher_refuses_context_parallelism_only_without_cuda(monkeypatch):
    """toolkit launch's check, from the file's mesh or the launch flag: refused on a CPU, passed on to the ranks
    where CUDA is (the GPU path users take must not meet it)."""
    from accelerate.commands.launch import launch_command_parser

    from toolkit.distributed.launcher import check_this_machine

    def args(*flags):
        return launch_command_parser().parse_args([*flags, "recipes/llama3_fft.py"])

    from_file = args("--config_file", str(ROOT / "accelerate_configs" / "fsdp2_cp.yaml"))
    from_flag = args("--parallelism_config_cp_size", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for launch_args in (from_file, from_flag):
        with pytest.raises(ConfigError, match="needs CUDA GPUs"):
            check_this_machine(launch_args)
    check_this_machine(args("--config_file", str(ROOT / "accelerate_configs" / "zero3_sp.yaml")))  # sp runs here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_this_machine(from_file)
    check_this_machine(from_flag)
