"""`python -m toolkit check CONFIG [RECIPE]`: a strategy file checked before `accelerate launch` starts.

accelerate and DeepSpeed read their files inside the launched processes: a typo surfaces as a traceback from
every rank, some only after the weights are loaded (DeepSpeed's config at `deepspeed.initialize`), some never
(an unknown key under `fsdp_config` is dropped, an FSDP file with a `deepspeed_config` section trains without
DeepSpeed). Every check here takes well under a second; `make finetune` runs them first.
"""

from __future__ import annotations

import difflib
import json
import typing
from pathlib import Path
from types import SimpleNamespace

import yaml
from accelerate.commands.config.config_args import ClusterConfig

from ..data.sources import model_config
from ..errors import ConfigError, command, description
from ..models.meta import meta_model
from ..models.parallel import (
    accelerator_parallelism,
    check_expert_parallel,
    check_mesh_size,
    check_sequence_heads,
    check_split_task,
    check_tensor_parallel,
    recipe_lora_targets,
)
from ..models.pipeline import check_pipeline, check_pipeline_task, check_schedule
from ..project import (
    PROJECT_ROOT,
    is_recipe,
    load_recipe,
    project_path,
    recipe_name,
    recipe_names,
    strategy_files,
)
from ..settings.mesh import LAUNCHER_KEYS, PIPELINE_SCHEDULES, config_mesh
from .strategy import FP8_CAPABILITY, check_4bit_engine, check_fp8, check_mesh_engine, cuda_capability, layer_class

SECTIONS = ("fsdp_config", "deepspeed_config", "parallelism_config", "fp8_config")  # keys: accelerate launch flags


def suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def known_keys() -> tuple[set[str], set[str]]:
    """Top-level keys of accelerate's config file, and the launch flags its sections may set (with the pipeline's,
    which `toolkit launch` passes on: settings/mesh.py)."""
    from accelerate.commands.launch import launch_command_parser

    flags = {action.dest for action in launch_command_parser()._actions} | set(LAUNCHER_KEYS)
    return set(ClusterConfig.__dataclass_fields__), flags


def launch_flag_types() -> dict:
    """Each accelerate launch flag's type, as its parser converts it (int, float, str)."""
    from accelerate.commands.launch import launch_command_parser

    types = {action.dest: action.type for action in launch_command_parser()._actions if action.type is not None}
    return {**types, **{key: int for key in LAUNCHER_KEYS if key.endswith("_size")}}


# Numbers only: accelerate reads its flags as text (its own files write downcast_bf16: 'no').
NUMBERS = {int: "an integer", float: "a number"}


def check_value(key: str, value, kind, path: Path, section: str = "") -> None:
    """A value of the type accelerate reads it as (a number where it compares and adds it: `num_processes: two` was
    a TypeError in accelerate launch); `kind` is a type hint, or a parser's type function."""
    kinds = set(typing.get_args(kind)) or {kind}
    wanted = next((k for k in NUMBERS if k in kinds), None)
    if wanted is None or value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if wanted is float else int):
        where = f" under {section}" if section else ""
        raise ConfigError(f"{key}{where} in {path} must be {NUMBERS[wanted]}, got {value!r}.")


def read_yaml(path: Path) -> dict:
    if not path.is_file():
        known = ", ".join(p.name for p in strategy_files())
        raise ConfigError(f"Config file not found: {path}. The strategy files are in accelerate_configs/: {known}.")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must be a mapping of accelerate settings, got {type(values).__name__}.")
    return values


def deepspeed_file(config: dict, path: Path) -> Path:
    name = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not name:
        raise ConfigError(f"{path}: distributed_type DEEPSPEED needs deepspeed_config.deepspeed_config_file "
                          "(a JSON in ds_configs/).")  # fmt: skip
    candidate = project_path(name)
    if candidate.is_file():
        return candidate
    raise ConfigError(f"{path}: deepspeed_config_file '{name}' not found from {Path.cwd()} nor {PROJECT_ROOT}.")


def check_deepspeed_json(json_path: Path) -> dict:
    """DeepSpeed's own config classes, with the "auto" values filled the way the Trainer fills them."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    try:
        values = json.loads(json_path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{json_path} is not valid JSON: {error}") from None
    from deepspeed.runtime.config import DeepSpeedConfig

    hf = HfTrainerDeepSpeedConfig(values)
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=1, use_cpu=True)
    try:
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 100)
        DeepSpeedConfig(hf.config)
    except Exception as error:  # pydantic's ValidationError, DeepSpeed's own asserts and ValueErrors
        message = str(error).split("\n    For further information")[0]
        raise ConfigError(f"DeepSpeed rejects {json_path}: {message}") from None
    return values


def check_offload_builds(json_path: Path, zero: dict) -> None:
    """ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's C++ Adam, compiled on first use."""
    if (zero.get("offload_optimizer") or {}).get("device") not in ("cpu", "nvme"):
        return
    from deepspeed.ops.op_builder import CPUAdamBuilder

    if not CPUAdamBuilder().is_compatible(verbose=False):
        raise ConfigError(f"{json_path} offloads the optimizer, but DeepSpeed's CPU Adam cannot be built here "
                          "(it needs a C++ compiler and the Python headers: `apt install build-essential "
                          "python3-dev`). Or use a config without offload: ds_configs/zero3.json.")  # fmt: skip


