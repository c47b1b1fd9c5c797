"""Expert parallelism (accelerate_configs/fsdp2_ep.yaml): transformers splits a mixture of experts' experts over the
EP ranks and FSDP2-shards the rest as the weights load, each token sent to its experts' ranks and back
(all-to-all); on CPU over gloo, for real, through the toolkit's launcher (accelerate's drops
parallelism_config_ep_size). The plan's per-rank bytes and all-to-all traffic against what the ranks hold and send."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import BIN, ROOT, assert_updates_agree, check, free_port, logged, rank_reports, reference_run, run_cmd
from safetensors.torch import load_file
from test_bad_input import assert_one_clear_line
from test_pipeline import toolkit_launch
from transformers import AutoConfig

from toolkit.distributed.strategy import check_mesh_engine
from toolkit.errors import ConfigError
from toolkit.models import tiny
from toolkit.models.parallel import check_expert_parallel

pytestmark = pytest.mark.launch

RECIPE = "qwen3_moe_fft"
# Checkpoints every 2 steps. fp32: the ranks route every token as one process does. The recipe's
# load-balancing loss off: each rank computes it over its own tokens, as under any data parallelism (DDP too), and
# a balance over half the batch is not half the balance over all of it.
FLAGS = ["--tiny", "--report_to", "none", "--max_steps", "4", "--logging_steps", "1", "--save_strategy", "steps",
         "--save_steps", "2", "--record_rank_reports", "true", "--router_aux_loss_coef", "0"]  # fmt: skip
ROUTER = ("router_imbalance", "router_imbalance_mean", "experts_idle", "experts_idle_share")


@pytest.fixture(scope="module")
def moe_top2(tmp_path_factory) -> Path:
    """A user's small Qwen3-MoE: the recipe's tiny architecture (4 experts) routing each token to 2 of them (the
    recipe's tiny routes to all 4, which would leave nothing for the ranks to disagree on)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("qwen3-moe-top2")
    config = AutoConfig.from_pretrained(tiny.tiny_checkpoint("Qwen/Qwen3-30B-A3B", "sft"))
    config.num_experts_per_tok = 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tiny.tiny_tokenizer("Qwen/Qwen3-30B-A3B", "sft").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_process(moe_top2, tmp_path_factory) -> Path:
    return reference_run(RECIPE, [*FLAGS, "--model_name_or_path", str(moe_top2)], tmp_path_factory.mktemp("ep-ref"))


def test_expert_parallel_matches_one_process(moe_top2, one_process, tmp_path):
    """fsdp2_ep.yaml (2 ranks: dp_shard=2 x ep=2) against 1 process with the same global batch: each rank trains on
    its own rows, between them the 1-process run's, with its losses and its routers' figures (each rank counts its
    own tokens by the experts' global ids); each holds half the experts whole and half of the rest, with their
    gradients and AdamW states: the bytes its plan names; the checkpoints' weights and the export whole, each
    rank's optimizer shards beside them (which transformers does not write), from which a resume continues the
    run exactly."""
    out = tmp_path / "out"
    flags = [*FLAGS, "--model_name_or_path", str(moe_top2), "--per_device_train_batch_size", "4"]
    result = check(toolkit_launch("fsdp2_ep", RECIPE, *flags, "--output_dir", str(out), cwd=tmp_path, processes=2))
    assert "sharding      FSDP2 x expert parallel, experts split over 2 ranks, sharded over 2\n" in result.stdout
    assert "mesh          dp_shard=2 x ep=2\n" in result.stdout
    assert "x 2 processes = 8 global" in result.stdout

    (reference,) = rank_reports(one_process)
    ranks = rank_reports(out)
    assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == sorted(reference["rows"])
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for key in ROUTER:  # every token counted once, on its own rank, as on one
        assert logged(out, key) == pytest.approx(logged(one_process, key), rel=1e-6), key

    weights = load_file(one_process / "model.safetensors")
    total = sum(t.nbytes for t in weights.values())
    summary = json.loads((out / "run_summary.json").read_text())
    for rank in ranks:
        assert rank["param_bytes"] == total // 2  # experts: 2 of 4 whole; the rest: half of each tensor
        assert rank["optimizer_state_bytes"] == 2 * rank["param_bytes"]  # AdamW's two moments of it
        assert rank["loaded_param_bytes"] == rank["param_bytes"]  # from_pretrained gave it its part only
    assert summary["config"]["memory_plan"]["device"]["parameters"] == total // 2
    assert summary["config"]["memory_plan"]["device"]["optimizer_states"] == total

    assert sorted(p.name for p in (out / "checkpoint-2").glob("optimizer*")) == ["optimizer-rank0.pt",
                                                                                  "optimizer-rank1.pt"]  # fmt: skip
    for folder in (out, out / "checkpoint-2"):
        saved = load_file(folder / "model.safetensors")
        assert {n: t.shape for n, t in saved.items()} == {n: t.shape for n, t in weights.items()}
    assert_updates_agree(load_file(out / "model.safetensors"), weights, load_file(moe_top2 / "model.safetensors"))
    assert "distributed_config" not in json.loads((out / "config.json").read_text())  # loads anywhere

    resumed = tmp_path / "resumed"  # from step 2, as after a preemption: steps 3 and 4 again, bit for bit
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    check(toolkit_launch("fsdp2_ep", RECIPE, *flags, "--resume", "auto", "--output_dir", str(resumed), cwd=tmp_path,
                         processes=2))  # fmt: skip
    assert logged(resumed, "loss")[-2:] == logged(out, "loss")[-2:]
    assert logged(resumed, "learning_rate")[-2:] == logged(out, "learning_rate")[-2:]


def test_the_all_to_all_traffic_is_the_plans(moe_top2, tmp_path):
    """The rows every all-to-all carries in a forward and backward on 2 EP ranks (counted as torch dispatches them,
    tests/ep_exchange.py), against planner/traffic.py's all_to_all_bytes for the same tokens: each token's hidden
    state to each of its k experts and back, forward and backward, (ep - 1) / ep of them off the rank."""
    from toolkit.models.meta import meta_model
    from toolkit.planner.shape import Shape
    from toolkit.planner.traffic import all_to_all_bytes
    from toolkit.planner.workload import Workload

    out = tmp_path / "exchanges.json"
    script = ROOT / "tests" / "ep_exchange.py"
    check(run_cmd([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(script),
                   str(moe_top2), "2", "16", str(out)], cwd=tmp_path))  # fmt: skip
    counted = json.loads(out.read_text())
    config = AutoConfig.from_pretrained(moe_top2)
    shape = Shape.of(meta_model(config, "sft"), config)
    assert shape.routed_copies == config.num_hidden_layers * 2 and shape.experts_per_layer == 4
    assert counted["calls"] == 2 * config.num_hidden_layers * 4  # 2 ranks x layers x (dispatch, combine) x 2
    work = Workload(precision="fp32", micro_batch=2, seq_length=16)
    per_rank = counted["rows"] / 2 * config.hidden_size * 4  # fp32 rows, a rank's mean
    assert all_to_all_bytes(shape, work, ep=2) == pytest.approx(per_rank * (2 - 1) / 2, rel=1e-9)
    assert 0.3 < counted["off_rank"] / counted["rows"] < 0.7  # the even spread the plan assumes, roughly


def qwen3_moe(**changes) -> object:
    config = AutoConfig.from_pretrained(ROOT / "toolkit" / "hub_configs" / "Qwen--Qwen3-30B-A3B.json")
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    ("config", "mesh", "world", "kwargs", "message"),
    [
        (AutoConfig.for_model("llama"), {"dp_shard": 2, "ep": 2}, 2, {}, "dense model (no routed experts)"),
        (qwen3_moe(num_experts=6), {"dp_shard": 4, "ep": 4}, 4, {}, "does not divide the model's 6 experts"),
        (qwen3_moe(), {"dp_shard": 2, "ep": 4}, 2, {}, "`ep_size` must divide `fsdp_size * tp_size`"),
        (qwen3_moe(), {"dp_shard": 4, "ep": 2}, 2, {}, "covers 4 processes and the launch has 2"),
        (qwen3_moe(), {"dp_shard": 2, "ep": 2}, 2, {"use_lora": True}, "fully fine-tune (--use_lora false)"),
    ],
    ids=["dense", "experts", "ep-divides-dp", "processes", "lora"],
)
def test_expert_parallel_refusals_name_the_fix(config, mesh, world, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        check_expert_parallel(config, mesh, world, **kwargs)


def test_a_family_without_an_expert_plan_is_refused():
    config = qwen3_moe()
    type(config).base_model_ep_plan, saved = None, type(config).base_model_ep_plan
    try:
        with pytest.raises(ConfigError, match="no expert-parallel plan in transformers"):
            check_expert_parallel(config, {"dp_shard": 2, "ep": 2}, 2)
    finally:
        type(config).base_model_ep_plan = saved


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fsdp2_ep", "llama3_fft"], "llama is a dense model"),
        (["fsdp2_ep", "qwen3_moe_lora"], "LoRA under expert parallelism"),
        (["fsdp2_ep", "qwen3_moe_fft"], None),
    ],
)
def test_toolkit_check_refuses_what_expert_parallelism_cannot_train(argv, message, capsys):
    from toolkit.distributed.launch_check import main

    config, recipe = argv
    if message is None:
        assert main([str(ROOT / "accelerate_configs" / f"{config}.yaml"), recipe]) == 0
        assert capsys.readouterr().out == "fsdp2_ep.yaml: MULTI_GPU, recipe qwen3_moe_fft: ok\n"
        return
    with pytest.raises(SystemExit) as exit_info:
        main([str(ROOT / "accelerate_configs" / f"{config}.yaml"), recipe])
    assert exit_info.value.code == 2
    assert_one_clear_line(capsys.readouterr().err, message)


