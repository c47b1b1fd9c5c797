"""The strategy matrix: every accelerate config x every recipe, launched for real on CPU (2 processes, gloo).

Each launch is checked for what really happened, not just its exit code: the strategy in effect, the bytes of
parameters and optimizer state each rank holds, disjoint data across ranks, the tokens counted, the losses
against a 1-process run with the same global batch, and the exported weights against that run's (SFT's
launches with the fused loss, the references with the full logits). Resume from a checkpoint and from a
preemption (SIGTERM at a random step) ends bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    BIN,
    ROOT,
    check,
    exported_weights,
    free_port,
    launch,
    no_lock,
    rank_reports,
    reference_run,
    run_cmd,
    slurm_stand_ins,
    warm_start,
)
from safetensors.torch import load_file

from toolkit import planner
from toolkit.data.loading import load_raw
from toolkit.data.preparation import prepare
from toolkit.models import tiny
from toolkit.settings.arguments import DataArguments

pytestmark = pytest.mark.launch

# config -> (distributed type, sharding label, parameters sharded?, optimizer state sharded?, processes)
STRATEGIES = {
    "single_gpu": ("NO", "none (single process)", False, False, 1),
    "ddp": ("MULTI_CPU", "none (replicated, DDP)", False, False, 2),
    "zero1": ("DEEPSPEED", "ZeRO-1", False, True, 2),
    "zero2": ("DEEPSPEED", "ZeRO-2", False, True, 2),
    "zero2_offload": ("DEEPSPEED", "ZeRO-2 offload_optimizer=cpu", False, True, 2),
    "zero3": ("DEEPSPEED", "ZeRO-3", True, True, 2),
    "zero3_offload": ("DEEPSPEED", "ZeRO-3 offload_optimizer=cpu offload_param=cpu", True, True, 2),
    "fsdp2": ("FSDP", "FSDP2 FULL_SHARD", True, True, 2),
    "fsdp_shard_grad_op": ("FSDP", "FSDP2 SHARD_GRAD_OP", True, True, 2),
    "fsdp": ("FSDP", "FSDP2 FULL_SHARD", True, True, 2),  # FSDP1 on CPU: runs its FSDP2 equivalent, and says so
    "fsdp_offload": ("FSDP", "FSDP2 FULL_SHARD", True, True, 2),  # on CPU: runs without offload, and says so
    # 2 nodes x 2 processes, through slurm/finetune.sbatch: test_hybrid_shard_on_two_nodes
    "fsdp_hybrid": ("FSDP", "FSDP2 HYBRID_SHARD (2 replicas x 2 shards)", True, True, 4),
    # a Llama with 2 key/value heads (the tiny Llama 3 has one): test_tensor_parallel.py
    "tp": ("MULTI_CPU", "tensor parallel, each layer split over 2 ranks", True, True, 2),
    "fsdp2_tp": ("MULTI_CPU", "FSDP2 x tensor parallel, each layer split over 2 ranks, sharded over 2", True, True, 4),
    # a row split over 2 ranks: test_sequence_parallel.py (context parallelism: refused on CPU, in one line)
    "zero3_sp": ("DEEPSPEED", "ZeRO-3", True, True, 2),
    "fsdp2_cp": ("FSDP", "FSDP2 FULL_SHARD", True, True, 2),
    # FP8: refused on CPU in one line, test_fp8.py
    "fsdp2_fp8": ("FSDP", "FSDP2 FULL_SHARD", True, True, 2),
    # pipeline stages, through the toolkit's launcher: test_pipeline.py
    "pp": ("MULTI_CPU", "pipeline, 2 stages", True, True, 2),
    "pp_ddp": ("MULTI_CPU", "pipeline, 2 stages x 2 replicas", True, True, 4),
    # a mixture of experts' experts split over 2 ranks, through the toolkit's launcher: test_expert_parallel.py
    "fsdp2_ep": ("MULTI_CPU", "FSDP2 x expert parallel, experts split over 2 ranks, sharded over 2", True, True, 2),
}
OWN_TESTS = ("fsdp_hybrid", "tp", "fsdp2_tp", "zero3_sp", "fsdp2_cp", "fsdp2_fp8", "pp", "pp_ddp",
             "fsdp2_ep")  # fmt: skip  # their own tests
CPU_WARNINGS = {
    "fsdp": "warning: FSDP1 needs a GPU: on CPU running its FSDP2 equivalent (FULL_SHARD",
    "fsdp_offload": "warning: fsdp_offload_params needs an accelerator: on CPU running the same FSDP config without",
}
RECIPES = {"bert": ("classification", 1), "llama3_fft": ("sft", 2), "llama3_lora": ("sft", 1)}  # task, accumulation
# Pairs left out, and why: on CPU these configs run the code fsdp2.yaml runs for every recipe (their own part,
# the translation, is what the one recipe checks); the hybrid job needs 4 processes on 2 "nodes".
ONE_RECIPE = {"fsdp": "llama3_fft", "fsdp_offload": "llama3_fft", "fsdp_hybrid": "llama3_fft"}
# BERT (an encoder, a classifier) where its weights are sharded or gathered (ZeRO-3's gathered save names its norms,
# FSDP2 wraps its layers) and where they are replicated (DDP; one process: the reference below and `make demo`);
# under ZeRO-1/2, offload and SHARD_GRAD_OP it would run what DDP's, ZeRO-3's and FULL_SHARD's BERT runs with the
# optimizer partitioned, offloaded or resharded as for the decoders.
NO_BERT = ("single_gpu", "zero1", "zero2", "zero2_offload", "zero3_offload", "fsdp_shard_grad_op")
# LoRA (a few trainable weights on a frozen base) under DDP, zero2, zero3, its offload and FSDP2; ZeRO-1, zero2_offload
# and SHARD_GRAD_OP would partition, offload or reshard those same adapters as their full fine-tunes do every weight.
# One process: the reference below (and `make demo-sft`, LoRA on real weights).
NO_LORA = ("single_gpu", "zero1", "zero2_offload", "fsdp_shard_grad_op")
MATRIX = [(c, r) for c in STRATEGIES if c not in OWN_TESTS for r in RECIPES
          if ONE_RECIPE.get(c, r) == r and not (r == "bert" and c in NO_BERT)
          and not (r == "llama3_lora" and c in NO_LORA)]  # fmt: skip
# Save at this step and resume from it (llama3_fft: 512 rows / 32 per step = 16 steps). Configs that run the
# same code as another on CPU are not resumed twice; the PREEMPTED ones are resumed from a preemption instead
# (test_preempted_run_resumes_to_the_same_weights, the same checks at a random step).
RESUME_STEP = 8
PREEMPTED = ["ddp", "zero3_offload", "fsdp2"]
# Each checkpoint format resumed once: the Trainer's (single_gpu: ddp's, preempted, and resumed on 1 process by
# test_resume_on_one_process_from_two), FSDP2's DCP (fsdp_shard_grad_op: fsdp2's, preempted), ZeRO-3's partitions
# with DeepSpeed's CPU Adam state (zero3: zero3_offload's, preempted; zero2_offload: the same optimizer state),
# ZeRO-1/2's partitions (zero1: zero2's), so those are not resumed here again.
RESUMED = ["zero2"]
# Unpacked: one conversation per row, so steps and rows are the same for every recipe (packing, the SFT default,
# has its own launch: test_packed_run_matches_one_process).
# Half the tiny data set: 16 steps show all the checks do, and each of the file's launches trains for half as long.
# Dropout off (BERT's tiny keeps its 0.1): its masks fall on other rows on 2 processes than on one.
MATRIX_ROWS = 512
ONE_EPOCH = ("--tiny", "--record_rank_reports", "true", "--max_steps", "-1", "--num_train_epochs", "1",
             "--report_to", "none", "--max_train_samples", str(MATRIX_ROWS), "--dropout", "0",
             "--packing", "false")  # fmt: skip  # packing last: the packed run drops it


def tokenized_rows(recipe: str, **overrides) -> list[list[int]]:
    """Every tokenized training example (unpacked), computed here independently of the runs."""
    task = RECIPES[recipe][0]
    model_name = "google-bert/bert-base-cased" if recipe == "bert" else "meta-llama/Meta-Llama-3-8B"
    tokenizer = tiny.tiny_tokenizer(model_name, task)
    defaults = {**tiny.tiny_training_defaults(task, model_name), **overrides}
    values = {k: v for k, v in defaults.items() if k in DataArguments.__dataclass_fields__}
    args = DataArguments(task=task, **values)
    return prepare(load_raw(args), tokenizer, args, no_lock).train["input_ids"]


def row_hash(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()


def row_hashes(rows) -> set[str]:
    return set(map(row_hash, rows))


def recipe_flags(recipe: str) -> list[str]:
    if recipe == "llama3_lora":
        return ["--merge_lora", "true"]
    if recipe == "llama3_fft":
        return ["--save_strategy", "steps", "--save_steps", str(RESUME_STEP)]
    return []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain 1-process run per recipe, with the matrix's global batch (2 x 8 per device)."""
    runs = {}

    def get(recipe):
        if recipe not in runs:
            out = tmp_path_factory.mktemp(f"reference-{recipe}")
            accumulation = str(RECIPES[recipe][1])
            reference_run(recipe, [*ONE_EPOCH, "--per_device_train_batch_size", "16", "--gradient_accumulation_steps",
                                 accumulation], out)  # fmt: skip
            runs[recipe] = (rank_reports(out)[0], exported_weights(out, recipe))
        return runs[recipe]

    return get


