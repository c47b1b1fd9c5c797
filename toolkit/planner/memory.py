"""Memory per device and per node, by component, for a model shape under a strategy layout and a workload.

Each formula says where it comes from; tests check them against accelerate's and DeepSpeed's own estimators,
the tensors autograd saves, malloc's live bytes, and the bytes each rank really held in the strategy matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..metrics.memory import GIB
from .layout import Layout
from .shape import Shape

# Bytes per parameter of each persistent state, by precision, for the engine's own bookkeeping.
#   torch FSDP (and fp32 trainable weights: LoRA adapters, fp16's automatic mixed precision): the weights are
#     the master copy, fp32 with fp32 gradients, cast per gathered unit (FSDP's MixedPrecisionPolicy) or per op.
#   torch single/DDP/TP with bf16 weights (training/precision.py's MasterWeights): bf16 weights and gradients,
#     fp32 masters held by the optimizer, which steps on fp32 copies of the gradients.
#   DeepSpeed: 16-bit weights, plus an fp32 master copy and fp32 gradients in the optimizer's partition,
#     whatever the precision (DeepSpeed's estimators: "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit +
#     4_params_32bit + 8_optimizer_states_32bit"; deepspeed/runtime/zero/stage_1_and_2.py, stage3.py).
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
OPTIMIZER_STATE_BYTES = {  # per trainable parameter, in the optimizer state dtype
    "adamw": lambda state_bytes: 2 * state_bytes,  # exp_avg and exp_avg_sq
    "adamw_8bit": lambda state_bytes: 2,  # bitsandbytes: two 8-bit states (block-wise scales aside)
    "sgd": lambda state_bytes: 0,  # without momentum
}


@dataclass(frozen=True)
class Workload:
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_length: int = 2048
    activation_checkpointing: bool = False
    flash_attention: bool = True  # sdpa / flash: no s x s attention scores kept for backward
    # CUDA context, cuBLAS/cuDNN workspaces and kernels per process, outside PyTorch's allocator: measured 0.75 GiB
    # (767 MiB: nvidia-smi's used memory minus torch.cuda.memory_reserved after a bf16 matmul, sdpa, backward and
    # fused AdamW) on an H100 with torch 2.11 and CUDA 13; it varies with the driver, CUDA and the GPU.
    cuda_context_gib: float = 0.75
    dropout_mask_bytes: int = 1  # CUDA's fused dropout keeps a bool mask; on CPU it is the activation dtype
    # DPO: a micro-batch's pairs go through the model as 2 sequences each, chosen and rejected in one forward;
    # and without LoRA a frozen reference copy of the weights (with LoRA, the base with the adapter off).
    sequences_per_sample: int = 1
    reference_weights: bool = False
    # GRPO's learned rewards: their weights' bytes (models/meta.py's saved_model_bytes), every reward model whole.
    reward_model_bytes: int = 0
    # The loss scored in tiles by a fused head that never holds the full logits (TRL's chunked log-prob head,
    # which DPO uses): fused_head_bytes instead of the logits.
    fused_head: bool = False
    # QLoRA: the frozen linear weights in 4-bit NF4 with double quantization (bitsandbytes).
    weights_4bit: bool = False
    # 16-bit weights whose trainable ones have fp32 masters under mixed precision: accelerate's FSDP upcasts them
    # at preparation, the toolkit's optimizer holds them under single_gpu/DDP/TP (plan_memory tells which);
    # DeepSpeed keeps its own (its accounting in model_state_bytes).
    master_weights: bool = False
    # The trainable weights are fp32 themselves (peft's LoRA adapters; fp16's automatic mixed precision).
    trainable_fp32: bool = False
    # LoRA's dropout on the adapters' inputs (--lora_dropout): a mask over every adapted input, kept for backward
    lora_dropout: float = 0.0
    # Micro-batches per optimizer step (--gradient_accumulation_steps): under pipeline stages the schedule's, which
    # decide the activations a stage holds and the bubble (models/pipeline.py)
    micro_batches: int = 1
    # GRPO: each optimizer step's rows (micro_batch x micro_batches a device: TRL's steps_per_generation defaults to
    # the accumulation steps) sampled at once, up to seq_length tokens each, before the step trains on them
    generates: bool = False

    @property
    def activation_dtype_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


# Bytes per 4-bit NF4 weight under double quantization (bitsandbytes, Dettmers et al. 2023, QLoRA, section 3): two
# weights a byte, an 8-bit scale per block of 64, and an fp32 scale of those scales per 256 blocks.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)

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


def layer_activation_bytes(shape: Shape, work: Workload) -> int:
    """Bytes one transformer layer keeps for its backward: measured (shape.activations) where it could be, else
    tensor by tensor (e: bytes of an activation; t = s x b
    tokens; every tensor counted once, though several ops save it):
      each of the 2 norms: its input (RMSNorm: an fp32 copy, plus the normalized tensor) and fp32 statistics;
      the inputs of the linear layers: q/k/v's and the MLP's (h wide), o's (q_size), the down projection's (i);
      the MLP's activation: its input (i wide), and under SwiGLU also the gate's activated output and up's output;
      attention, fused (sdpa/flash): q, k, v (q_size, kv_size, kv_size wide), an fp32 log-sum-exp per head;
        eager: q, k, v (k and v repeated to every head), the softmax output (a x s x s; Llama's is fp32 then
        cast), and with attention dropout its mask and the dropped probabilities;
      with hidden dropout: the masks of the two residual-branch dropouts.
    For a GPT/BERT layer (i = 4h, LayerNorm, GELU, dropout with bool masks, 16-bit) this is Korthikanti et al.
    2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1): s*b*h*(34 + 5*a*s/h), plus
    the norms' statistics; tests also check it against the tensors PyTorch really saves."""
    if shape.activations is not None:
        return shape.activations.layer_bytes(work.micro_batch, work.seq_length)
    s, b, e = work.seq_length, work.micro_batch, work.activation_dtype_bytes
    t, h, i, a, q = s * b, shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.q_size
    norm = ((4 + e) if shape.rms_norm else e) * t * h + (4 if shape.rms_norm else 8) * t
    total = 2 * norm + e * t * (2 * h + q + i)
    total += e * t * i * (3 if shape.gated_mlp else 1)
    if shape.hidden_dropout:
        total += 2 * work.dropout_mask_bytes * t * h
    if work.flash_attention:
        total += e * t * (q + 2 * shape.kv_size) + 4 * t * a
    else:
        scores = a * s * s * b
        total += 3 * e * t * q + scores * (4 + e if shape.gated_mlp and e != 4 else e)
        if shape.attention_dropout:
            total += scores * (work.dropout_mask_bytes + e)
    return int(total)