def check_wrap_class(config: dict, path: Path, recipe: str) -> None:
    """A layer class to wrap that the recipe's model does not have fails deep inside accelerate's prepare."""
    wrap = (config.get("fsdp_config") or {}).get("fsdp_transformer_layer_cls_to_wrap")
    if not wrap:
        return  # the toolkit takes the model's own repeated layer class
    values = load_recipe(recipe)
    model = meta_model(model_config(values["model_name_or_path"]), values.get("task", "sft"))
    classes = {type(m).__name__ for m in model.modules()}
    missing = [c for c in str(wrap).split(",") if c.strip() not in classes]
    if missing:
        raise ConfigError(f"{path}: fsdp_transformer_layer_cls_to_wrap names {missing}, which "
                          f"{values['model_name_or_path']} does not have; its layers are "
                          f"{layer_class(model).split(',')}. Set it to null to let the toolkit take the model's layer "
                          "class.")  # fmt: skip


def check_parallelism_values(section: dict, path: Path) -> None:
    """The sizes and backends of a `parallelism_config`, as accelerate's own ParallelismConfig validates them in
    every rank after launch (a size of 0, a backend it does not have, cp with sp): here, in one line, first."""
    from accelerate.parallelism_config import ParallelismConfig

    names = {f"{axis}_size" for axis in ("dp_replicate", "dp_shard", "tp", "cp", "sp")} | {"cp_backend", "sp_backend"}
    values = {key.removeprefix("parallelism_config_"): value for key, value in section.items()}
    try:  # tensor parallelism's node replicas reach accelerate as one dp_shard axis (models/parallel.py)
        if (view := accelerator_parallelism(config_mesh(section))) is not None:
            values.update(dp_replicate_size=view.dp_replicate_size, dp_shard_size=view.dp_shard_size)
    except (ValueError, TypeError):
        pass  # a size that is not a number: ParallelismConfig's own message below
    try:
        ParallelismConfig(**{k: v for k, v in values.items() if k in names})
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{path}: parallelism_config: {str(error).splitlines()[0]}.") from None


def check_mesh(config: dict, path: Path, recipe: str | None) -> None:
    """A `parallelism_config` whose sizes do not cover the processes fails inside accelerate, after the weights
    load; a split without its engine too; a tensor-parallel size the recipe's model cannot split, inside
    transformers."""
    check_parallelism_values(config.get("parallelism_config") or {}, path)
    mesh = config_mesh(config.get("parallelism_config"))
    if not mesh:
        return
    processes = int(config.get("num_processes", 1))
    fix = "make the parallelism_config sizes multiply to num_processes" + (" (or divide it)" if "sp" in mesh else "")
    try:
        fsdp_version = int((config.get("fsdp_config") or {}).get("fsdp_version", 1))
        check_mesh_engine(mesh, config.get("distributed_type", "NO"), fsdp_version)
        check_mesh_size(mesh, processes, f"{fix}.")
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    schedule = (config.get("parallelism_config") or {}).get("parallelism_config_pp_schedule", PIPELINE_SCHEDULES[0])
    try:
        check_schedule(schedule)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    if recipe is None or not {"tp", "cp", "sp", "pp", "ep"} & set(mesh):
        return
    values = load_recipe(recipe)
    try:
        check_split_task(mesh, values.get("task", "sft"))
        check_pipeline_task(mesh, values.get("task", "sft"), load_in_4bit=bool(values.get("load_in_4bit")),
                            schedule=schedule, fp16=bool(values.get("fp16")))  # fmt: skip
    except ConfigError as error:
        raise ConfigError(f"{path} with {recipe}: {error}") from None
    try:
        config = model_config(values["model_name_or_path"])
    except ConfigError:
        return  # a model another run writes (the DPO recipes' SFT output): checked when the run loads it
    try:
        check_tensor_parallel(config, mesh, processes, lora_targets=recipe_lora_targets(values),
                              task=values.get("task", "sft"))  # fmt: skip
        check_expert_parallel(config, mesh, processes, bool(values.get("use_lora")))
    except ConfigError as error:
        raise ConfigError(f"{path} with {recipe}: {error}") from None
    check_sequence_heads(config, mesh.get("sp", 1))
    try:
        check_pipeline(config, mesh, values.get("task", "sft"), world_size=processes,
                       load_in_4bit=bool(values.get("load_in_4bit")), schedule=schedule, fp16=bool(values.get("fp16")),
                       micro_batches=values.get("gradient_accumulation_steps", 1))  # fmt: skip
    except ConfigError as error:
        raise ConfigError(f"{path} with {recipe}: {error}") from None


