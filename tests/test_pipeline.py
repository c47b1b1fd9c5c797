"""Pipeline parallelism (accelerate_configs/pp.yaml, pp_ddp.yaml): the model cut into stages by its own plan, driven
by torch.distributed.pipelining's 1F1B schedule inside RecipeTrainer; on CPU over gloo, for real, at the recipes'
precision (bf16 weights), through the toolkit's launcher (accelerate's drops the pipeline keys)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import BIN, ROOT, assert_updates_agree, check, free_port, rank_reports, reference_run, run_cmd
from safetensors.torch import load_file
from transformers import AutoConfig, FalconConfig, GPTNeoXConfig, GraniteConfig, LlamaConfig, MistralConfig, Qwen2Config

from toolkit.errors import ConfigError
from toolkit.models.pipeline import bubble, check_pipeline, micro_batches_in_flight
from toolkit.planner.layout import Layout
from toolkit.planner.memory import plan_memory, stage_memory
from toolkit.planner.shape import Shape
from toolkit.planner.workload import Workload

# 4 optimizer steps of 4 micro-batches (the schedule's) x 2 rows; an evaluation and greedy answers at steps 2 and 4;
# checkpoints every 2 steps; the recipe's bf16 weights and compute with fp32 masters, and its activation
# checkpointing (tiny mode turns it off).
FLAGS = ["--tiny", "--report_to", "none", "--max_steps", "4", "--logging_steps", "1", "--gradient_accumulation_steps",
         "4", "--eval_fraction", "0.1", "--eval_strategy", "steps", "--eval_steps", "2", "--generation_samples", "2",
         "--generation_max_new_tokens", "8", "--save_strategy", "steps", "--save_steps", "2", "--record_rank_reports",
         "true", "--bf16", "true", "--dtype", "bfloat16", "--activation_checkpointing", "true"]  # fmt: skip
# One epoch of 18 rows, 8 a step: windows of 4, 4 and 1 micro-batch(es) (2 rows each in one process, 1 on each of
# two replicas); the last, shorter than the 2 stages 1F1B needs, runs as GPipe. No clipping: the norm is logged.
BF16_EPS = torch.finfo(torch.bfloat16).eps
EPOCH = ["--max_steps", "-1", "--num_train_epochs", "1", "--max_train_samples", "18", "--max_grad_norm", "0"]


def toolkit_launch(config: str, recipe: str, *args: str, cwd: Path, processes: int):
    return run_cmd([str(BIN / "python"), "-m", "toolkit", "launch", "--config_file",
                    str(ROOT / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(processes),
                    "--main_process_port", str(free_port()), str(ROOT / "recipes" / f"{recipe}.py"), *args],
                   cwd=cwd)  # fmt: skip


def one_process_run(recipe: str, out: Path, *flags: str) -> Path:
    return reference_run(recipe, [*FLAGS, "--per_device_train_batch_size", "2", *flags], out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    return one_process_run("llama3_fft", tmp_path_factory.mktemp("pp-reference") / "run")


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("pp") / "run"
    result = check(toolkit_launch("pp", "llama3_fft", *FLAGS, "--per_device_train_batch_size", "2", "--output_dir",
                                  str(out), cwd=out.parent, processes=2))  # fmt: skip
    return out, result.stdout


def log(folder: Path, key: str) -> list[float]:
    return [line[key] for line in map(json.loads, (folder / "run_log.jsonl").read_text().splitlines()) if key in line]


def answers(folder: Path) -> list[str]:
    return [json.loads(line)["answer"] for line in (folder / "samples.jsonl").read_text().splitlines()]


def stage_bytes(weights: dict, stage: int) -> int:
    """The bytes of the tiny Llama 3's stage `stage` of 2 (one layer each): the embeddings and layer 0, or layer 1,
    the final norm and the head."""
    first = ("model.embed_tokens.", "model.layers.0.")
    return sum(t.nbytes for n, t in weights.items() if n.startswith(first) == (stage == 0))


@pytest.mark.launch
def test_two_stages_match_one_process(one_process, two_stages):
    """pp.yaml (2 stages, 1F1B) against one process with the same rows: both stages train on the same rows, the
    1-process run's, with its losses and gradient norms (the loss on the last stage, broadcast); its evaluations and
    greedy answers through the stages; each rank holds only its stage's weights, their fp32 masters and AdamW's
    states (bytes asserted), which are what the run's plan says of the busiest stage; checkpoints and the export are
    one Hugging Face folder, a shard a stage, that loads whole; the updates agree with one process's."""
    out, stdout = two_stages
    assert "sharding      pipeline, 2 stages\n" in stdout
    assert "mesh          pp=2\n" in stdout
    assert "schedule      1F1B, 4 micro-batch(es) a step over 2 stages: bubble 25%; a shorter window" in stdout
    assert "x 4 accumulation x 1 data-parallel replicas = 8 global" in stdout

    (reference,) = rank_reports(one_process)
    ranks = rank_reports(out)
    assert ranks[0]["rows"] == ranks[1]["rows"] == reference["rows"]
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=2e-3)
    # Trained in training mode, with the recipe's activation checkpointing: backward recomputes each of a rank's
    # own layers once a micro-batch, the 16 micro-batches through each (and the last stage's once more: torch's
    # schedule infers the gradients' shapes once, with a backward of its own, as it is made)
    assert reference["layers"] == 2 and [rank["layers"] for rank in ranks] == [1, 1]
    for rank, inferred in ((reference, 0), (ranks[0], 0), (ranks[1], 1)):
        expected = (16, rank["layers"] * 16 + inferred)
        assert (rank["micro_batches"], rank["recomputed"]) == expected, rank["process_index"]
    # each gradient through bf16 roundings in another order: within a couple of bf16 steps (eps 2^-8)
    assert log(out, "grad_norm") == pytest.approx(log(one_process, "grad_norm"), rel=2 * BF16_EPS)
    assert log(out, "eval_loss") == pytest.approx(log(one_process, "eval_loss"), rel=2e-3)
    assert log(out, "eval_token_accuracy") == pytest.approx(log(one_process, "eval_token_accuracy"), abs=0.01)
    assert answers(out) == answers(one_process)

    weights = load_file(one_process / "model.safetensors")
    for stage, rank in enumerate(ranks):
        assert rank["param_bytes"] == stage_bytes(weights, stage)  # bf16: its stage only
        assert rank["master_bytes"] == 2 * rank["param_bytes"]  # fp32 masters of it
        assert rank["optimizer_state_bytes"] == 4 * rank["param_bytes"]  # AdamW's two fp32 moments
    plan = json.loads((out / "run_summary.json").read_text())["config"]["memory_plan"]["device"]
    busiest = max(ranks, key=lambda r: r["param_bytes"])
    assert plan["parameters"] == busiest["param_bytes"]
    assert plan["master_weights"] == busiest["master_bytes"]
    assert plan["optimizer_states"] == busiest["optimizer_state_bytes"]

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(weights) and len(set(index.values())) == 2
    for folder in (out, out / "checkpoint-2"):
        assert {p.name for p in folder.glob("optimizer*")} <= {"optimizer-stage0.pt", "optimizer-stage1.pt"}
    assert {p.name for p in (out / "checkpoint-2").glob("optimizer*")} == {"optimizer-stage0.pt", "optimizer-stage1.pt"}
    from transformers import AutoModelForCausalLM

    exported = {k: v for k, v in AutoModelForCausalLM.from_pretrained(out).state_dict().items() if k in weights}
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    summary = json.loads((one_process / "run_summary.json").read_text())
    start = load_file(Path(summary["config"]["toolkit"]["model_name_or_path"]) / "model.safetensors")
    assert_updates_agree(exported, weights, start)


