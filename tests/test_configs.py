"""Every config file parses with its owner's own loader, and every one is launched by the strategy matrix."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import ROOT
from test_strategies import STRATEGIES
from transformers import TrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from toolkit.distributed.patches import fsdp_cpu
from toolkit.distributed.strategy import StrategyMismatch, check_hybrid_mesh, resolve_config_paths

YAMLS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
JSONS = sorted((ROOT / "ds_configs").glob("*.json"))


def test_every_config_is_in_the_launch_matrix():
    assert {p.stem for p in YAMLS} == set(STRATEGIES)


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_accelerate_loads_config(path):
    config = load_config_from_file(str(path))
    text = path.read_text()
    # every key is annotated
    keys = [line for line in text.splitlines() if line and not line.startswith(("#", " ", "-")) and ":" in line]
    assert all("#" in line for line in keys if not line.startswith(("tpu_", "downcast", "compute_environment")))
    if config.distributed_type.value == "DEEPSPEED":
        assert (ROOT / config.deepspeed_config["deepspeed_config_file"]).is_file()


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.stem)
def test_deepspeed_parses_config(path):
    """transformers fills the "auto" values from TrainingArguments and the model; DeepSpeed then accepts it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    hf = HfTrainerDeepSpeedConfig(str(path))
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=3e-5, use_cpu=True)  # fmt: skip
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 100)
    ds = DeepSpeedConfig(hf.config)
    assert ds.zero_optimization_stage == int(path.stem[4])
    assert ds.train_micro_batch_size_per_gpu == 4 and ds.gradient_accumulation_steps == 2
    assert ("offload" in path.stem) == (ds.zero_config.offload_optimizer is not None)
    if ds.zero_optimization_stage == 3:
        assert ds.zero_config.gather_16bit_weights_on_model_save  # else ZeRO-3 saves empty weights
    assert any(path.name in y.read_text() for y in YAMLS)  # some accelerate config uses it


def test_deepspeed_config_path_resolves_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/zero2.json")
    resolve_config_paths()
    assert Path(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) == ROOT / "ds_configs" / "zero2.json"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/nope.json")
    with pytest.raises(StrategyMismatch, match="nope.json.*not found"):
        resolve_config_paths()


def test_fsdp1_hybrid_on_cpu_names_the_fsdp2_config(monkeypatch):
    """FSDP1 FULL_SHARD / SHARD_GRAD_OP run as FSDP2 on CPU (the matrix launches fsdp.yaml); HYBRID_SHARD is refused."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "HYBRID_SHARD")
    with pytest.raises(StrategyMismatch, match="FSDP1 HYBRID_SHARD needs GPUs.*accelerate_configs/fsdp_hybrid.yaml"):
        fsdp_cpu.PATCH.apply()


@pytest.mark.parametrize(("per_node", "shard", "refused"), [(2, 2, False), (4, 2, False), (2, 4, True)])
def test_hybrid_shard_groups_stay_inside_a_node(monkeypatch, per_node, shard, refused):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    mesh = SimpleNamespace(dp_replicate_enabled=True, dp_shard_enabled=True, dp_shard_size=shard)
    accelerator = SimpleNamespace(parallelism_config=mesh, num_processes=8)
    if refused:
        fix = "--parallelism_config_dp_shard_size 2 --parallelism_config_dp_replicate_size 4"
        with pytest.raises(StrategyMismatch, match=fix):
            check_hybrid_mesh(accelerator)
    else:
        check_hybrid_mesh(accelerator)