@pytest.mark.parametrize(("config", "recipe"), MATRIX, ids=[f"{c}-{r}" for c, r in MATRIX])
def test_strategy(config, recipe, reference, tmp_path):
    processes = STRATEGIES[config][4]
    out = tmp_path / "run"
    stale = None
    if config in ("zero2_offload", "zero3_offload"):
        # The lock a build of CPU Adam killed half-way leaves behind (a timeout, kill -9): without
        # toolkit/distributed/op_builds.py every later ZeRO-Offload run waits on it forever, before step 1.
        stale = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "cpu_adam" / "lock"
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.touch()
    port = free_port()
    result = check(launch(config, recipe, *run_flags(recipe, processes, out), cwd=tmp_path, num_processes=processes,
                          port=port))  # fmt: skip
    if STRATEGIES[config][0] == "DEEPSPEED":  # its CPU all-reduce's /dev/shm segments (RAM) end with the run
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    if stale:
        assert result.stderr.count(f"warning: removed {stale}, left by a killed build of the cpu_adam op") == 1
    check_run(config, recipe, out, result, reference)
    if recipe == "llama3_fft":
        UNINTERRUPTED[config] = rank_reports(out)
        RUN_DIRS[config] = out
    if recipe == "llama3_lora":
        check_adapter_reloads(out)
        check_merged(out)
    if recipe == "llama3_fft" and config in RESUMED:
        resumed = tmp_path / "resumed"
        checkpoint = out / f"checkpoint-{RESUME_STEP}"
        flags = [*run_flags(recipe, processes, resumed), "--resume_from_checkpoint", str(checkpoint)]
        check(launch(config, recipe, *flags, cwd=tmp_path, num_processes=processes))
        check_resumed(rank_reports(out), rank_reports(resumed))


