"""What a strategy does to memory, read from a strategy file or from a running job: one reader for both.

`Layout.from_file` reads `accelerate_configs/*.yaml` (and the DeepSpeed JSON it names) for the planner;
`Layout.from_accelerator` reads what accelerate set up in a launched job (the script never sees the file) for
the run header, the run's own plan and its reports. Both end in the same two constructors, `zero` and `fsdp`,
so a setting means the same thing whichever way it was read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from ..project import project_path
from ..settings.mesh import PIPELINE_SCHEDULES, config_mesh, launch_mesh, pipeline_schedule


@dataclass(frozen=True)
class Layout:
    """Which states are split over how many ranks, what is offloaded; `sharding` says it in words."""

    name: str
    engine: str  # "torch" (single, DDP, FSDP) or "deepspeed"
    shard_params: bool = False  # weights split at rest (FSDP, ZeRO-3)
    shard_grads: bool = False
    shard_optimizer: bool = False
    gathered_through_backward: bool = False  # FSDP SHARD_GRAD_OP: a gathered layer stays until its backward
    offload_params: bool = False
    offload_optimizer: bool = False
    hybrid: bool = False  # shard inside a node, replicate across nodes
    ddp: bool = False
    ram_efficient_loading: bool = False  # FSDP: only rank 0 reads the checkpoint, the others receive it
    tensor_parallel: int = 1  # ranks each layer's weights are split over (transformers' TP plan)
    tensor_shards: int = 1  # under TP: the data-parallel ranks FSDP2 shards each slice over
    sequence_split: int = 1  # ranks each row's sequence is split over (cp: torch's ring attention; sp: Ulysses)
    fp8: bool = False  # mixed_precision fp8: float8 GEMMs; memory as in bf16 (estimate.py's FP8_SPEEDUP: time)
    pipeline_stages: int = 1  # the layers cut into this many stages, one a rank (0: sized for the job)
    pipeline_schedule: str = ""  # 1F1B or GPipe: how many micro-batches' activations a stage holds
    expert_parallel: int = 1  # ranks a mixture of experts' experts are split over, whole (0: sized for the job)
    sharding: str = ""  # as printed in the run header: "ZeRO-3 offload_param=cpu", "FSDP2 FULL_SHARD", ...

    # ------------------------------------------------------------------------------------- constructors
    @classmethod
    def zero(cls, name: str, zero: dict) -> Layout:
        """A DeepSpeed ZeRO layout from the `zero_optimization` section of its config."""
        stage = zero.get("stage", 0)
        devices = {k: (zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
        offload = {k: device not in ("none", None) for k, device in devices.items()}
        sharding = f"ZeRO-{stage}" + "".join(f" {k}={devices[k]}" for k in devices if offload[k])
        return cls(name, "deepspeed", shard_params=stage >= 3, shard_grads=stage >= 2, shard_optimizer=stage >= 1,
                   offload_params=offload["offload_param"], offload_optimizer=offload["offload_optimizer"],
                   sharding=sharding)  # fmt: skip

    @classmethod
    def fsdp(cls, name: str, version: int, mode: str, offload: bool, ram_efficient: bool,
             mesh: tuple[int, int] | None = None) -> Layout:  # fmt: skip
        """An FSDP layout. `mode`: FULL_SHARD or SHARD_GRAD_OP (FSDP2's reshard_after_forward true / false);
        `mesh`: (replicas, shards) of a HYBRID_SHARD job, (0, 0) where the sizes are set at launch."""
        sharding = f"FSDP{version} {mode}"
        if mesh is not None:
            sharding = f"FSDP{version} HYBRID_SHARD" + (f" ({mesh[0]} replicas x {mesh[1]} shards)" if mesh[0] else "")
        return cls(name, "torch", shard_params=True, shard_grads=True, shard_optimizer=True,
                   gathered_through_backward=mode == "SHARD_GRAD_OP", offload_params=offload,
                   offload_optimizer=offload, hybrid=mesh is not None, ram_efficient_loading=ram_efficient,
                   sharding=sharding + (" offload_params=cpu" if offload else ""))  # fmt: skip

    @classmethod
    def tensor(cls, name: str, tp: int, shards: int = 1) -> Layout:
        """Tensor parallelism: the model sharded at load by transformers over `tp` ranks (0: set at launch), each
        holding its slice of every split weight, with its gradients and optimizer states; with `shards` > 1,
        those slices FSDP2-sharded further over the data-parallel ranks (transformers' fsdp_size)."""
        sharding = f"tensor parallel, each layer split over {tp} ranks" if tp else "tensor parallel"
        if shards > 1:
            sharding = f"FSDP2 x {sharding}, sharded over {shards}"
        sharded = shards > 1
        return cls(name, "torch", shard_params=sharded, shard_grads=sharded, shard_optimizer=sharded,
                   tensor_parallel=max(tp, 1), tensor_shards=max(shards, 1), sharding=sharding)  # fmt: skip

    @classmethod
    def pipeline(cls, name: str, stages: int, schedule: str, replicas: int = 1) -> Layout:
        """Pipeline stages (torch's pipelining engine, training/pipeline.py): each rank holds its stage's weights,
        gradients and optimizer states, whole; `replicas` pipelines sum their gradients (DDP's buckets). The schedule
        is not in `sharding`: the one a step runs depends on its micro-batches (the run header's schedule line)."""
        sharding = f"pipeline, {stages} stages" + (f" x {replicas} replicas" if replicas > 1 else "")
        return cls(name, "torch", ddp=replicas > 1, pipeline_stages=stages, pipeline_schedule=schedule,
                   sharding=sharding)  # fmt: skip

    @classmethod
    def experts(cls, name: str, ep: int, shards: int) -> Layout:
        """Expert parallelism (transformers' DistributedConfig(ep_size, fsdp_size)): each of `ep` ranks holds
        1/ep of every layer's experts whole (FSDP2-sharded further over shards / ep ranks where there are more
        shards), the rest of the model FSDP2-sharded over the `shards` data-parallel ranks: every state is 1/shards
        a rank, as under FSDP2, but a layer's experts are not gathered to compute it: its tokens go to them
        (all-to-all). `ep` 0: set at launch."""
        sharding = "FSDP2 x expert parallel" + (f", experts split over {ep} ranks" if ep else "")
        sharding += f", sharded over {shards}" if shards else ""
        return cls(name, "torch", shard_params=True, shard_grads=True, shard_optimizer=True,
                   expert_parallel=ep, sharding=sharding)  # fmt: skip

    @property
    def mesh_devices(self) -> int:
        """The devices a tensor-parallel mesh covers (its product)."""
        return self.tensor_parallel * self.tensor_shards

    @classmethod
    def replicated(cls, name: str, processes: int) -> Layout:
        ddp = processes > 1
        return cls(name, "torch", ddp=ddp, sharding="none (replicated, DDP)" if ddp else "none (single process)")

    # ------------------------------------------------------------------------------------------ readers
    @classmethod
    def from_file(cls, path: str | Path) -> Layout:
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
    def from_accelerator(cls, accelerator) -> Layout:
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