def activation_bytes(shape: Shape, work: Workload) -> int:
    """Activations kept for backward at the end of the forward pass, per device: measured on the architecture
    (shape.activations, planner/activations.py) where it could be, else this formula. Each layer keeps
    layer_activation_bytes, or with activation checkpointing only its input (e*t*h; the layer is recomputed
    during its backward: the `recomputed_layer` component). Outside the layers: each extra norm (input,
    statistics, and its output or, followed by dropout, the mask), the head's input, and for a language model
    the fp32 log-probabilities the cross-entropy keeps (t x vocabulary)."""
    s, b, e = work.seq_length, work.micro_batch, work.activation_dtype_bytes
    t, h = s * b, shape.hidden_size
    layers = shape.num_layers * (e * t * h if work.activation_checkpointing else layer_activation_bytes(shape, work))
    if shape.activations is not None:  # measured: outside the layers as the architecture really keeps it
        return int(layers + shape.activations.outside_bytes(b, s))
    norm = ((4 + e) if shape.rms_norm else e) * t * h + (4 if shape.rms_norm else 8) * t
    follower = work.dropout_mask_bytes if shape.hidden_dropout else e
    extra = shape.extra_norms * (norm + follower * t * h)
    if shape.language_model and work.fused_head:
        # targets (int64), log-sum-exp and entropy (fp32); its input is a copy of the final norm's output, which
        # then nothing else keeps: counted with the norm
        head = 16 * t
    elif shape.language_model:
        head = 4 * t * shape.vocab_size  # the lm_head's input is the final norm's output, counted there
    else:
        head = e * t * h  # a classifier keeps the last hidden states alive (the pooler's slice of them)
    return int(layers + extra + head)