@pytest.mark.launch
def test_two_stages_resume_bit_identical(two_stages, tmp_path):
    """A pipeline run resumed from its step-2 checkpoint (each stage its own optimizer file, the weights from the
    index) ends with the uninterrupted run's weights, bit for bit."""
    out, _ = two_stages
    resumed = tmp_path / "run"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    result = check(toolkit_launch("pp", "llama3_fft", *FLAGS, "--per_device_train_batch_size", "2", "--output_dir",
                                  str(resumed), "--resume", "auto", cwd=tmp_path, processes=2))  # fmt: skip
    assert "resume auto: continuing from" in result.stdout
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        whole, again = load_file(out / shard), load_file(resumed / shard)
        assert whole.keys() == again.keys()
        assert all(torch.equal(whole[k], again[k]) for k in whole)


@pytest.mark.launch
def test_replicated_stages_of_a_lora_run_match_one_process(tmp_path):
    """pp_ddp.yaml (2 stages x 2 replicas, 4 ranks) with llama3_lora against one process with the same global batch:
    a pipeline's two stages read the same rows, the two pipelines the reference's between them, with its losses and
    evaluations (gathered over the replicas), and the gradient norm it logs unclipped (over every stage); one epoch
    whose last window of one micro-batch (fewer than the stages) runs as GPipe; the adapter, spread over the
    stages, is saved whole and equal."""
    reference = one_process_run("llama3_lora", tmp_path / "one", *EPOCH)
    out = tmp_path / "pp_ddp"
    result = check(toolkit_launch("pp_ddp", "llama3_lora", *FLAGS, *EPOCH, "--per_device_train_batch_size", "1",
                                  "--output_dir", str(out), cwd=tmp_path, processes=4))  # fmt: skip
    assert "sharding      pipeline, 2 stages x 2 replicas\n" in result.stdout
    (one,) = rank_reports(reference)
    ranks = rank_reports(out)  # ranks are (stage, replica), stages outermost
    assert ranks[0]["rows"] == ranks[2]["rows"] and ranks[1]["rows"] == ranks[3]["rows"]
    assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == sorted(one["rows"])
    assert len(one["losses"]) == 3  # steps of 4, 4 and 1 micro-batch(es)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(one["losses"], rel=2e-3)
    assert log(out, "grad_norm") == pytest.approx(log(reference, "grad_norm"), rel=2 * BF16_EPS)
    assert log(out, "eval_loss") == pytest.approx(log(reference, "eval_loss"), rel=2e-3)
    adapter, expected = load_file(out / "adapter_model.safetensors"), load_file(reference / "adapter_model.safetensors")
    assert adapter.keys() == expected.keys()  # both layers' adapters, from both stages
    b = [n for n in expected if "lora_B" in n]  # from zero: their values are their updates
    assert_updates_agree({n: adapter[n] for n in b}, {n: expected[n] for n in b}, {n: 0 * expected[n] for n in b})
    for name in set(expected) - set(b):  # A: the same random start in both (LoRA's seed, before the cut), moved little
        assert (adapter[name] - expected[name]).norm() <= 0.01 * expected[name].norm(), name