def test_hybrid_shard_on_two_nodes(reference, tmp_path):
    """slurm/finetune.sbatch as SLURM runs it, on two "nodes" of this machine (loopback): one 4-rank HSDP job."""
    fake_bin = slurm_stand_ins(tmp_path / "bin")
    out = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{BIN}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_SUBMIT_DIR": str(ROOT), "GPUS_PER_NODE": "2", "MAIN_PORT": str(free_port())}  # fmt: skip
    sbatch = ["bash", str(ROOT / "slurm" / "finetune.sbatch"), "accelerate_configs/fsdp_hybrid.yaml",
              "recipes/llama3_fft.py"]  # fmt: skip
    result = check(run_cmd([*sbatch, *run_flags("llama3_fft", 4, out)], cwd=tmp_path, env=env))
    check_run("fsdp_hybrid", "llama3_fft", out, result, reference)
    reports = rank_reports(out)
    assert all(r["strategy"]["num_machines"] == 2 for r in reports)
    digests = [r["weights_sha256"] for r in reports]  # ranks 0,1 on node 0; 2,3 on node 1
    assert digests[0] == digests[2] and digests[1] == digests[3]  # replicated across nodes
    assert digests[0] != digests[1]  # sharded inside a node

    # Resume the job from its sharded HSDP checkpoint (2-D mesh) the way a requeued SLURM job would.
    resumed = tmp_path / "resumed"
    flags = [*run_flags("llama3_fft", 4, resumed), "--resume_from_checkpoint", str(out / f"checkpoint-{RESUME_STEP}")]
    check(run_cmd([*sbatch, *flags], cwd=tmp_path, env={**env, "MAIN_PORT": str(free_port())}))
    check_resumed(reports, rank_reports(resumed))


