"""The strategy asked for against the one in effect: a refusal when they differ, before a step is paid for.

accelerate degrades silently in several ways (../shared/cpu-distributed.md): an FSDP config becomes plain DDP
on CPU, `--cpu --num_processes 2` starts one process, and ranks that never joined a process group each train
alone on the whole data set. Every one of these costs a full run before anyone notices, so we refuse to start.
What was asked for is read from the environment (launch.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType

from ..errors import ToolkitError
from ..planner.layout import Layout
from ..project import PROJECT_ROOT
from .launch import Requested, env_flag, num_machines


class StrategyMismatch(ToolkitError, RuntimeError):
    """The launch does not run the strategy its config asked for."""


def resolve_config_paths() -> None:
    """Let an accelerate config name its DeepSpeed JSON relative to the project, from any working directory."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or Path(path).is_file():
        return
    candidate = PROJECT_ROOT / path
    if not candidate.is_file():
        raise StrategyMismatch(
            f"DeepSpeed config file '{path}' (deepspeed_config_file in the accelerate config) not found from "
            f"{Path.cwd()} nor from {PROJECT_ROOT}."
        )
    os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(candidate)


def describe(accelerator, layout: Layout | None = None) -> dict[str, str | int]:
    """The strategy in effect, as printed in the run header and logged to W&B."""
    layout = layout or Layout.from_accelerator(accelerator)
    return {
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "num_machines": num_machines(accelerator.num_processes),
        "device": str(accelerator.device.type),
        "mixed_precision": accelerator.mixed_precision,
        "sharding": layout.sharding,
        "backend": str(accelerator.state.backend) if accelerator.state.backend else "none",
    }


def check_4bit_engine(engine: str) -> None:
    """QLoRA's 4-bit base (bitsandbytes) is replicated, not sharded: refused under FSDP and DeepSpeed (engine as
    Requested.engine names it), by `toolkit check` and by the run, before the weights load."""
    from ..errors import ConfigError

    if engine != "replicated":
        raise ConfigError("QLoRA (--load_in_4bit) trains under single_gpu.yaml or ddp.yaml: its 4-bit base is small "
                          "enough to replicate (Llama-3-8B: 5.7 GB per device); sharding it under FSDP or DeepSpeed "
                          "is not supported yet.")  # fmt: skip


def check_mesh_engine(mesh: dict[str, int], engine: str, fsdp_version: int) -> None:
    """Each sequence split has its engine (engine as Requested.engine names it): DeepSpeed's Ulysses (sp) runs
    inside DeepSpeed, torch's context parallelism (cp) inside FSDP2; elsewhere accelerate fails after the weights
    load, or (sp) quietly trains without splitting. Expert parallelism goes over dp_shard alone, without tp."""
    from ..errors import ConfigError

    if mesh.get("sp", 1) > 1 and engine != "DEEPSPEED":
        raise ConfigError("parallelism_config_sp_size is DeepSpeed's sequence parallelism (Ulysses): it needs a "
                          "DeepSpeed config, accelerate_configs/zero3_sp.yaml (or cp_size with FSDP2: "
                          "fsdp2_cp.yaml).")  # fmt: skip
    if mesh.get("pp", 1) > 1 and engine in ("FSDP", "DEEPSPEED"):
        raise ConfigError("parallelism_config_pp_size is the toolkit's pipeline on torch's own engine: it runs under "
                          "distributed_type MULTI_GPU, its stages' replicas reducing their gradients themselves "
                          "(accelerate_configs/pp.yaml, pp_ddp.yaml).")  # fmt: skip
    if mesh.get("ep", 1) > 1 and mesh.get("tp", 1) > 1:  # before the next check, which would name dp_shard alone
        raise ConfigError(f"parallelism_config_tp_size {mesh['tp']} with parallelism_config_ep_size {mesh['ep']}: "
                          "tensor parallelism does not combine with the toolkit's expert parallelism, which splits "
                          "the experts over the dp_shard ranks and FSDP2-shards the rest (fsdp2_ep.yaml): drop "
                          "parallelism_config_tp_size and set parallelism_config_dp_shard_size to the processes, or "
                          "drop parallelism_config_ep_size for tensor parallelism (fsdp2_tp.yaml).")  # fmt: skip
    if mesh.get("ep", 1) > 1 and (engine in ("FSDP", "DEEPSPEED") or "dp_shard" not in mesh):
        raise ConfigError("parallelism_config_ep_size is transformers' expert parallelism, applied with FSDP2 as the "
                          "weights load: it runs under distributed_type MULTI_GPU with parallelism_config_dp_shard_"
                          "size (accelerate_configs/fsdp2_ep.yaml).")  # fmt: skip
    if mesh.get("cp", 1) > 1 and (engine != "FSDP" or fsdp_version != 2):
        raise ConfigError("parallelism_config_cp_size is torch's context parallelism: it needs FSDP2 (accelerate_"
                          "configs/fsdp2_cp.yaml), or for DeepSpeed use sp_size (zero3_sp.yaml).")  # fmt: skip