def logits_bytes(shape: Shape, work: Workload) -> int:
    """A language model's logits at the loss (t x vocabulary each; the largest buffers at long sequence): the
    logits in the activation dtype, which the model's output keeps, and at the start of backward two fp32
    gradients alive together, nll_loss's of the log-probabilities and log_softmax's of the logits (the fp32
    log-probabilities themselves are in activation_bytes). Measured: one step of SmolLM2-135M on an H100, bf16,
    b=8, s=1024, peaks at 11.74 GiB = states + saved activations + bf16 logits + 2 x 1.5 GiB; tests check it
    on CPU (test_planner.py::test_step_peak_matches_live_memory)."""
    if not shape.language_model:
        return 0
    if work.fused_head:
        return fused_head_bytes(shape, work)
    return work.seq_length * work.micro_batch * shape.vocab_size * (work.activation_dtype_bytes + 2 * 4)


# TRL's ChunkedLogProbFunction (trl/kernels/chunked_logprob.py) projects TOKEN_CHUNK_SIZE tokens by
# _CHUNKED_LOGPROB_CHUNK_SIZE vocabulary entries at a time (trl/trainer/utils.py); tests compare with TRL's values.
FUSED_HEAD_TILE = (4096, 32768)


def fused_head_bytes(shape: Shape, work: Workload) -> int:
    """A fused head's share of the backward peak. Its weight's fp32 gradient (vocabulary x hidden; none when the
    head is frozen, as under LoRA) is made at the start of backward and stays: a full copy even where gradients
    are sharded or 16-bit, so counted here beside `gradients`. With it, the larger of: the head's own working
    set (its input's fp32 gradient, t x hidden, and one logits tile in the compute dtype: Triton's kernels work
    in it in place on a GPU; TRL's CPU fallback makes a few fp32 copies), or, without full logits to dwarf it,
    the last layer's MLP backward (two t x intermediate gradients), where a CPU step was measured to peak."""
    t, e = work.seq_length * work.micro_batch, work.activation_dtype_bytes
    tile = min(t, FUSED_HEAD_TILE[0]) * min(shape.vocab_size, FUSED_HEAD_TILE[1]) * e
    weight = 4 * shape.vocab_size * shape.hidden_size if shape.head_trainable else 0
    return weight + max(4 * t * shape.hidden_size + tile, 2 * e * t * shape.intermediate_size)


# A decode step's peak holds about this many rows x vocabulary fp32 tensors beside the KV cache, under transformers
# 5's sampling with the one logits processor the toolkit sets (temperature): the step's logits, their fp32 copy, the
# scaled scores, softmax's probabilities, some of the previous step's still bound. Measured through TRL's
# GRPOTrainer (32 rows, 32,768 entries): 3.5 to 5.0 between runs of
# tests/test_planner.py::test_grpo_step_peak_matches_live_memory; each further processor (top-k, top-p, a
# repetition penalty) adds about one.
SAMPLING_BUFFERS = 4


def generation_bytes(shape: Shape, work: Workload) -> int:
    """GRPO's sampling phase, per device, beside the weights and optimizer states (no gradients alive): the KV cache
    of the step's rows at full length (keys and values, kv_size wide, per attention layer), one layer's keys more
    while the cache grows (DynamicCache concatenates), and the sampling buffers over the vocabulary."""
    rows, e = work.micro_batch * work.micro_batches, work.activation_dtype_bytes
    layers = shape.num_layers if shape.attention_layers is None else shape.attention_layers
    cache = 2 * layers * rows * work.seq_length * shape.kv_size * e
    grown = cache // (2 * layers) if layers else 0
    return int(cache + grown + SAMPLING_BUFFERS * 4 * rows * shape.vocab_size)


def masters_of(layout: Layout, work: Workload) -> str:
    """Who keeps fp32 masters of 16-bit trainable weights (model_state_bytes' `masters`): accelerate's FSDP by
    upcasting them at preparation (one dtype per unit); fp32 trainable weights are their own; the toolkit's
    optimizer under single_gpu/DDP/tensor parallelism (transformers' FSDP2 under TP keeps bf16 shards)."""
    if layout.engine != "torch" or work.precision != "bf16" or not work.master_weights:
        return "none"
    engine_upcasts = layout.shard_params and layout.tensor_parallel == 1
    return "upcast" if engine_upcasts or work.trainable_fp32 else "optimizer"


