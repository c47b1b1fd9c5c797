"""Tensor parallelism (accelerate_configs/tp.yaml, fsdp2_tp.yaml): transformers shards the model by its own TP
plan (and FSDP2) as it loads, accelerate hands a TP group's ranks the same rows; on CPU over gloo, for real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_updates_agree, check, launch, logged, rank_reports, reference_run, run_cmd
from safetensors.torch import load_file
from transformers import AutoConfig, BertConfig, LlamaConfig, TrainingArguments

from toolkit.errors import ConfigError
from toolkit.models import tiny
from toolkit.models.parallel import check_tensor_parallel
from toolkit.settings.parser import parse

# Checkpoints every 2 steps, whole (the toolkit writes the optimizer shards transformers does not). The recipe's
# precision: bf16 weights and compute (tiny mode's fp32 on a CPU would hide what bf16 weights meet: DTensor shards'
# dtypes).
FLAGS = ["--tiny", "--report_to", "none", "--max_steps", "4", "--logging_steps", "1", "--save_strategy", "steps",
         "--save_steps", "2", "--record_rank_reports", "true", "--bf16", "true", "--dtype", "bfloat16"]  # fmt: skip


@pytest.fixture(scope="module")
def llama_two_kv_heads(tmp_path_factory) -> Path:
    """A user's small Llama whose 4 attention heads and 2 key/value heads split over 2 ranks (the recipe's tiny
    Llama 3 keeps Meta's 4:1 grouping, one key/value head, which no TP size above 1 divides), saved in bf16 as
    Meta's checkpoints are."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("llama-kv2")
    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_process(llama_two_kv_heads, tmp_path_factory) -> Path:
    model = ["--model_name_or_path", str(llama_two_kv_heads)]
    return reference_run("llama3_fft", [*FLAGS, *model], tmp_path_factory.mktemp("tp-ref"))


