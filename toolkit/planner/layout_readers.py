"""The two readers of a strategy's Layout (layout.py): from an accelerate config file (the planner) and from what
accelerate set up in a running job (the run's header, plan and reports). Both end in Layout's constructors, so a
setting means the same thing whichever way it was read.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Self

import yaml

from ..project import project_path
from ..settings.mesh import PIPELINE_SCHEDULES, config_mesh, launch_mesh, pipeline_schedule


class LayoutReaders:
    """Layout.from_file and Layout.from_accelerator (cls: Layout)."""

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """The layout an accelerate config file asks for."""
        path = Path(path)
        config = yaml.safe_load(path.read_text())
        kind, mesh = config["distributed_type"], config_mesh(config.get("parallelism_config"))
        axes = {"sequence_split": mesh.get("cp", 1) * mesh.get("sp", 1),
                 "fp8": str(config.get("mixed_precision")).lower() == "fp8"}  # fmt: skip
        if kind == "DEEPSPEED":
            ds_file = project_path(config["deepspeed_config"]["deepspeed_config_file"])
            return replace(cls.zero(path.stem, json.loads(ds_file.read_text()).get("zero_optimization", {})), **axes)
        if kind == "FSDP":
            fsdp = config.get("fsdp_config", {})
            version = fsdp.get("fsdp_version", 1)
            if version == 2:
                keep = fsdp.get("fsdp_reshard_after_forward", True) is False
            else:
                keep = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper() == "SHARD_GRAD_OP"
            raw = config.get("parallelism_config") or {}  # HYBRID_SHARD: replicas x shards (0: set at launch)
            sizes = None
            if "parallelism_config_dp_replicate_size" in raw:
                sizes = (raw["parallelism_config_dp_replicate_size"], raw.get("parallelism_config_dp_shard_size", 0))
            layout = cls.fsdp(path.stem, version, "SHARD_GRAD_OP" if keep else "FULL_SHARD",
                              bool(fsdp.get("fsdp_offload_params", False)),
                              bool(fsdp.get("fsdp_cpu_ram_efficient_loading")), sizes)  # fmt: skip
            return replace(layout, **axes)
        if "ep" in mesh:
            return cls.experts(path.stem, mesh["ep"], mesh.get("dp_shard", 1))
        if "tp" in mesh:
            return cls.tensor(path.stem, mesh["tp"], mesh.get("dp_shard", 1))
        if "pp" in mesh:
            schedule = config["parallelism_config"].get("parallelism_config_pp_schedule", PIPELINE_SCHEDULES[0])
            return cls.pipeline(path.stem, mesh["pp"], schedule, mesh.get("dp_replicate", 1))
        return cls.replicated(path.stem, config.get("num_processes", 1) if kind != "NO" else 1)

    @classmethod
    def from_accelerator(cls, accelerator) -> Self:
        """The layout of a running job, from what accelerate set up."""
        from accelerate.utils import DistributedType

        kind, state = accelerator.distributed_type, accelerator.state
        mesh = accelerator.parallelism_config
        axes = {"sequence_split": mesh.cp_size * mesh.sp_size if mesh is not None else 1,
                 "fp8": str(accelerator.mixed_precision) == "fp8"}  # fmt: skip
        if kind == DistributedType.DEEPSPEED:
            zero = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
            return replace(cls.zero("deepspeed", zero), **axes)
        if kind == DistributedType.FSDP:
            plugin = state.fsdp_plugin
            if plugin.fsdp_version == 2:  # FSDP2 expresses FULL_SHARD / SHARD_GRAD_OP as reshard_after_forward
                mode = "FULL_SHARD" if plugin.reshard_after_forward else "SHARD_GRAD_OP"
            else:
                mode = getattr(plugin.sharding_strategy, "name", str(plugin.sharding_strategy))
            offload = plugin.cpu_offload  # FSDP1: CPUOffload(offload_params); FSDP2: an OffloadPolicy subclass
            offloaded = getattr(offload, "offload_params", False) or type(offload).__name__ == "CPUOffloadPolicy"
            hybrid = mesh is not None and mesh.dp_replicate_enabled and mesh.dp_shard_enabled  # FSDP2's HSDP
            layout = cls.fsdp("fsdp", plugin.fsdp_version, mode, bool(offloaded),
                              bool(plugin.cpu_ram_efficient_loading),
                              (mesh.dp_replicate_size, mesh.dp_shard_size) if hybrid else None)  # fmt: skip
            return replace(layout, **axes)
        if (ep := launch_mesh().get("ep", 1)) > 1:  # the toolkit's axis: accelerate's mesh is dp_shard alone
            return cls.experts("expert parallel", ep, launch_mesh().get("dp_shard", 1))
        if mesh is not None and mesh.tp_enabled:  # the launch's own mesh: accelerate's counts replicas as shards
            return cls.tensor(kind.value.lower(), mesh.tp_size, launch_mesh().get("dp_shard", 1))
        if (stages := launch_mesh().get("pp", 1)) > 1:  # the toolkit's axis: accelerate's mesh is left off
            return cls.pipeline("pipeline", stages, pipeline_schedule(), launch_mesh().get("dp_replicate", 1))
        return cls.replicated(kind.value.lower(), accelerator.num_processes)