def lora_dropout_bytes(shape: Shape, work: Workload) -> int:
    """The masks of LoRA's dropout (peft: lora_B(lora_A(dropout(x))) in every adapted module), one element per
    adapted input feature and token, of work.dropout_mask_bytes (CUDA's fused dropout: a bool; a CPU's: the
    adapters' fp32). The rest of what the adapters save is in the measured activations (measured without dropout,
    under the run's autocast). Measured on an H100: llama3_qlora's adapter on a Llama-3.2-1B shape, 2 x 4,096
    tokens, peaked at 18.25 GiB, 2.5 GiB of it these masks (../shared/gpu/README.md; tests/test_qlora.py). With
    activation checkpointing only the recomputed layer's are alive."""
    if not work.lora_dropout or not shape.lora_inputs:
        return 0
    inputs = shape.lora_inputs / shape.num_layers if work.activation_checkpointing else shape.lora_inputs
    return int(work.dropout_mask_bytes * inputs * work.seq_length * work.micro_batch)


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
    # Temporary buffers: the gathered 16-bit unit. DeepSpeed counts two gathered copies of the largest module
    # ("largest_layer_memory = 4 * largest_layer_params"); FSDP gathers one transformer layer, prefetching the
    # next (two units in the compute dtype), or keeps every layer gathered through backward under SHARD_GRAD_OP.
    compute = 4 if work.precision == "fp32" else 2
    if layout.engine == "deepspeed" and layout.shard_params:
        mem.device["gathered_buffers"] = 2 * compute * shape.largest_module
    elif layout.shard_params and layout.expert_parallel > 1:
        # A layer's experts stay on their ranks (its tokens go to them), gathered only over the ranks that shard
        # the same experts (transformers' efsdp: shards / ep), where there are several: the rest of the layer is.
        kept = shape.unit_experts // layout.expert_parallel if shards > layout.expert_parallel else 0
        unit = max(shape.largest_unit - shape.unit_experts + kept, shape.input_params)
        mem.device["gathered_buffers"] = compute * 2 * unit
    elif layout.shard_params:
        gathered = shape.total if layout.gathered_through_backward else 2 * shape.largest_unit
        mem.device["gathered_buffers"] = compute * gathered // layout.tensor_parallel  # a TP slice is gathered
    elif layout.ddp:
        mem.device["gathered_buffers"] = int(states["gradients"])  # DDP's gradient buckets: a second copy
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
    mem.device["cuda_context"] = int(work.cuda_context_gib * GIB)
    return mem


def all_to_all_bytes(shape: Shape, work: Workload, ep: int) -> int:
    """Bytes one rank sends to the others a step under expert parallelism (transformers' AllToAllEP): in every
    MoE layer each token's hidden state goes to each of its k experts and the expert's output comes back (two
    all-to-alls forward, their two reverses backward, two more where activation checkpointing recomputes the
    forward), in the compute dtype; (ep - 1) / ep of the pairs leave the rank when the routers spread them evenly.
    0 without experts or EP."""
    if ep <= 1 or not shape.routed_copies:
        return 0
    tokens = work.micro_batch * work.sequences_per_sample * work.seq_length * work.micro_batches
    exchanges = 6 if work.activation_checkpointing else 4
    compute = 4 if work.precision == "fp32" else 2
    return int(exchanges * tokens * shape.routed_copies * shape.hidden_size * compute * (ep - 1) / ep)


def expert_gather_bytes(shape: Shape, work: Workload, shards: int) -> int:
    """Bytes of routed experts one rank all-gathers a step under FSDP (what expert parallelism does not move): every
    layer's, in the compute dtype, in each micro-batch's forward and again for its backward (the recompute under
    activation checkpointing uses the backward's), (shards - 1) / shards of them from the other ranks."""
    compute = 4 if work.precision == "fp32" else 2
    return int(2 * work.micro_batches * shape.routed_params * compute * (shards - 1) / shards)


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