# Preemption: a signal at a random step (SIGTERM; DDP: SLURM's SIGUSR1), then --resume auto, ends where the
# uninterrupted run ends. One config per engine (PREEMPTED: DDP, DeepSpeed ZeRO-3 with its optimizer offloaded,
# FSDP2). The uninterrupted runs are the matrix's own (run here if not yet).
UNINTERRUPTED: dict[str, list[dict]] = {}  # config -> rank reports of its llama3_fft matrix run


def launch_and_preempt(config: str, out: Path, after_steps: int, cwd: Path, cmd: list[str] | None = None,
                       env: dict | None = None, signum: int = signal.SIGTERM) -> tuple[str, int]:  # fmt: skip
    """Launch llama3_fft on 2 processes (with accelerate launch, or `cmd`); send the launcher `signum` (SIGTERM,
    as `kill` or a spot notice would) once rank 0 has logged `after_steps` steps. Returns the run's output and
    the launcher's exit code."""
    cmd = cmd or [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" /
                  f"{config}.yaml"), "--num_processes", "2", "--main_process_port", str(free_port()),
                  str(ROOT / "recipes" / "llama3_fft.py"), *run_flags("llama3_fft", 2, out)]  # fmt: skip
    warm_start()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})  # fmt: skip
    lines, logged, sent = [], 0, False
    for line in proc.stdout:
        lines.append(line)
        logged += line.count("'loss':")  # rank 0's log lines; two may share a line with the progress bar
        if logged >= after_steps and not sent:
            proc.send_signal(signum)
            sent = True
    return "".join(lines), proc.wait(timeout=120)