@pytest.mark.parametrize(("dp_shard", "processes"), [(1, 2), (2, 4)], ids=["tp-instead-of-dp_shard", "beside-dp_shard"])
def test_a_tensor_parallel_axis_beside_the_experts_is_refused_by_name(dp_shard, processes, tmp_path, capsys):
    """fsdp2_ep.yaml with parallelism_config_tp_size, as `toolkit check` and every rank (runner.py's
    check_mesh_engine) see it: refused naming tensor parallelism and both fixes; it had been a message about
    MULTI_GPU and dp_shard (without dp_shard) or passed the check (beside it)."""
    import yaml

    from toolkit.distributed.launch_check import main

    config = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2_ep.yaml").read_text())
    config["num_processes"] = processes
    config["parallelism_config"].update(parallelism_config_dp_shard_size=dp_shard, parallelism_config_tp_size=2)
    path = tmp_path / "fsdp2_ep_tp.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), RECIPE])
    assert exit_info.value.code == 2
    assert_one_clear_line(capsys.readouterr().err, "tensor parallelism does not combine with the toolkit's expert")
    with pytest.raises(ConfigError, match="drop parallelism_config_tp_size and set parallelism_config_dp_shard_size"):
        check_mesh_engine({"dp_shard": dp_shard, "tp": 2, "ep": 2}, "replicated", 1)