@pytest.mark.launch
def test_the_documented_tiny_commands_train_checkpoint_resume_and_export(tmp_path):
    """The docs' CPU commands as a user types them: `make finetune CONFIG=pp MODEL=llama3_fft NUM_PROCESSES=2
    ARGS=--tiny` (one micro-batch a step: GPipe, said in the header) into the folder of an earlier run, whose whole
    model.safetensors the pipeline's sharded export replaces; then pp_ddp.yaml's example (4 processes: 2 stages x 2
    replicas, the same global batch) resumes its step-10 checkpoint, each stage's optimizer file loaded by both of
    its replicas, and trains steps 11-20 with the losses the first run had."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "pp"
    out.mkdir()
    earlier = {"model.safetensors": b"an earlier run's weights", "run_summary.json": b"{}"}
    for name, data in earlier.items():
        (out / name).write_bytes(data)
    save = f"--output_dir {out} --save_strategy steps --save_steps 10"
    result = check(run_cmd(["make", "-C", str(ROOT), "finetune", "CONFIG=pp", "MODEL=llama3_fft", "NUM_PROCESSES=2",
                            f"ARGS=--tiny {save}"], cwd=tmp_path))  # fmt: skip
    assert "schedule      GPipe, 1 micro-batch(es) a step over 2 stages: bubble 100% (1F1B needs 2" in result.stdout
    assert "holds an earlier run's results" in result.stderr
    assert not (out / "model.safetensors").exists() and (out / "checkpoint-10").is_dir()
    shards = {k: v for shard in out.glob("model-*.safetensors") for k, v in load_file(shard).items()}
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in shards.items())

    resumed = tmp_path / "pp_ddp"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-10", resumed / "checkpoint-10")
    result = check(toolkit_launch("pp_ddp", "llama3_fft", "--tiny", "--per_device_train_batch_size", "4",
                                  *save.replace(str(out), str(resumed)).split(), "--resume", "auto", cwd=tmp_path,
                                  processes=4))  # fmt: skip
    assert "resume auto: continuing from" in result.stdout and (resumed / "checkpoint-20").is_dir()
    assert log(resumed, "loss") == pytest.approx(log(out, "loss")[10:], rel=1e-4)
    assert AutoModelForCausalLM.from_pretrained(resumed).state_dict().keys() == exported.keys()


# ------------------------------------------------------------------------------------------ before any weight


def llama(**overrides) -> LlamaConfig:
    return LlamaConfig(**{"num_hidden_layers": 4, "tie_word_embeddings": False, **overrides})


def deepseek_v4():
    """DeepSeek-V4, whose first layers route tokens to experts by a hash of their ids, read in every layer."""
    config = AutoConfig.for_model("deepseek_v4", tie_word_embeddings=False, num_hidden_layers=2)
    config.mlp_layer_types = config.mlp_layer_types[:2]
    return config


def qwen3_5():
    """A Qwen3.5 checkpoint's config: multimodal at the top (no pipeline plan there), its text model what SFT
    trains (Qwen3_5ForCausalLM), the plan in its text_config; full attention layers (the linear ones' reference
    kernels are slow on a CPU)."""
    config = AutoConfig.for_model("qwen3_5")
    config.text_config.num_hidden_layers, config.text_config.layer_types = 2, ["full_attention"] * 2
    return config


@pytest.mark.parametrize(
    ("config", "mesh", "task", "flags", "message"),
    [
        (llama(), {"pp": 3}, "sft", {"world_size": 3}, "pp_size 3 does not divide the model's 4 layers into equal "
         "stages: use a pp_size of 2, 4"),
        (llama(tie_word_embeddings=True), {"pp": 2}, "sft", {"world_size": 2}, "ties its output head"),
        (FalconConfig(tie_word_embeddings=False), {"pp": 2}, "sft", {"world_size": 2}, "falcon has no pipeline plan"),
        (GraniteConfig(tie_word_embeddings=False, embedding_multiplier=12.0), {"pp": 2}, "sft", {"world_size": 2},
         "granite's forward does more between its modules than its pipeline plan says"),
        (llama(), {"pp": 2}, "classification", {"world_size": 2}, "a classification recipe is not supported"),
        (llama(), {"pp": 2}, "dpo", {"world_size": 2}, "a dpo recipe is not supported"),
        (llama(), {"pp": 2}, "sft", {"world_size": 2, "load_in_4bit": True}, "QLoRA"),
        (llama(), {"pp": 2, "tp": 2}, "sft", {"world_size": 4}, "combine with data-parallel replicas"),
        (llama(), {"pp": 2}, "sft", {"world_size": 4}, "covers 2 processes and the launch has 4"),
        (llama(), {"pp": 2}, "sft", {"world_size": 2, "schedule": "Interleaved1F1B"}, "runs 1F1B or GPipe"),
        (llama(), {"pp": 2}, "sft", {"world_size": 2, "fp16": True}, "fp16 under pipeline stages"),
        (AutoConfig.for_model("longcat_flash", num_layers=3, tie_word_embeddings=False), {"pp": 2}, "sft",
         {"world_size": 2}, "does not divide the model's 3 layers"),  # its blocks, not its 6 num_hidden_layers
        (deepseek_v4(), {"pp": 2}, "sft", {"world_size": 2}, "deepseek_v4's layers cannot run as pipeline stages"),
    ],
    ids=["layers", "tied", "no-plan", "forward-does-more", "encoder-task", "dpo", "qlora", "tp", "processes",
         "schedule", "fp16", "blocks", "hash-routed"],
)  # fmt: skip
def test_pipeline_refusals_name_the_fix(config, mesh, task, flags, message):
    with pytest.raises(ConfigError, match=message):
        check_pipeline(config, mesh, task, **flags)


@pytest.mark.parametrize(
    "config",
    [llama(num_key_value_heads=2), Qwen2Config(tie_word_embeddings=False, use_sliding_window=True, max_window_layers=1),
     GPTNeoXConfig(tie_word_embeddings=False), MistralConfig(sliding_window=4),
     AutoConfig.for_model("longcat_flash", num_layers=2, tie_word_embeddings=False), qwen3_5()],
    ids=["llama", "qwen2-sliding", "gpt-neox", "mistral", "longcat-flash", "qwen3.5"],
)  # fmt: skip
def test_families_cut_into_stages_compute_the_whole_model(config):
    """Each family's stages, run in turn at toy size, give the whole model's logits (check_pipeline runs them):
    GPT-NeoX's own module names, Qwen2's and Mistral's per-layer attention types (the mask each layer reads),
    LongCat-Flash's blocks of two sublayers (num_hidden_layers counts 4 in its 2 blocks), a multimodal
    checkpoint's text model (Qwen3.5: the plan is its text config's)."""
    if config.model_type in ("llama", "qwen2", "gpt_neox", "mistral"):
        config.num_hidden_layers = 4
    check_pipeline(config, {"pp": 2}, "sft", world_size=2)


def test_accelerates_launcher_is_refused_in_one_line(monkeypatch):
    """accelerate launch drops parallelism_config_pp_size: the ranks see a mesh of 1s, which accelerate would run as
    DDP of the whole model. The toolkit's launcher exports the pipeline keys, and the ranks leave accelerate's own
    mesh (which has no pipeline axis) off."""
    from toolkit.distributed.launcher import axis_flags, export_axes
    from toolkit.distributed.strategy import check_launcher_axes

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for axis in ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP"):
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis}_SIZE", "1")
    monkeypatch.delenv("PARALLELISM_CONFIG_PP_SIZE", raising=False)
    with pytest.raises(ConfigError, match="only through the toolkit's: `python -m toolkit launch"):
        check_launcher_axes(world_size=2)

    found, rest = axis_flags(["--num_processes", "4", "--parallelism_config_pp_size=4", "x.py", "--tiny",
                                  "--parallelism_config_pp_size", "7"])  # fmt: skip
    assert found == {"parallelism_config_pp_size": "4"}  # the script's own flags are its own
    assert rest == ["--num_processes", "4", "x.py", "--tiny", "--parallelism_config_pp_size", "7"]
    export_axes(str(ROOT / "accelerate_configs" / "pp_ddp.yaml"), found)
    import os

    assert os.environ["PARALLELISM_CONFIG_PP_SIZE"] == "4" and os.environ["PARALLELISM_CONFIG_PP_SCHEDULE"] == "1F1B"
    check_launcher_axes(world_size=8)
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"


# ------------------------------------------------------------------------------------------ the planner


def test_stages_hold_the_whole_model_between_them():
    """Shape.stage, the planner's cut: the stages' parameters (embeddings on the first, norm and head on the last)
    add up to the model's, as the layers divide."""
    from toolkit.models.meta import meta_model

    config = LlamaConfig(num_hidden_layers=8, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         vocab_size=1000, tie_word_embeddings=False)  # fmt: skip
    model = meta_model(config, "sft")
    shape = Shape.of(model, config)
    parts = [shape.stage(s, 4) for s in range(4)]
    assert sum(p.total for p in parts) == shape.total
    assert parts[0].total - parts[1].total == config.vocab_size * config.hidden_size  # the embeddings
    assert parts[3].total - parts[1].total == config.vocab_size * config.hidden_size + config.hidden_size  # head, norm
    assert [p.language_model for p in parts] == [False, False, False, True]