def check_launcher_axes(world_size: int) -> None:
    """Pipeline stages and expert parallelism reach the processes through `toolkit launch`
    (PARALLELISM_CONFIG_PP_SIZE, _EP_SIZE); accelerate's own launcher drops the keys: a pipeline file's ranks start
    with a mesh of 1s, which accelerate would quietly run as DDP of the whole model, an expert-parallel file's with
    dp_shard alone under MULTI_GPU, DDP again: both refused. Under stages, accelerate's mesh (which has no pipeline
    axis, and would count the stages as replicas) is left off: the trainer's pipeline part forms its own
    (training/pipeline.py)."""
    from ..errors import ConfigError
    from ..settings.mesh import launch_mesh

    if not env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        return
    mesh = launch_mesh()
    sharded = env_flag("ACCELERATE_USE_FSDP") or env_flag("ACCELERATE_USE_DEEPSPEED")
    if "pp" in mesh:
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
    elif world_size > 1 and (not mesh or set(mesh) == {"dp_shard"} and not sharded):
        raise ConfigError("this launch's parallelism_config reached the processes without its pipeline or expert "
                          "axis: accelerate's launcher drops parallelism_config_pp_size and _ep_size, which reach "
                          "them only through the toolkit's: `python -m toolkit launch --config_file CONFIG ...` "
                          "(or make finetune).")  # fmt: skip


# accelerate's fp8_config backends: the module each imports, and what installs it.
FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with FP8 tensor cores (Ada, Hopper)
FP8_BACKENDS = {"AO": ("torchao", "torchao"), "TE": ("transformer_engine", "transformer-engine[pytorch]"),
                "MSAMP": ("msamp", "ms-amp")}  # fmt: skip


def cuda_capability() -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def check_fp8(backend: str | None, load_in_4bit: bool, capability: tuple[int, int] | None, engine: str = "FSDP",
              ram_efficient_loading: bool = False) -> None:  # fmt: skip
    """FP8 (mixed_precision: fp8) needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell; on an
    older GPU accelerate quietly trains in fp16 instead), its backend installed (accelerate's launcher otherwise
    stops with a traceback), weights it can cast (not QLoRA's 4-bit base), and what accelerate's Accelerator
    accepts (accelerator.py, 1.15), which it refuses only once the weights have loaded: torchao under FSDP with
    RAM-efficient loading, MS-AMP under FSDP. `capability`: None, no CUDA (TOOLKIT_FP8_ON_CPU=1 lets the tests
    train torchao's float8 on a CPU, where it runs, slowly). `engine`: as Requested.engine names it."""
    from ..errors import ConfigError
    from .launch import env_flag

    if load_in_4bit:
        raise ConfigError("QLoRA (--load_in_4bit) with mixed_precision fp8: the 4-bit base has no float8 path. "
                          "Train QLoRA with single_gpu.yaml or ddp.yaml, or full or LoRA runs in FP8.")  # fmt: skip
    name = (backend or "AO").upper()
    module, package = FP8_BACKENDS.get(name, (None, None))
    if module is None:
        raise ConfigError(f"fp8_config backend {backend}: accelerate knows {', '.join(FP8_BACKENDS)}.")
    if name == "AO" and engine == "FSDP" and ram_efficient_loading:
        raise ConfigError("fsdp_cpu_ram_efficient_loading true with torchao's FP8: accelerate refuses the pair once "
                          "the weights have loaded ('torchao with FSDP2 and cpu_ram_efficient_loading is not "
                          "supported'): set fsdp_cpu_ram_efficient_loading: false in the config (as "
                          "accelerate_configs/fsdp2_fp8.yaml does).")  # fmt: skip
    if name == "MSAMP" and engine == "FSDP":
        raise ConfigError("fp8_config backend MSAMP under FSDP: accelerate does not support the pair: use backend AO "
                          "(torchao) with FSDP2, or MS-AMP under DeepSpeed.")  # fmt: skip
    cpu_switch = capability is None and name == "AO" and env_flag("TOOLKIT_FP8_ON_CPU")
    if (capability is None or capability < FP8_CAPABILITY) and not cpu_switch:
        found = "this machine has no CUDA GPU" if capability is None else f"this GPU is {capability[0]}.{capability[1]}"
        raise ConfigError(f"mixed_precision fp8 needs GPUs with FP8 tensor cores (compute capability 8.9+: H100, "
                          f"H200, L40S, B200) and {found}: use the same strategy without FP8 (fsdp2.yaml), "
                          "in bf16.")  # fmt: skip
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"fp8_config backend {name} needs {module}: `pip install {package}`.")