def test_accelerates_own_launcher_is_refused_in_one_line(monkeypatch):
    """accelerate launch drops parallelism_config_ep_size: the ranks see dp_shard=2 alone under MULTI_GPU, which
    accelerate would run as DDP of the whole model. The toolkit's launcher exports the key; a SLURM job's mesh
    flags (settings/mesh.py's job_mesh) carry it."""
    from toolkit.distributed.launcher import axis_flags, export_axes
    from toolkit.distributed.strategy import check_launcher_axes

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.delenv("PARALLELISM_CONFIG_EP_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ConfigError, match="only through the toolkit's: `python -m toolkit launch"):
        check_launcher_axes(world_size=2)
    found, rest = axis_flags(["--parallelism_config_ep_size", "2", "x.py"])
    assert found == {"parallelism_config_ep_size": "2"} and rest == ["x.py"]
    export_axes(str(ROOT / "accelerate_configs" / "fsdp2_ep.yaml"), {})
    import os

    assert os.environ["PARALLELISM_CONFIG_EP_SIZE"] == "2"
    check_launcher_axes(world_size=2)  # now an expert-parallel mesh
    from toolkit.settings.mesh import job_mesh, launch_flags

    section = {"parallelism_config_dp_shard_size": 2, "parallelism_config_ep_size": 8}  # a job's override of ep
    assert launch_flags(job_mesh(section, nodes=1, per_node=8)) == [
        "--parallelism_config_dp_replicate_size=1", "--parallelism_config_dp_shard_size=8",
        "--parallelism_config_ep_size=8"]  # fmt: skip  # slurm/launch_node.sh's flags: ep had been dropped


@pytest.mark.parametrize(("model", "experts"), [("qwen3_moe_fft", 128), ("mistralai/Mixtral-8x7B-v0.1", 8)])
def test_the_plan_lists_expert_parallelism_for_a_mixture_of_experts(model, experts, capsys):
    """`toolkit plan` on 8 H100s: fsdp2_ep sized for the node (the experts over 8 GPUs), its parameters per GPU
    1/8 of the model's as the tiny launch's ranks hold 1/2 (test above), preferred over fsdp2 where both fit (its
    experts are not gathered); no such row for a dense model (nothing to split)."""
    from toolkit.planner.cli import main

    assert main([model, "--gpu", "H100-80GB", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (row,) = [r for r in plan["configs"] if r["config"] == "fsdp2_ep"]
    assert row["expert_parallel"] == math.gcd(experts, 8) and not row["refused"]
    if model == "qwen3_moe_fft":  # 48 layers x 128 experts x (gate, up, down) of 2048 x 768, gathered twice in each
        # of the recipe's 16 micro-batches under FSDP, in bf16, 7/8 from the other GPUs
        assert row["expert_gathers_gib"] * 2**30 == pytest.approx(2 * 16 * 48 * 128 * 3 * 2048 * 768 * 2 * 7 / 8)
        # each of 16 x 2048 tokens to 8 experts in 48 layers, 2048 wide in bf16, 6 exchanges (checkpointing)
        assert row["all_to_all_gib"] * 2**30 == pytest.approx(6 * 16 * 2048 * 48 * 8 * 2048 * 2 * 7 / 8)
        assert row["all_to_all_seconds"] == pytest.approx(row["all_to_all_gib"] * 2**30 / 450e9)  # NVLink 4
    (fsdp2,) = [r for r in plan["configs"] if r["config"] == "fsdp2"]
    assert row["device_gib"] < fsdp2["device_gib"]  # the same shards at rest; the experts are not gathered
    order = [r["config"] for r in plan["configs"]]
    assert order.index("fsdp2_ep") < order.index("fsdp2")
    assert main(["llama3_fft", "--gpu", "H100-80GB", "--gpus", "8", "--json"]) == 0
    assert "fsdp2_ep" not in [r["config"] for r in json.loads(capsys.readouterr().out)["configs"]]