def check(config_file: str | Path, recipe: str | None = None, here: bool = True) -> str:
    """All checks of one strategy file (and, given a recipe, of the pair); returns a one-line summary. Not `here`
    (a manifest for a cluster): this machine's GPU is not the one the run gets."""
    path = Path(config_file)
    recipe = recipe_name(recipe) if recipe is not None else None  # recipes/bert.py, as the launch names it
    if recipe is not None and not is_recipe(recipe):
        raise ConfigError(f"No recipe '{recipe}' in recipes/. Known: {', '.join(recipe_names())}.")
    config = read_yaml(path)
    top, flags = known_keys()
    hints, flag_types = typing.get_type_hints(ClusterConfig), launch_flag_types()
    for key, value in config.items():
        if key not in top:
            raise ConfigError(f"Unknown key '{key}' in {path}.{suggest(key, top)}")
        check_value(key, value, hints.get(key), path)
    for section in SECTIONS:
        values = config.get(section) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{section} in {path} must be a mapping of settings, got {values!r}.")
        for key, value in values.items():
            # accelerate reads fp8_config's keys as --fp8_<key> flags
            flag = f"fp8_{key}" if section == "fp8_config" and not key.startswith("fp8") else key
            if flag not in flags:
                known = {f.removeprefix("fp8_") for f in flags if f.startswith("fp8_")} if flag != key else flags
                raise ConfigError(f"Unknown key '{key}' under {section} in {path}.{suggest(key, known)}")
            check_value(flag, value, flag_types.get(flag), path, section)
    kind = config.get("distributed_type")
    from accelerate.utils import DistributedType

    if kind not in {t.value for t in DistributedType}:
        raise ConfigError(f"{path}: distributed_type '{kind}' is not one of accelerate's: NO, MULTI_GPU, "
                          "MULTI_CPU, FSDP, DEEPSPEED, ...")  # fmt: skip
    if kind == "FSDP" and config.get("deepspeed_config"):
        raise ConfigError(f"{path} is an FSDP config with a deepspeed_config section: one engine per run, and "
                          "accelerate would silently ignore DeepSpeed's. Remove the section, or use a ZeRO config "
                          "(accelerate_configs/zero3.yaml).")  # fmt: skip
    if kind == "DEEPSPEED" and config.get("fsdp_config"):
        raise ConfigError(f"{path} is a DeepSpeed config with an fsdp_config section: one engine per run. Remove "
                          "the section, or use an FSDP config (accelerate_configs/fsdp2.yaml).")  # fmt: skip
    summary = f"{path.name}: {kind}"
    if kind == "DEEPSPEED":
        json_path = deepspeed_file(config, path)
        zero = check_deepspeed_json(json_path).get("zero_optimization", {})
        check_offload_builds(json_path, zero)
        summary += f", ZeRO-{zero.get('stage', 0)} ({json_path.name})"
    check_mesh(config, path, recipe)
    if str(config.get("mixed_precision")).lower() == "fp8":  # before accelerate's launcher fails on it
        qlora = recipe is not None and bool(load_recipe(recipe).get("load_in_4bit"))
        fsdp = config.get("fsdp_config") or {}
        capability = cuda_capability() if here else FP8_CAPABILITY
        check_fp8((config.get("fp8_config") or {}).get("backend"), qlora, capability,
                  kind if kind in ("FSDP", "DEEPSPEED") else "replicated",
                  str(fsdp.get("fsdp_cpu_ram_efficient_loading")).lower() == "true")  # fmt: skip
        summary += ", FP8"
    if recipe is not None:
        check_wrap_class(config, path, recipe)
        if load_recipe(recipe).get("load_in_4bit"):
            tensor = "tp" in config_mesh(config.get("parallelism_config"))
            check_4bit_engine("tensor parallel" if tensor else kind if kind in ("FSDP", "DEEPSPEED") else "replicated")
        summary += f", recipe {recipe}"
    return summary + ": ok"


@command
def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit check", description=description(__doc__))
    parser.add_argument("config_file", help="an accelerate config, e.g. accelerate_configs/zero3.yaml")
    parser.add_argument("recipe", nargs="?", help="a recipe name: also checks the pair")
    args = parser.parse_args(argv)
    print(check(args.config_file, args.recipe))
    return 0