def slurm_node(out: Path) -> tuple[list[str], dict[str, str]]:
    """slurm/launch_node.sh on one node of 2 processes, SLURM's variables set by hand: the command and its env."""
    node = ["bash", str(ROOT / "slurm" / "launch_node.sh"), str(ROOT / "accelerate_configs" / "ddp.yaml"),
            str(ROOT / "recipes" / "llama3_fft.py"), *run_flags("llama3_fft", 2, out)]  # fmt: skip
    env = {"SLURM_NODEID": "0", "SLURM_NNODES": "1", "MAIN_ADDR": "127.0.0.1", "MAIN_PORT": str(free_port()),
           "GPUS_PER_NODE": "2", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    return node, env


@pytest.mark.parametrize("config", PREEMPTED)
def test_preempted_run_resumes_to_the_same_weights(config, tmp_path):
    """DDP is started as SLURM starts it (slurm/launch_node.sh, the real torch launcher under `toolkit launch`) and
    gets SIGUSR1, SLURM's warning before the time limit; ZeRO-3 and FSDP2 get SIGTERM under accelerate launch.
    Before, torch's launcher did not forward SIGUSR1 (its --signals_to_handle overwrote the script's
    TORCHELASTIC_SIGNALS_TO_HANDLE): the launcher died of it, without a checkpoint."""
    uninterrupted = UNINTERRUPTED.get(config)
    if uninterrupted is None:
        check(launch(config, "llama3_fft", *run_flags("llama3_fft", 2, tmp_path / "full"), cwd=tmp_path))
        uninterrupted = rank_reports(tmp_path / "full")
    out = tmp_path / "run"
    step = random.Random(config).randint(3, 9)  # of 16, leaving the signal half a dozen steps to arrive
    slurm = config == "ddp"
    node, env = slurm_node(out) if slurm else (None, None)
    signum = signal.SIGUSR1 if slurm else signal.SIGTERM
    log, code = launch_and_preempt(config, out, step, tmp_path, cmd=node, env=env, signum=signum)
    stopped = int(re.search(rf"received {signum.name}: step (\d+) finished, saving a checkpoint", log).group(1))
    assert step <= stopped < 16, log[-3000:]
    assert f"preempted at step {stopped}" in log
    assert (out / f"checkpoint-{stopped}" / "trainer_state.json").is_file()
    if slurm:
        assert code == 75, log[-3000:]  # toolkit launch: the scheduler's "try again"
    preempted = rank_reports(out)  # what each rank trained on before the signal

    if slurm:
        node, env = slurm_node(out)
        resumed = check(run_cmd([*node, "--resume", "auto"], cwd=tmp_path, env=env))
    else:
        resumed = check(launch(config, "llama3_fft", *run_flags("llama3_fft", 2, out), "--resume", "auto",
                               cwd=tmp_path))  # fmt: skip
    assert f"resume auto: continuing from {out / f'checkpoint-{stopped}'}" in resumed.stdout
    check_ends_as_uninterrupted(uninterrupted, preempted, rank_reports(out))


def check_ends_as_uninterrupted(uninterrupted: list[dict], preempted: list[dict], resumed: list[dict]) -> None:
    for full, before, after in zip(uninterrupted, preempted, resumed, strict=True):
        assert before["rows"] + after["rows"] == full["rows"]  # no row seen twice or skipped
        assert after["learning_rates"] == full["learning_rates"]  # the schedule continued
        assert after["losses"] == full["losses"]  # bit-identical: history restored, then the same steps
        assert after["weights_sha256"] == full["weights_sha256"]


# Resume on another process count: the Trainer's format (DDP) and FSDP's (torch.distributed.checkpoint
# reshards) continue the same run on 1 process with the same global batch; ZeRO refuses before loading (see
# test_checkpoints.py), naming DeepSpeed's conversion command.
RUN_DIRS: dict[str, Path] = {}  # config -> output folder of its llama3_fft matrix run (checkpoint-16 inside)


@pytest.mark.parametrize("config", ["ddp", "fsdp2"])
def test_resume_on_one_process_from_two(config, reference, tmp_path):
    out = RUN_DIRS.get(config)
    if out is None:
        out = tmp_path / "full"
        check(launch(config, "llama3_fft", *run_flags("llama3_fft", 2, out), cwd=tmp_path))
    full = rank_reports(out)
    resumed = tmp_path / "resumed"
    flags = [*run_flags("llama3_fft", 1, resumed), "--resume", str(out / f"checkpoint-{RESUME_STEP}")]
    if config == "ddp":  # one process: a plain run of the script
        result = check(run_cmd([sys.executable, str(ROOT / "recipes" / "llama3_fft.py"), *flags], cwd=tmp_path))
    else:
        result = check(launch(config, "llama3_fft", *flags, cwd=tmp_path, num_processes=1))
    assert "resuming a 2-process checkpoint on 1 process(es), same global batch 32" in result.stdout
    (one,) = rank_reports(resumed)
    assert one["losses"][:RESUME_STEP] == full[0]["losses"][:RESUME_STEP]  # history restored
    assert one["losses"] == pytest.approx(full[0]["losses"], rel=2e-3, abs=1e-4)  # then the same run, 1 process
    assert one["learning_rates"] == full[0]["learning_rates"]
    second_half = {row for r in full for row in r["rows"][len(r["rows"]) // 2 :]}
    assert len(one["rows"]) == len(second_half) and set(one["rows"]) == second_half  # no repeat, no skip
    ref_weights = reference("llama3_fft")[1]
    for name, value in exported_weights(resumed, "llama3_fft").items():
        torch.testing.assert_close(value.float(), ref_weights[name].float(), rtol=1e-3, atol=2e-4, msg=name)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """A Llama checkpoint of 46 MB in bf16, as the Hub ships them: large enough that host RAM is the weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("bf16-checkpoint")
    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_ram_efficient_loading_holds_one_copy(bf16_checkpoint, tmp_path):
    """fsdp2.yaml (RAM-efficient loading) on a bf16 checkpoint trained in bf16 mixed precision, whose fp32 master
    weights accelerate makes on rank 0: rank 0 alone loads the model (one copy, as the loading code records it),
    the other rank builds it on the meta device and never holds more than its shard. From loading to the first
    step, each rank's own peak of anonymous memory: rank 0 about one fp32 copy (1.01-1.23 measured), rank 1 about
    half (0.53-0.72; what else a rank allocates before the first step varies: some 20 MB, a fifth of this 92 MB
    copy). With accelerate's own loading: 1.72 and 1.91 (rank 0 kept its full copy to the end, rank 1 upcast its
    placeholders and received every full tensor before its shard); see fsdp_loading.py and
    models.allocate_placeholders. The ranks' peaks added at the same moment are not asserted: how near the sum
    they come depends on when each rank peaks, which the machine's load decides (2.02 on 2 busy cores)."""
    out = tmp_path / "out"
    # What is measured ends where training begins: the one step is one row of 32 tokens (101 -> 51 s of CPU).
    check(launch("fsdp2", "llama3_fft", "--tiny", "--model_name_or_path", str(bf16_checkpoint), "--dtype",
                 "bfloat16", "--bf16", "true", "--max_steps", "1", "--report_to", "none", "--packing", "false",
                 "--per_device_train_batch_size", "1", "--max_seq_length", "32",
                 "--record_rank_reports", "true", "--output_dir", str(out), cwd=tmp_path,
                 env={"TOOLKIT_TEST_ZYGOTE": None}))  # fmt: skip  # cold: forked ranks share pages, which PSS splits
    reports = rank_reports(out)
    weights = sum(t.numel() for t in load_file(bf16_checkpoint / "model.safetensors").values())
    copy = sum(r["param_bytes"] for r in reports)  # fp32 master weights, the shards summed
    assert copy == 4 * weights
    # what each rank held once from_pretrained returned: rank 0 the bf16 checkpoint, rank 1 nothing (meta)
    assert [r["loaded_param_bytes"] for r in reports] == [2 * weights, 0]
    rank0, rank1 = (r["load_host"]["anon"] / copy for r in reports)
    assert 0.9 <= rank0 <= 1.4, rank0  # its fp32 copy, freed tensor by tensor as the shards go out (not 1.72)
    assert 0.45 <= rank1 <= 1.0, rank1  # its shard: half a copy, and no fp32 upcast of its placeholders (not 1.91)


def test_packed_run_matches_one_process(tmp_path):
    """Packing (the SFT default) under DDP: 2 processes x 8 packed rows per micro-batch equal 1 process x 16:
    every conversation trained on once, its tokens counted exactly, the same losses and weights."""
    runs = {}
    for processes in (1, 2):
        out = tmp_path / f"world-{processes}"
        # drop_last: the packed row count is not a multiple of the global batch, and accelerate would even out
        # the ranks' last batch by repeating rows, which one process does not do
        flags = [*ONE_EPOCH[:-2], "--gradient_accumulation_steps", "2", "--output_dir", str(out),
                 "--max_seq_length", "256", "--dataloader_drop_last", "true",
                 "--per_device_train_batch_size", str(16 // processes)]  # fmt: skip
        if processes == 1:
            reference_run("llama3_fft", flags, out)
        else:
            result = check(launch("ddp", "llama3_fft", *flags, cwd=tmp_path))
            # auto's kernel for packed rows on CPU, and why (docs/recipes.md: on a GPU, one that skips their blocks)
            why = "auto: packed rows on a CPU, where flex attention does not train"
            assert f"attention     sdpa ({why})\n" in result.stdout
        runs[processes] = (rank_reports(out), exported_weights(out, "llama3_fft"))
    rows = tokenized_rows("llama3_fft", max_seq_length=256, max_train_samples=MATRIX_ROWS)
    (reference,), ref_weights = runs[1]
    reports, weights = runs[2]
    assert len(reference["losses"]) <= len(rows) // 32 // 3  # rows of 256 hold 3 or more conversations
    seen = [set(r["rows"]) for r in reports]
    assert not (seen[0] & seen[1]) and seen[0] | seen[1] == set(reference["rows"])  # the same conversations
    length = {h: len(ids) for h, ids in zip(map(row_hash, rows), rows, strict=True)}
    assert len(reference["rows"]) > 0.9 * len(rows) and set(reference["rows"]) <= length.keys()
    assert all(r["tokens_seen"] == sum(length[h] for h in reference["rows"]) for r in [*reports, reference])
    assert reports[0]["losses"] == pytest.approx(reference["losses"], rel=2e-3, abs=1e-4)
    for name, value in weights.items():
        torch.testing.assert_close(value.float(), ref_weights[name].float(), rtol=1e-3, atol=2e-4, msg=name)


def run_flags(recipe: str, processes: int, out) -> list[str]:
    """One epoch with the matrix's global batch (16 x accumulation) split over the processes. SFT scores its loss
    with TRL's fused head (the GPU default; the 1-process references take the full logits): the same losses
    and weights under every strategy, ranks with unequal token counts gathering the head alike."""
    fused = ["--fused_loss", "true"] if RECIPES[recipe][0] == "sft" else []
    return [*ONE_EPOCH, *recipe_flags(recipe), *fused, "--gradient_accumulation_steps", str(RECIPES[recipe][1]),
            "--per_device_train_batch_size", str(16 // processes), "--output_dir", str(out)]  # fmt: skip


def check_run(config, recipe, out, result, reference) -> None:
    kind, sharding, params_sharded, optim_sharded, processes = STRATEGIES[config]
    reports = rank_reports(out)
    ref_report, ref_weights = reference(recipe)

    # The strategy the config names is the one in effect, and what cannot run on CPU says so, once.
    assert [r["process_index"] for r in reports] == list(range(processes))
    for r in reports:
        assert r["strategy"]["distributed_type"] == kind
        assert r["strategy"]["num_processes"] == processes
        assert r["strategy"]["sharding"] == sharding
    assert f"sharding      {sharding}\n" in result.stdout and "attention     sdpa (auto)\n" in result.stdout
    for name, warning in CPU_WARNINGS.items():
        assert result.stderr.count(warning) == (config == name), name
    # The libraries' deprecations of each other are not the user's (toolkit/__init__.py): a ZeRO-3 run warned on
    # every gather (1,452 lines in 2 steps of SmolLM2-135M), a LoRA run as peft wrapped the model.
    assert "FutureWarning: `torch.distributed." not in result.stderr
    assert "`is_gradient_checkpointing` is deprecated" not in result.stderr

    # What each rank holds: 1/2 of the reference's bytes where sharded, all of them where replicated.
    for r in reports:
        for key, sharded in (("param_bytes", params_sharded), ("optimizer_state_bytes", optim_sharded)):
            share = r[key] / ref_report[key]
            if sharded and processes > 1:
                assert 0.45 <= share <= 0.6, (key, share)
            else:
                assert share == 1.0, (key, share)
    # The planner's per-rank bytes for the same model, strategy file and world size equal the measured ones
    # (fp32, AdamW); ZeRO pads its flat partitions to an alignment, a few hundred bytes on these tiny models.
    planned = planned_bytes(config, recipe, processes)
    for r in reports:
        assert r["param_bytes"] == pytest.approx(planned["parameters"], rel=0.01, abs=512), config
        assert r["optimizer_state_bytes"] == pytest.approx(planned["optimizer_states"], rel=0.01, abs=512), config
        # The run planned itself from what accelerate set up, not from the file: the same model-state bytes.
        own, per_node = r["memory_plan"], processes // r["strategy"]["num_machines"]
        if kind != "DEEPSPEED":  # DeepSpeed keeps gradients in its own buffers (its estimators check those)
            assert r["gradient_bytes"] == planned["gradients"], config
        for key in ("parameters", "optimizer_states"):
            assert own["device"][key] + own["host_per_node"].get(key, 0) // per_node == planned[key]
    # ... and right after loading: RAM-efficient loading (every FSDP config) materializes the weights on rank 0
    # only, the others start empty and receive them; ZeRO-3 partitions while loading; the rest load a full copy.
    full = ref_report["loaded_param_bytes"]
    for r in reports:
        if kind == "FSDP":
            assert r["loaded_param_bytes"] == (full if r["process_index"] == 0 else 0)
        elif config.startswith("zero3"):
            assert 0.45 <= r["loaded_param_bytes"] / full <= 0.6
        else:
            assert r["loaded_param_bytes"] == full
    # The planner's host RAM at load, in copies of the model: what the ranks together really loaded.
    loaded = sum(r["loaded_param_bytes"] for r in reports) / full
    assert loaded == pytest.approx(planned["copies_at_load"], rel=0.02), config

    # Data: disjoint across ranks, together the whole set; tokens counted exactly over ranks and micro-batches.
    rows = tokenized_rows(recipe, max_train_samples=MATRIX_ROWS)
    seen = [set(r["rows"]) for r in reports]
    assert processes == 1 or all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])
    assert set.union(*seen) == row_hashes(rows)
    assert all(r["tokens_seen"] == sum(len(x) for x in rows) for r in reports)

    # Same answer as one process: the loss trajectory, and the exported, consolidated weights (which also shows
    # that ranks loaded on the meta device got the pretrained weights, not a random init).
    assert reports[0]["losses"] == pytest.approx(ref_report["losses"], rel=2e-3, abs=1e-4)
    weights = exported_weights(out, recipe)
    assert weights.keys() == ref_weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value.float(), ref_weights[name].float(), rtol=1e-3, atol=2e-4, msg=name)
    if not params_sharded:
        assert len({r["weights_sha256"] for r in reports}) == 1  # replicas identical


def planned_bytes(config: str, recipe: str, processes: int) -> dict[str, int]:
    """What toolkit.planner says each rank holds at rest for this run, wherever it lives."""
    from transformers import AutoConfig

    task = RECIPES[recipe][0]
    model_name = "google-bert/bert-base-cased" if recipe == "bert" else "meta-llama/Meta-Llama-3-8B"
    model_config = AutoConfig.from_pretrained(tiny.tiny_checkpoint(model_name, task))
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"} if recipe == "llama3_lora" else None
    shape = planner.Shape.of(planner.meta_model(model_config, task, lora), model_config)
    layout = planner.Layout.from_file(ROOT / "accelerate_configs" / f"{config}.yaml")
    nodes = 2 if layout.hybrid else 1
    per_node = processes // nodes
    memory = planner.plan_memory(shape, layout, planner.Workload(precision="fp32"), per_node, nodes)
    return {  # on the device, or this rank's share of what the node offloads to host RAM
        **{
            key: memory.device[key] + memory.host_per_node.get(key, 0) // per_node
            for key in ("parameters", "gradients", "optimizer_states")
        },
        "copies_at_load": memory.host_loading / (4 * shape.total),
    }


def check_adapter_reloads(out) -> None:
    """The LoRA run saved an adapter alone (not a copy of the base), every tensor of which peft loads by itself,
    onto the tiny base saved beside it."""
    from peft import AutoPeftModelForCausalLM

    saved = load_file(out / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert not (out / "model.safetensors").exists()
    model = AutoPeftModelForCausalLM.from_pretrained(out)
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert sorted(loaded) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def check_merged(out) -> None:
    """OUTPUT/merged is the base with W + (alpha / r) * B @ A in every adapted layer, computed here from files."""
    from transformers import AutoModelForCausalLM

    adapter_config = json.loads((out / "adapter_config.json").read_text())
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    base = load_file(next(Path(adapter_config["base_model_name_or_path"]).glob("*.safetensors")))
    adapter = load_file(out / "adapter_model.safetensors")
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").state_dict()
    adapted = 0
    for name, weight in base.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in adapter:
            delta = adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]
            torch.testing.assert_close(merged[name], weight + scale * delta, msg=name)
            assert delta.abs().max() > 0, name  # the adapter trained
            adapted += 1
        else:
            assert torch.equal(merged[name], weight), name
    assert adapted == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
    assert (out / "merged" / "tokenizer_config.json").is_file()


def check_resumed(uninterrupted: list[dict], resumed: list[dict]) -> None:
    """Resumed from the step-8 checkpoint: same later losses, schedule, data order and final weights."""
    for full, cont in zip(uninterrupted, resumed, strict=True):
        assert cont["losses"][:RESUME_STEP] == full["losses"][:RESUME_STEP]  # history restored from the checkpoint
        assert cont["learning_rates"] == full["learning_rates"]  # the scheduler state came back
        assert cont["rows"] == full["rows"][-len(cont["rows"]) :]  # the data order continues: no repeat, no skip
        assert len(cont["rows"]) == len(full["rows"]) // 2
        # The optimizer state came back exactly: bit-identical from here on (CPU kernels are deterministic).
        assert cont["losses"] == full["losses"]
        assert cont["weights_sha256"] == full["weights_sha256"]