def check_processes(num_processes: int, requested: Requested | None = None) -> None:
    """Run as soon as the process group exists, before any weights are loaded."""
    requested = requested or Requested.from_env()
    if requested.collapsed_launch:
        raise StrategyMismatch(
            "accelerate was asked for several processes but started only this one (its simple launcher: "
            "`--cpu` or `distributed_type: MULTI_CPU` without MPI). On a CPU machine launch with "
            "`accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes N ...` instead: the "
            "toolkit runs it over gloo."
        )
    if requested.num_processes is not None and requested.num_processes != num_processes:
        raise StrategyMismatch(
            f"{requested.num_processes} processes were launched but this one sees a job of {num_processes}: "
            "the ranks are training independently on the same data. On a machine without GPUs pass "
            "--use_cpu true so they join one gloo process group."
        )


def check_strategy(accelerator: Accelerator, requested: Requested | None = None) -> None:
    """Run once the Trainer has built its accelerator, before training."""
    requested = requested or Requested.from_env()
    check_processes(accelerator.num_processes, requested)
    in_effect = accelerator.distributed_type
    if requested.fsdp and in_effect != DistributedType.FSDP:
        raise StrategyMismatch(
            f"The config asks for FSDP but accelerate set up {in_effect.value} (no sharding). On CPU, accelerate "
            "turns FSDP into DDP; launch a DDP or DeepSpeed config instead, or run the FSDP config on GPUs."
        )
    if requested.deepspeed and in_effect != DistributedType.DEEPSPEED:
        raise StrategyMismatch(f"The config asks for DeepSpeed but accelerate set up {in_effect.value}.")
    check_hybrid_mesh(accelerator)


def check_hybrid_mesh(accelerator: Accelerator) -> None:
    """HYBRID_SHARD shards inside a node: a shard group that spans nodes all-gathers over the slow network.

    The mesh is replicate x shard with the shard dimension innermost, so shard groups are runs of consecutive
    ranks; they stay inside a node when the processes per node are a multiple of the shard size.
    """
    mesh = accelerator.parallelism_config
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    if mesh is None or not (mesh.dp_replicate_enabled and mesh.dp_shard_enabled) or per_node % mesh.dp_shard_size == 0:
        return
    nodes = max(1, accelerator.num_processes // per_node)
    raise StrategyMismatch(
        f"The HYBRID_SHARD mesh shards over {mesh.dp_shard_size} processes but a node runs {per_node}: set "
        f"parallelism_config_dp_shard_size: {per_node} and parallelism_config_dp_replicate_size: {nodes} in the "
        f"config, or pass --parallelism_config_dp_shard_size {per_node} "
        f"--parallelism_config_dp_replicate_size {nodes} to accelerate launch."
    )


def layer_class(model) -> str:
    """The model's repeated blocks (LlamaDecoderLayer, BertLayer): the class of its longest layer list, and an
    image-text model's tower's too (Gemma3DecoderLayer,SiglipEncoderLayer), as FSDP_TRANSFORMER_CLS_TO_WRAP lists
    them: each encoder layer a unit of its own, not the whole tower one unit with the model's root."""
    from ..models.vision import image_encoder

    tower = image_encoder(model)
    # an image-text model's decoder layers by its decoder's list: Qwen2.5-VL's tower has the longest (32 to 28)
    decoder = model.get_decoder() if tower is not None and hasattr(model, "get_decoder") else model
    classes = [longest_list_class(decoder)]
    if tower is not None and (inner := longest_list_class(tower, required=False)) not in (None, *classes):
        classes.append(inner)
    return ",".join(classes)


def longest_list_class(model, required: bool = True) -> str | None:
    """The class of the longest list of identical modules in `model`."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    blocks = [m for m in lists if len({type(x) for x in m}) == 1]
    if not blocks:
        if not required:
            return None
        raise StrategyMismatch(f"{type(model).__name__} has no list of identical layers for FSDP to wrap.")
    return type(max(blocks, key=len)[0]).__name__


def set_fsdp_wrap_class(model) -> None:
    """FSDP wraps one unit per transformer layer: the config's class if it names one (checked), else the model's.

    Left empty, accelerate wraps every class in `_no_split_modules`, which for BERT includes the embeddings
    module; it then wraps the word embeddings inside it a second time and FSDP2 fails at set-up.
    """
    if not env_flag("ACCELERATE_USE_FSDP"):
        return
    configured = [c.strip() for c in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip()]
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in configured if c not in present]
    if missing:
        raise StrategyMismatch(
            f"fsdp_transformer_layer_cls_to_wrap names {missing}, which {type(model).__name__} does not have. "
            f"Set it to {layer_class(model)} or to null (the model's own layer classes)."
        )
    if not configured:
        os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = layer_class(model)
