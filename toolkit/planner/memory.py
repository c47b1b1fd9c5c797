"""Memory per device and per node, by component, for a model shape under a strategy layout and a workload.

Each formula says where it comes from; tests check them against accelerate's and DeepSpeed's own estimators,
the tensors autograd saves, malloc's live bytes, and the bytes each rank really held in the strategy matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..metrics.memory import GIB
from .layout import Layout
from .shape import Shape
from .step_memory import activation_bytes, generation_bytes, layer_activation_bytes, logits_bytes, lora_dropout_bytes
from .workload import NF4_BYTES, OPTIMIZER_STATE_BYTES, PRECISIONS, Workload

MODEL_STATES = ("parameters", "gradients", "fp32_gradients", "master_weights", "optimizer_states", "gathered_buffers")


@dataclass
class Memory:
    """Bytes per device (GPU) and per node (host RAM), by component."""

    device: dict[str, int] = field(default_factory=dict)
    host_per_node: dict[str, int] = field(default_factory=dict)
    host_loading: int = 0  # host RAM on the busiest node while the pretrained weights load (before training)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def model_states(self) -> int:
        """Device bytes of weights, gradients, optimizer states and the gathered copies of sharded weights:
        everything but activations and the CUDA context (what DeepSpeed's and accelerate's estimators cover)."""
        return sum(v for k, v in self.device.items() if k in MODEL_STATES)

    @property
    def host_total(self) -> int:
        return sum(self.host_per_node.values())


def model_state_bytes(
    shape: Shape,
    layout: Layout,
    precision: str,
    optimizer: str,
    masters: str = "none",
    weights_4bit: bool = False,
) -> dict[str, float]:
    """Bytes of the persistent states before sharding: {component: bytes}. `masters` of 16-bit trainable weights:
    "upcast", the weights themselves in fp32 (accelerate's FSDP under mixed precision, LoRA adapters, fp16 AMP);
    "optimizer", fp32 copies held by the optimizer beside the bf16 weights and gradients, and at the step fp32
    copies of the gradients in place of the bf16 ones (2 more bytes each; training/precision.py). `weights_4bit`:
    the frozen linear weights in NF4 (QLoRA), the other frozen ones as loaded."""  # fmt: skip
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got '{precision}'.")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got '{optimizer}'.")
    P, T = shape.total, shape.trainable
    if layout.engine == "deepspeed":
        weight = 4 if precision == "fp32" else 2
        return {
            "parameters": weight * P,
            "gradients": 0 if layout.shard_params else weight * T,  # ZeRO-3 reduces straight into fp32 ones
            "fp32_gradients": 4 * T,  # the optimizer partition's
            "master_weights": 4 * T,
            "optimizer_states": OPTIMIZER_STATE_BYTES[optimizer](4) * T,
        }
    weight = 2 if precision == "bf16" else 4
    trained = 4 if masters == "upcast" else weight
    quantized = shape.quantizable if weights_4bit else 0
    held = masters == "optimizer"
    return {
        "parameters": weight * (P - T - quantized) + NF4_BYTES * quantized + trained * T,
        "gradients": trained * T,
        "fp32_gradients": (4 - trained) * T if held else 0,
        "master_weights": 4 * T if held else 0,
        "optimizer_states": OPTIMIZER_STATE_BYTES[optimizer](4 if held else trained) * T,
    }


def masters_of(layout: Layout, work: Workload) -> str:
    """Who keeps fp32 masters of 16-bit trainable weights (model_state_bytes' `masters`): accelerate's FSDP by
    upcasting them at preparation (one dtype per unit); fp32 trainable weights are their own; the toolkit's
    optimizer under single_gpu/DDP/tensor parallelism (transformers' FSDP2 under TP keeps bf16 shards)."""
    if layout.engine != "torch" or work.precision != "bf16" or not work.master_weights:
        return "none"
    engine_upcasts = layout.shard_params and layout.tensor_parallel == 1
    return "upcast" if engine_upcasts or work.trainable_fp32 else "optimizer"


def gathered_buffers(shape: Shape, layout: Layout, work: Workload, shards: int, states: dict) -> int | None:
    """The temporary buffers a sharded engine gathers into (DDP: its gradient buckets); None for none."""
    compute = 4 if work.precision == "fp32" else 2
    # Temporary buffers: the gathered 16-bit unit. DeepSpeed counts two gathered copies of the largest module
    # ("largest_layer_memory = 4 * largest_layer_params"); FSDP gathers one transformer layer, prefetching the
    # next (two units in the compute dtype), or keeps every layer gathered through backward under SHARD_GRAD_OP.
    if layout.engine == "deepspeed" and layout.shard_params:
        return 2 * compute * shape.largest_module
    elif layout.shard_params and layout.expert_parallel > 1:
        # A layer's experts stay on their ranks (its tokens go to them), gathered only over the ranks that shard
        # the same experts (transformers' efsdp: shards / ep), where there are several: the rest of the layer is.
        kept = shape.unit_experts // layout.expert_parallel if shards > layout.expert_parallel else 0
        unit = max(shape.largest_unit - shape.unit_experts + kept, shape.input_params)
        return compute * 2 * unit
    elif layout.shard_params:
        gathered = shape.total if layout.gathered_through_backward else 2 * shape.largest_unit
        return compute * gathered // layout.tensor_parallel  # a TP slice is gathered
    elif layout.ddp:
        return int(states["gradients"])  # DDP's gradient buckets: a second copy
    return None


def step_terms(mem: Memory, shape: Shape, layout: Layout, work: Workload, shards: int) -> None:
    """What one step adds on the device (step_memory.py's terms), into `mem`: activations, the recomputed layer,
    the logits or the fused head, an image tower's, and GRPO's sampling where it holds more than the step."""
    compute = 4 if work.precision == "fp32" else 2
    # Context and sequence parallelism: each rank holds 1/split of every row's tokens through the layers and the
    # loss (Ulysses' attention: the whole row for 1/split of the heads, the same bytes), so every term below,
    # linear in the tokens under sdpa and flash attention (the kernels a split runs), is taken at s / split.
    sequences = replace(work, micro_batch=work.micro_batch * work.sequences_per_sample,
                        seq_length=work.seq_length // layout.sequence_split)  # fmt: skip
    mem.device["activations"] = activation_bytes(shape, sequences)
    mem.device["lora_dropout"] = lora_dropout_bytes(shape, sequences)
    mem.device["recomputed_layer"] = layer_activation_bytes(shape, sequences) if work.activation_checkpointing else 0
    mem.device["fused_head" if work.fused_head else "logits"] = logits_bytes(shape, sequences)
    if shape.image is not None:  # the tower's and projector's, per image (vision.py); alive at backward's start
        images = work.micro_batch * shape.image.per_sample
        mem.device["image_activations"] = int(images * shape.image.saved(work.activation_checkpointing))
        if work.activation_checkpointing:  # a trained tower's layer, recomputed once the decoder's gradients exist
            tower = int(images * shape.image.layer_bytes)
            mem.device["recomputed_layer"] = max(mem.device["recomputed_layer"], tower)
    if work.generates:  # the peak is the larger phase's: sampling's, where it holds more than the step
        step = sum(mem.device.get(k, 0) for k in STEP_ONLY)
        step += mem.device["gradients"] if layout.engine == "torch" else 0  # set to None between steps
        sampling = generation_bytes(shape, work)
        if layout.engine == "deepspeed" and layout.shard_params:  # TRL's ds3_gather_for_generation: every weight
            step += mem.device["gathered_buffers"]
            sampling += compute * shape.total * (1 - 1 / shards) // layout.tensor_parallel
        mem.device["generation"] = int(max(0, sampling - step))


def plan_memory(shape: Shape, layout: Layout, work: Workload, gpus_per_node: int, nodes: int = 1) -> Memory:
    if layout.pipeline_stages > 1:
        return plan_pipeline(shape, layout, work, gpus_per_node, nodes)
    world = gpus_per_node * nodes
    shards = gpus_per_node if layout.hybrid else world  # HYBRID_SHARD splits over one node's devices
    shards //= layout.tensor_parallel  # FSDP2 x TP: the data-parallel ranks shard what TP split
    states = model_state_bytes(shape, layout, work.precision, work.optimizer, masters_of(layout, work),
                               work.weights_4bit)  # fmt: skip
    weight = 2 if work.precision == "bf16" else 4  # the weights' dtype as loaded
    split = {
        "parameters": layout.shard_params,
        "gradients": layout.shard_grads,
        "fp32_gradients": layout.shard_optimizer,
        "master_weights": layout.shard_optimizer,
        "optimizer_states": layout.shard_optimizer,
    }
    per_rank = {k: v / shards if split[k] else v for k, v in states.items()}
    # Tensor parallelism splits the weights themselves, and with them their gradients and optimizer states (the
    # norms, a few KB a layer, stay whole on every rank: left out).
    per_rank = {k: v / layout.tensor_parallel for k, v in per_rank.items()}
    # Offloaded optimizer: its states, master weights and fp32 gradients live in host RAM (ZeRO-Offload keeps
    # only the 16-bit parameters and gradient buckets on the device); FSDP's offload moves parameters too.
    on_host = {"parameters": layout.offload_params}
    for k in ("fp32_gradients", "master_weights", "optimizer_states"):
        on_host[k] = layout.offload_optimizer
    if layout.engine == "deepspeed" and layout.offload_optimizer:
        per_rank["gradients"] = 0  # reduced in buckets straight into the host partition
    if layout.engine == "torch" and layout.offload_params:
        on_host["gradients"] = True  # FSDP's CPUOffloadPolicy: gradients too, the optimizer steps on the CPU
    mem = Memory()
    for k, v in per_rank.items():
        if on_host.get(k):
            mem.host_per_node[k] = int(v * gpus_per_node)  # every rank of the node offloads its share
            mem.device[k] = 0
        else:
            mem.device[k] = int(v)
    if (buffer := gathered_buffers(shape, layout, work, shards, states)) is not None:
        mem.device["gathered_buffers"] = buffer
    # Loading: every rank reads the whole checkpoint into host RAM, except under RAM-efficient loading (rank 0
    # alone; the others build on the meta device) and ZeRO-3 (each rank keeps only its partition). A copy is
    # the parameters as they sit on the host before sharding: under FSDP mixed precision accelerate upcasts the
    # trainable ones to fp32 there, so a bf16 checkpoint takes twice its size (measured: bench/ram_loading.py);
    # the toolkit upcasts a replicated model's on its device, after loading.
    if layout.ram_efficient_loading or layout.tensor_parallel > 1 or layout.expert_parallel > 1:
        # TP and EP (models transformers shards as they load): each rank reads only its own slices
        copies = 1
    elif layout.engine == "deepspeed" and layout.shard_params:
        copies = gpus_per_node / world
    else:
        copies = gpus_per_node
    loaded = states if layout.shard_params else model_state_bytes(shape, layout, work.precision, work.optimizer,
                                                                  weights_4bit=work.weights_4bit)  # fmt: skip
    mem.host_loading = int(copies * loaded["parameters"])
    # A frozen reference (DPO) in the weights' dtype, sharded as the policy's parameters are (TRL: ZeRO-3
    # partitions it, FSDP shards it; DDP and ZeRO-1/2 hold it whole, as stage 0).
    if work.reference_weights:
        mem.device["reference_model"] = int(weight * shape.total / (shards if layout.shard_params else 1))
    # GRPO's reward models, frozen, in the dtype they were saved in, placed by TRL as the reference is.
    if work.reward_model_bytes:
        mem.device["reward_models"] = int(work.reward_model_bytes / (shards if layout.shard_params else 1))
    if work.teacher is not None:  # distill's, in the weights' dtype, placed as a reference is
        mem.device["teacher_model"] = int(weight * work.teacher.total / (shards if layout.shard_params else 1))
    step_terms(mem, shape, layout, work, shards)
    mem.device["cuda_context"] = int(work.cuda_context_gib * GIB)
    return mem


# What a training step holds only while it runs (the sampling phase before it holds none of it)
STEP_ONLY = ("activations", "lora_dropout", "recomputed_layer", "fused_head", "logits", "image_activations")


def plan_pipeline(shape: Shape, layout: Layout, work: Workload, gpus_per_node: int, nodes: int = 1) -> Memory:
    """Pipeline stages: the busiest stage's device (the first holds the most micro-batches, the last the head, its
    loss and the logits); every rank loads the whole checkpoint before it keeps its stage (models/loading.py)."""
    stages = layout.pipeline_stages
    plans = [stage_memory(shape, layout, work, stage, gpus_per_node, nodes) for stage in (0, stages - 1)]
    busiest = max(plans, key=lambda m: m.device_total)
    plain = replace(layout, pipeline_stages=1)
    busiest.host_loading = plan_memory(shape, plain, work, gpus_per_node, nodes).host_loading
    return busiest


def stage_memory(shape: Shape, layout: Layout, work: Workload, stage: int, gpus_per_node: int,
                 nodes: int = 1) -> Memory:  # fmt: skip
    """Pipeline stage `stage`'s device, planned as a replicated model of the stage's part (its weights, gradients,
    optimizer states and, with replicas, DDP's buckets; Shape.stage) whose activations are those of the
    micro-batches in flight (models/pipeline.py: GPipe all of them, 1F1B up to the stages from this one to the
    last), of its layers and, on the last stage, of the head and loss; one micro-batch's logits at the loss. The
    last stage returns its logits to the schedule's loss: no fused head."""
    from ..models.pipeline import micro_batches_in_flight

    stages, work = layout.pipeline_stages, replace(work, fused_head=False)
    part = shape.stage(stage, stages)
    mem = plan_memory(part, replace(layout, pipeline_stages=1), work, gpus_per_node, nodes)
    in_flight = micro_batches_in_flight(layout.pipeline_schedule, stages, work.micro_batches, stage)
    held = activation_bytes(replace(shape, num_layers=part.num_layers), work)
    if stage != stages - 1:  # no head, loss or logits before the last stage
        held -= activation_bytes(replace(shape, num_layers=0), work)
    mem.device["activations"] = in_flight * held
    mem.device["lora_dropout"] *= in_flight
    return mem
