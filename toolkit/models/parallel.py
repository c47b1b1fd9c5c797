"""What a model and a recipe must allow for the mesh a launch asked for (settings/mesh.py), checked from the config
before any weight loads. Tensor parallelism splits each layer by transformers' own plan; context parallelism
(torch's ring attention under FSDP2) and sequence parallelism (DeepSpeed's Ulysses) split each row's sequence."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError
from ..metrics.routing import fused_experts
from ..settings.mesh import describe as describe_mesh
from ..settings.mesh import mesh_processes, sequence_attention
from ..settings.tasks import task as task_of
from .meta import meta_model

if TYPE_CHECKING:  # the settings import transformers' TrainingArguments (and peft): not for `toolkit check`
    from ..settings.arguments import Arguments

CP_ON_CPU = (
    "context parallelism (parallelism_config_cp_size) needs CUDA GPUs: torch's ring attention shards only the GPU "
    "attention kernels (on a CPU: 'aten._scaled_dot_product_flash_attention_for_cpu does not have a sharding "
    "strategy registered'): on a CPU use accelerate_configs/zero3_sp.yaml (DeepSpeed's sequence parallelism)."
)


def check_mesh_size(mesh: dict[str, int], world_size: int, fix: str) -> None:
    """The mesh must cover the processes. Under DeepSpeed's sequence parallelism the data-parallel axis is
    implicit (DeepSpeed forms it from the rest), so there the mesh need only divide them. Expert parallelism is no
    axis of its own: its groups lie across the dp_shard (x tp) ranks (transformers' DistributedConfig)."""
    product = mesh_processes(mesh)
    if world_size <= 1 or not mesh:
        return
    if "sp" in mesh and world_size % product == 0:
        return
    if product != world_size:
        raise ConfigError(f"the mesh {describe_mesh(mesh)} covers {product} processes and the launch has "
                          f"{world_size}: {fix}")  # fmt: skip


def check_tensor_parallel(config: PretrainedConfig, mesh: dict[str, int], world_size: int,
                          lora_targets: str | list[str] | None = None, task: str = "sft") -> None:  # fmt: skip
    """A tensor-parallel launch (the accelerate config's `parallelism_config_tp_size`), before any weight loads:
    a mesh that covers the processes, a model transformers can split, heads that split evenly, and LoRA adapters
    peft can put on the shards (`lora_targets`: the run's target modules)."""
    tp = mesh.get("tp", 1)
    if tp == 1:
        return
    check_mesh_size(mesh, world_size, f"set --num_processes {mesh_processes(mesh)}, or parallelism_config "
                                      f"sizes whose product is {world_size}.")  # fmt: skip
    if not getattr(config, "base_model_tp_plan", None):
        raise ConfigError(f"{config.model_type} has no tensor-parallel plan in transformers (base_model_tp_plan): "
                          "train it with accelerate_configs/fsdp2.yaml (sharded data parallelism).")  # fmt: skip
    if lora_targets is not None and lora_on_experts(meta_model(config, task), lora_targets):
        raise ConfigError("LoRA on a mixture of experts' fused experts under tensor parallelism: peft's adapters on "
                          "parameters do not run on transformers' shards ('ParamWrapper' object has no attribute "
                          "'weight'): leave the experts out (--lora_target_modules q_proj,k_proj,v_proj,o_proj), or "
                          "train LoRA with fsdp2.yaml or zero3.yaml.")  # fmt: skip
    heads = {"attention heads": getattr(config, "num_attention_heads", None),
             "key/value heads": getattr(config, "num_key_value_heads", None)}  # fmt: skip
    for what, count in heads.items():
        if count and count % tp:
            raise ConfigError(f"tp_size {tp} does not divide the model's {count} {what}: use a tp_size that "
                              f"divides {count} (parallelism_config_tp_size in the accelerate config).")  # fmt: skip


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # the families' names for it


def routed_expert_count(config: PretrainedConfig) -> int | None:
    """A mixture of experts' routed experts per layer, from its config; None for a dense model."""
    return next((value for key in EXPERT_COUNTS if isinstance(value := getattr(config, key, None), int) and value > 1),
                None)  # fmt: skip


def recipe_lora_targets(values: dict) -> str | list[str] | None:
    """A recipe's LoRA target modules as the run reads them (ModelArguments.lora_settings); None without LoRA."""
    from ..settings.model_arguments import ModelArguments, lora_targets

    if not values.get("use_lora"):
        return None
    return lora_targets(values.get("lora_target_modules", ModelArguments.lora_target_modules))


def lora_on_experts(model: torch.nn.Module, targets: str | list[str]) -> bool:
    """Whether LoRA with these target modules adapts `model`'s fused experts (a meta-device instance will do): peft's
    "all-linear" takes them, by its adapters on parameters, as does a target naming an experts module."""
    experts = [name for name, module in model.named_modules() if fused_experts(module)]
    return bool(experts) and (targets == "all-linear" or any(name.endswith(tuple(targets)) for name in experts))


def check_expert_parallel(config: PretrainedConfig, mesh: dict[str, int], world_size: int,
                          use_lora: bool = False) -> None:  # fmt: skip
    """An expert-parallel launch (`parallelism_config_ep_size`), before any weight loads: transformers' own rules
    for the sizes (DistributedConfig: ep divides dp_shard x tp, a multiple of tp), a mixture of experts with an
    expert-parallel plan (base_model_ep_plan), experts that split evenly, and full fine-tuning (peft's adapters do
    not run on the shards)."""
    ep = mesh.get("ep", 1)
    if ep == 1:
        return
    from transformers.distributed import DistributedConfig

    try:
        DistributedConfig(ep_size=ep, fsdp_size=mesh.get("dp_shard", 1), tp_size=mesh.get("tp", 1))
    except ValueError as error:
        raise ConfigError(f"parallelism_config_ep_size {ep} with {describe_mesh(mesh)}: {error} (transformers' "
                          "DistributedConfig): set ep_size to dp_shard_size or a divisor of it.") from None  # fmt: skip
    check_mesh_size(mesh, world_size, f"set --num_processes {mesh_processes(mesh)}, or a dp_shard_size of "
                                      f"{world_size}.")  # fmt: skip
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = routed_expert_count(text)
    if experts is None:
        raise ConfigError(
            f"{config.model_type} is a dense model (no routed experts): parallelism_config_ep_size "
            "splits a mixture of experts' experts: train it with accelerate_configs/fsdp2.yaml."
        )
    if not getattr(config, "base_model_ep_plan", None):
        raise ConfigError(
            f"{config.model_type} has no expert-parallel plan in transformers (base_model_ep_plan): "
            "train it with accelerate_configs/fsdp2.yaml (its experts sharded with the rest)."
        )
    if experts % ep:
        raise ConfigError(f"ep_size {ep} does not divide the model's {experts} experts: use an ep_size that divides "
                          f"{experts} (parallelism_config_ep_size in the accelerate config).")  # fmt: skip
    if use_lora:
        raise ConfigError("LoRA under expert parallelism: peft's adapters do not run on the weights transformers "
                          "shards as they load (on the experts' fused weights: 'mixed torch.Tensor and DTensor'): "
                          "train LoRA with fsdp2.yaml or zero3.yaml, or fully fine-tune (--use_lora false) under "
                          "fsdp2_ep.yaml.")  # fmt: skip


def check_sequence_heads(config: PretrainedConfig, sp: int) -> None:
    heads = getattr(config, "num_attention_heads", None)
    if sp > 1 and heads and heads % sp:
        raise ConfigError(f"sp_size {sp} does not divide the model's {heads} attention heads (Ulysses gives each "
                          f"rank whole heads): use an sp_size that divides {heads}.")  # fmt: skip


def check_split_task(mesh: dict[str, int], task: str) -> None:
    """A split cuts the rows of a causal language model: sft recipes only (the run's and `toolkit check`'s). Online
    RL (grpo, rloo) takes no model-parallel axis at all: TRL samples with the whole model on each rank and builds the
    rows it trains on after generation, inside its trainer."""
    split = [f"parallelism_config_{axis}_size {mesh[axis]}" for axis in ("tp", "cp", "sp", "pp")
             if mesh.get(axis, 1) > 1]  # fmt: skip
    if task_of(task).samples_online and split:
        trainer = "DistillationTrainer" if task_of(task).teacher else f"{task.upper()}Trainer"
        raise ConfigError(f"{', '.join(split)} under {task}: TRL's {trainer} samples completions with "
                          "the whole model on every rank and builds the rows it trains on after generation, which "
                          "tensor, context, sequence and pipeline parallelism cannot split: use ddp.yaml, "
                          "fsdp2.yaml, zero2.yaml or zero3.yaml.")  # fmt: skip
    axis = next((axis for axis in ("cp", "sp") if mesh.get(axis, 1) > 1), None)
    if axis and task != "sft":
        raise ConfigError(f"parallelism_config_{axis}_size {mesh[axis]} splits the rows of a causal language model "
                          f"(sft recipes); a {task} recipe's trainer does not take split rows: use a config without "
                          "it (fsdp2.yaml, zero3.yaml).")  # fmt: skip


def check_sequence_split(config: PretrainedConfig, mesh: dict[str, int], args: Arguments, *, on_gpu: bool,
                         world_size: int = 1) -> None:  # fmt: skip
    """Context (cp) or sequence (sp) parallelism: the rows of a causal LM, each batch padded to a multiple of the
    split so that every rank's slice is equally long (settings/mesh.py's split_multiple; max_seq_length a multiple
    of it, so no padded row is longer), attention each engine can run, and packed rows
    only where the kernel keeps them apart. Sets what the recipe left open: packing (off unless Ulysses runs flash
    attention), the attention (Ulysses' kernel). TRL's fused loss scores the pre-shifted labels a split passes."""
    cp, sp = mesh.get("cp", 1), mesh.get("sp", 1)
    if cp * sp == 1:
        return
    axis, size = ("cp", cp) if cp > 1 else ("sp", sp)
    setting = f"parallelism_config_{axis}_size {size}"
    fix = "dividing" if sp > 1 else "times the other sizes equal to"
    check_mesh_size(mesh, world_size, f"set --num_processes {math.prod(mesh.values())}, or a {axis}_size {fix} "
                                      f"{world_size}.")  # fmt: skip
    data, model = args.data, args.model
    check_split_task(mesh, data.task)
    if cp > 1 and not on_gpu:
        raise ConfigError(CP_ON_CPU)
    multiple = 2 * cp if cp > 1 else sp  # torch's load-balanced ring attention cuts a row into 2 x cp chunks
    if data.max_seq_length % multiple:
        fit = math.ceil(data.max_seq_length / multiple) * multiple
        raise ConfigError(f"max_seq_length {data.max_seq_length} does not split evenly under {setting} (rows are "
                          f"cut into {multiple} equal slices): pass --max_seq_length {fit}.")  # fmt: skip
    check_sequence_heads(config, sp)
    attention = model.attn_implementation or "auto"
    if sp > 1:  # Ulysses runs its own kernel on each rank's heads (settings/mesh.py)
        kernel = sequence_attention()
        if attention not in ("auto", kernel):
            raise ConfigError(f"--attn_implementation {attention}: under {setting} attention runs on DeepSpeed's "
                              f"kernel, {kernel}: set parallelism_config_sp_attn_implementation: {attention} in the "
                              "accelerate config, or leave --attn_implementation at auto.")  # fmt: skip
        model.attn_implementation = kernel
    elif attention not in ("auto", "sdpa"):
        raise ConfigError(f"--attn_implementation {attention} cannot run under {setting}: torch's ring attention "
                          "shards sdpa only: pass --attn_implementation sdpa (or auto).")  # fmt: skip
    # Ulysses gives sdpa one causal mask over the gathered row and torch's ring attention is causal only: packed
    # conversations would see each other. flash attention's varlen path reads the restarts of position_ids.
    keeps_apart = sp > 1 and model.attn_implementation.startswith("flash")
    if data.packing and not keeps_apart:
        other = " or parallelism_config_sp_attn_implementation: flash_attention_2 (a GPU)" if sp > 1 else ""
        raise ConfigError(f"--packing true under {setting}: its attention masks one causal row, so packed "
                          f"conversations would attend to each other: pass --packing false{other}.")  # fmt: skip
    if data.packing is None:
        data.packing = keeps_apart


def accelerator_parallelism(mesh: dict[str, int]):
    """accelerate's view of a model transformers sharded at load (tensor parallelism), for the Trainer: every
    data-parallel rank on one dp_shard axis. The Trainer sets accelerate's dp_shard to the model's data-parallel
    size (replicas x shards) and leaves dp_replicate as the launch set it: with replicas (a tp.yaml job on several
    nodes, settings/mesh.py's job_mesh) accelerate's mesh would count them twice and fail ("Mesh should not be
    bigger than default world size"). accelerate only spreads the data under tensor parallelism, which this keeps.
    None where there is nothing to change."""
    replicas = mesh.get("dp_replicate", 1)
    if mesh.get("tp", 1) == 1 or replicas == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=1, dp_shard_size=replicas * mesh.get("dp_shard", 1), tp_size=mesh["tp"])
