"""What a strategy does to memory, read from a strategy file or from a running job: one reader for both.

`Layout.from_file` reads `accelerate_configs/*.yaml` (and the DeepSpeed JSON it names) for the planner;
`Layout.from_accelerator` reads what accelerate set up in a launched job (the script never sees the file) for
the run header, the run's own plan and its reports (layout_readers.py). Both end in the same constructors, `zero`
and `fsdp` among them, so a setting means the same thing whichever way it was read.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout_readers import LayoutReaders


@dataclass(frozen=True)
class Layout(LayoutReaders):
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