@pytest.mark.parametrize(
    ("config", "tp", "shards", "header"),
    [
        ("tp", 2, 1, "tensor parallel, each layer split over 2 ranks"),
        ("fsdp2_tp", 2, 2, "FSDP2 x tensor parallel, each layer split over 2 ranks, sharded over 2"),
    ],
)
def test_tensor_parallel_matches_one_process(config, tp, shards, header, llama_two_kv_heads, one_process, tmp_path):
    """tp.yaml (2 ranks, tp=2) and fsdp2_tp.yaml (4 ranks, dp_shard=2 x tp=2) against 1 process with the same
    global batch: the ranks of a TP group train on the same rows, the shard groups on the 1-process run's rows
    between them, with its losses; tokens counted once per row, not per rank; each rank holds 1/(tp x shards) of
    every split weight and 1/shards of the norms (which TP leaves whole: the run's plan splits them too, the
    test names the difference), fp32 masters and AdamW states of that part (the recipe's bf16: the masters are
    DTensor shards too); checkpoints and the export are the whole model, each rank's optimizer shards beside
    them, from which a resume continues the run exactly."""
    one, out = one_process, tmp_path / "out"
    processes = tp * shards
    model = ["--model_name_or_path", str(llama_two_kv_heads)]
    result = check(launch(config, "llama3_fft", *FLAGS, "--model_name_or_path", str(llama_two_kv_heads),
                          "--per_device_train_batch_size", str(8 // shards), "--output_dir", str(out),
                          cwd=tmp_path, num_processes=processes))  # fmt: skip
    assert f"sharding      {header}\n" in result.stdout
    mesh = f"dp_shard={shards} x tp={tp}" if shards > 1 else f"tp={tp}"
    assert f"mesh          {mesh}\n" in result.stdout
    assert f"x {shards} data-parallel replicas = 8 global" in result.stdout

    (reference,) = rank_reports(one)
    ranks = rank_reports(out)
    groups = [ranks[g * tp : (g + 1) * tp] for g in range(shards)]  # tp is the mesh's inner axis
    for group in groups:
        assert all(rank["rows"] == group[0]["rows"] for rank in group)  # one batch per TP group
    assert sorted(row for group in groups for row in group[0]["rows"]) == sorted(reference["rows"])
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=2e-3, abs=1e-4)
    summaries = [json.loads((d / "run_summary.json").read_text()) for d in (one, out)]
    assert summaries[1]["summary"]["tokens"] == summaries[0]["summary"]["tokens"]  # once, not once per rank

    weights = load_file(one / "model.safetensors")
    whole = {name for name in weights if "norm" in name}  # RMSNorm weights: not split by TP
    replicated = sum(weights[n].nbytes for n in whole)
    split = sum(t.nbytes for n, t in weights.items() if n not in whole)
    for rank in ranks:
        assert rank["param_bytes"] == split // processes + replicated // shards
        assert rank["master_bytes"] == 2 * rank["param_bytes"]  # fp32 masters of its bf16 part
        assert rank["optimizer_state_bytes"] == 4 * rank["param_bytes"]  # AdamW's two fp32 moments of it
        assert rank["loaded_param_bytes"] == rank["param_bytes"]  # from_pretrained gave it its part only
    planned = summaries[1]["config"]["memory_plan"]["device"]["parameters"]
    assert planned == (split + replicated) // processes
    assert ranks[0]["param_bytes"] - planned == replicated // shards - replicated // processes

    optimizers = [f"optimizer-rank{r}.pt" for r in range(processes)]  # each rank's shards, masters included
    assert sorted(p.name for p in (out / "checkpoint-2").glob("optimizer*")) == optimizers
    for folder in (out, out / "checkpoint-2"):  # whole tensors, as from a 1-process run
        saved = load_file(folder / "model.safetensors")
        assert {n: t.shape for n, t in saved.items()} == {n: t.shape for n, t in weights.items()}
    exported = load_file(out / "model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert_updates_agree(exported, weights, load_file(llama_two_kv_heads / "model.safetensors"))
    assert "distributed_config" not in json.loads((out / "config.json").read_text())  # loads anywhere

    # a resume from step 2, as after a preemption (1-D and 2-D meshes): steps 3 and 4 again, bit for bit
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    check(launch(config, "llama3_fft", *FLAGS, *model, "--resume", "auto", "--per_device_train_batch_size",
                 str(8 // shards), "--output_dir", str(resumed), cwd=tmp_path, num_processes=processes))  # fmt: skip
    assert logged(resumed, "loss")[-2:] == logged(out, "loss")[-2:]
    assert logged(resumed, "learning_rate")[-2:] == logged(out, "learning_rate")[-2:]


def test_tensor_parallel_on_two_nodes_through_slurm(llama_two_kv_heads, one_process, tmp_path):
    """tp.yaml as slurm/finetune.sbatch runs it on 2 "nodes" of 2 processes (loopback): TP inside each node, the
    nodes data-parallel replicas (dp_replicate=2 x tp=2, settings/mesh.py's job_mesh), with the 1-process run's
    rows between them and its losses. Before, the launcher passed dp_replicate=nodes x dp_shard=GPUs per node
    whatever the file's mesh, which no TP config could run."""
    import os

    from conftest import BIN, free_port, slurm_stand_ins

    fake_bin = slurm_stand_ins(tmp_path / "bin")
    out = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{BIN}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_SUBMIT_DIR": str(ROOT), "GPUS_PER_NODE": "2", "MAIN_PORT": str(free_port())}  # fmt: skip
    sbatch = ["bash", str(ROOT / "slurm" / "finetune.sbatch"), "accelerate_configs/tp.yaml", "recipes/llama3_fft.py"]
    result = check(run_cmd([*sbatch, *FLAGS, "--model_name_or_path", str(llama_two_kv_heads),
                            "--per_device_train_batch_size", "4", "--output_dir", str(out)], cwd=tmp_path,
                           env=env))  # fmt: skip
    assert "mesh          dp_replicate=2 x tp=2\n" in result.stdout
    assert "sharding      tensor parallel, each layer split over 2 ranks\n" in result.stdout
    (reference,) = rank_reports(one_process)
    ranks = rank_reports(out)
    assert ranks[0]["rows"] == ranks[1]["rows"] and ranks[2]["rows"] == ranks[3]["rows"]  # a TP group per node
    assert sorted(ranks[0]["rows"] + ranks[2]["rows"]) == sorted(reference["rows"])
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=2e-3, abs=1e-4)
        assert rank["strategy"]["num_machines"] == 2


@pytest.mark.parametrize(
    ("config", "mesh", "world", "flags", "message"),
    [
        (LlamaConfig(num_attention_heads=32, num_key_value_heads=8), {"tp": 3}, 3, ["--save_strategy", "no"],
         "tp_size 3 does not divide the model's 32 attention heads"),
        (LlamaConfig(num_attention_heads=32, num_key_value_heads=2), {"tp": 4}, 4, ["--save_strategy", "no"],
         "tp_size 4 does not divide the model's 2 key/value heads"),
        (BertConfig(), {"tp": 2}, 2, ["--save_strategy", "no"], "bert has no tensor-parallel plan in transformers"),
        (LlamaConfig(), {"dp_shard": 2, "tp": 2}, 2, ["--save_strategy", "no"],
         "the mesh dp_shard=2 x tp=2 covers 4 processes and the launch has 2: set --num_processes 4"),
    ],
)  # fmt: skip
def test_tensor_parallel_refusals_name_the_fix(config, mesh, world, flags, message):
    """Before any weight loads: what transformers or accelerate would fail on later, deep in a traceback."""
    from llama3_fft import RECIPE

    args = parse(RECIPE, "llama3_fft", ["--output_dir", "/tmp/unused", *flags])
    assert isinstance(args.training, TrainingArguments)
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(config, mesh, world)
    check_tensor_parallel(AutoConfig.for_model("llama"), {}, world)  # no mesh: nothing to check