def test_stage_activations_follow_the_schedule():
    """A stage holds the activations of the micro-batches in flight: all of them under GPipe, under 1F1B up to the
    stages from it to the last; the bubble is (stages - 1) / micro-batches."""
    assert [micro_batches_in_flight("1F1B", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [micro_batches_in_flight("GPipe", 4, 8, s) for s in range(4)] == [8, 8, 8, 8]
    assert bubble(4, 8) == 3 / 8
    config = LlamaConfig(num_hidden_layers=8, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         vocab_size=1000, tie_word_embeddings=False)  # fmt: skip
    from toolkit.models.meta import meta_model

    shape = Shape.of(meta_model(config, "sft"), config)
    work = Workload(precision="bf16", micro_batch=2, seq_length=512, micro_batches=8, cuda_context_gib=0)
    for stage, ratio in ((0, 2), (3, 8)):  # GPipe's 8 micro-batches in flight against 1F1B's 4, 1
        one_f = stage_memory(shape, Layout.pipeline("pp", 4, "1F1B"), work, stage, 4)
        gpipe = stage_memory(shape, Layout.pipeline("pp", 4, "GPipe"), work, stage, 4)
        assert gpipe.device["activations"] == ratio * one_f.device["activations"]
    first, last = (stage_memory(shape, Layout.pipeline("pp", 4, "GPipe"), work, s, 4) for s in (0, 3))
    assert first.device["logits"] == 0 < last.device["logits"]  # the head's, on the last stage only
    whole = plan_memory(shape, Layout.pipeline("pp", 4, "GPipe"), work, 4)
    assert whole.device_total == max(first.device_total, last.device_total)


def test_plan_lists_the_pipeline_rows_with_their_bubble():
    """`toolkit plan llama3_fft --gpu A100-40GB --gpus 16 --nodes 2`: each pipeline config sized for the job (the
    fewest stages that fit), its bubble in the MFU and said on its own line."""
    result = check(run_cmd([str(BIN / "python"), "-m", "toolkit", "plan", "llama3_fft", "--gpu", "A100-40GB", "--gpus",
                            "16", "--nodes", "2"], cwd=ROOT))  # fmt: skip
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith(("pp ", "pp_ddp "))}
    assert set(rows) == {"pp", "pp_ddp"}
    notes = [line for line in result.stdout.splitlines() if line.startswith(("pp:", "pp_ddp:"))]
    assert any(n.startswith("pp: 32 stages (--parallelism_config_pp_size 32), 4 micro-batch(es) a step: bubble "
                            "(stages - 1) / micro-batches = 775%") for n in notes)  # fmt: skip
    stages = int(next(n for n in notes if n.startswith("pp_ddp:")).split()[1])
    assert 32 % stages == 0 and stages < 32  # replicas: the fewest stages that fit


def test_pipeline_is_recommended_where_it_is_what_fits():
    """Against DDP alone (a cluster without the network for sharding), a model DDP cannot hold gets pipeline stages,
    sized to fit, with the launch flag that sets them."""
    from toolkit.planner.estimate import verdicts
    from toolkit.planner.render import render

    config = LlamaConfig(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                         vocab_size=32000, tie_word_embeddings=False)  # fmt: skip
    from toolkit.models.meta import meta_model

    shape = Shape.of(meta_model(config, "sft"), config)
    work = Workload(precision="bf16", micro_batch=1, seq_length=1024, micro_batches=8, master_weights=True)
    layouts = [Layout.replicated("ddp", 8), Layout.from_file(ROOT / "accelerate_configs" / "pp_ddp.yaml")]
    ddp, pp = verdicts(shape, work, 24, 8, layouts=layouts)
    assert not ddp.fits and pp.fits and pp.pipeline_stages in (2, 4)
    plan = {"model": "m", "recipe": None, "task": "sft", "activations": "", "data": None, "configs": [],
            "parameters": {"total": 1, "trainable": 1, "frozen": 0, "largest_module": 1, "largest_fsdp_unit": 1},
            "hardware": {"gpu": "L4", "memory_gib": 24, "gpus_per_node": 8, "nodes": 1, "headroom": 0.1},
            "workload": {**work.__dict__}, "recommended": "pp_ddp", "recommended_micro_batch": pp.micro_batch,
            "recommended_pipeline_stages": pp.pipeline_stages}  # fmt: skip
    assert (
        f"recommended: accelerate_configs/pp_ddp.yaml --parallelism_config_pp_size {pp.pipeline_stages} "
        "(python -m toolkit launch)"
    ) in render(plan)
