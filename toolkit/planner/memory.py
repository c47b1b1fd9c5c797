"""The planner: parameters, per-device memory, a fit verdict, time and cost, before anything is launched.

Everything is computed from a meta-device model (no weights, no Hub call for the recipes' models) and from the
strategy files themselves (`accelerate_configs/*.yaml` and the DeepSpeed JSON they name). Each formula says
where it comes from; tests check them against accelerate's and DeepSpeed's own estimators and against the
bytes each rank really held in the strategy matrix.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import yaml

PROJECT_ROOT = Path(__file__).resolve().parent.parent

GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """Parameter accounting of a model, from its meta-device instance."""

    total: int  # tied weights once
    trainable: int
    largest_module: int  # the largest single module's own parameters: ZeRO-3 gathers per module
    largest_unit: int  # the largest FSDP unit: a transformer layer, or the embeddings / the output head
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    # What decides the activations kept for backward (activation_bytes):
    intermediate_size: int = 0
    q_size: int = 0  # queries' width: heads x head dim (the hidden size, unless head_dim says otherwise)
    kv_size: int = 0  # keys' (and values') width: heads x head dim, fewer heads under grouped-query attention
    gated_mlp: bool = False  # SwiGLU (gate_proj, up_proj): three intermediate-wide tensors instead of one
    rms_norm: bool = False  # RMSNorm keeps an fp32 copy of its input and the normalized tensor
    extra_norms: int = 0  # norms outside the layers: BERT's embedding LayerNorm, Llama's final norm
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    language_model: bool = True  # a vocabulary-wide output head (and cross-entropy over it)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    @classmethod
    def of(cls, model: torch.nn.Module, config) -> Shape:
        params = {id(p): p for p in model.parameters()}.values()  # tied weights once
        own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
        blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
        layer = max((sum(p.numel() for p in b[0].parameters()) for b in blocks), default=0)
        embeddings = model.get_input_embeddings().weight.numel()
        head = model.get_output_embeddings()
        head_params = head.weight.numel() if head is not None else 0
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        names = [name for name, _ in model.named_modules()]
        norms = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("Norm", "LayerNorm"))]
        return cls(
            total=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in params if p.requires_grad),
            largest_module=max(own),
            largest_unit=max(layer, embeddings, head_params),
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            num_heads=heads,
            vocab_size=text.vocab_size,
            intermediate_size=text.intermediate_size,
            q_size=heads * head_dim,
            kv_size=(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
            gated_mlp=any(name.endswith("gate_proj") for name in names),
            rms_norm=any("RMSNorm" in n for n in norms),
            extra_norms=len(norms) - 2 * text.num_hidden_layers,
            hidden_dropout=getattr(text, "hidden_dropout_prob", 0.0) or 0.0,
            attention_dropout=getattr(text, "attention_probs_dropout_prob", getattr(text, "attention_dropout", 0.0))
            or 0.0,
            language_model=head is not None and head_params == embeddings,
        )


def meta_model(config, task: str, lora: dict | None = None) -> torch.nn.Module:
    """The architecture with every tensor on the meta device: exact shapes, no memory, no download."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    with torch.device("meta"), outside_zero3_init():
        model = auto.from_config(config)
        if lora:
            from peft import LoraConfig, TaskType, get_peft_model

            task_type = TaskType.SEQ_CLS if task == "classification" else TaskType.CAUSAL_LM
            model = get_peft_model(model, LoraConfig(task_type=task_type, **lora))
    return model


@contextlib.contextmanager
def outside_zero3_init():
    """Inside a ZeRO-3 run, transformers builds every model under deepspeed.zero.Init (partitioned, with
    collectives): not what a meta model for counting wants. Suspend that for the block."""
    from transformers.integrations import deepspeed as hf_deepspeed

    current = hf_deepspeed._hf_deepspeed_config_weak_ref  # the Trainer's config, held weakly by transformers
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if current is not None and current() is not None:
            hf_deepspeed.set_hf_deepspeed_config(current())


@dataclass(frozen=True)
class Layout:
    """What a strategy file does to memory: which states are split over how many ranks, what is offloaded."""

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

    @classmethod
    def from_file(cls, path: str | Path) -> Layout:
        path = Path(path)
        config = yaml.safe_load(path.read_text())
        kind = config["distributed_type"]
        if kind == "DEEPSPEED":
            ds_file = PROJECT_ROOT / config["deepspeed_config"]["deepspeed_config_file"]
            return cls.zero(path.stem, json.loads(ds_file.read_text()).get("zero_optimization", {}))
        if kind == "FSDP":
            fsdp = config.get("fsdp_config", {})
            version = fsdp.get("fsdp_version", 1)
            if version == 2:
                keep = fsdp.get("fsdp_reshard_after_forward", True) is False
            else:
                keep = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper() == "SHARD_GRAD_OP"
            offload = bool(fsdp.get("fsdp_offload_params", False))
            return cls(path.stem, "torch", shard_params=True, shard_grads=True, shard_optimizer=True,
                       gathered_through_backward=keep, offload_params=offload, offload_optimizer=offload,
                       hybrid="parallelism_config" in config,
                       ram_efficient_loading=bool(fsdp.get("fsdp_cpu_ram_efficient_loading")))  # fmt: skip
        return cls(path.stem, "torch", ddp=kind != "NO" and config.get("num_processes", 1) > 1)

    @classmethod
    def zero(cls, name: str, zero: dict) -> Layout:
        """A DeepSpeed ZeRO layout from the `zero_optimization` section of its config."""
        stage = zero.get("stage", 0)
        offload = {k: (zero.get(k) or {}).get("device", "none") not in ("none", None) for k in
                   ("offload_optimizer", "offload_param")}  # fmt: skip
        return cls(name, "deepspeed", shard_params=stage >= 3, shard_grads=stage >= 2, shard_optimizer=stage >= 1,
                   offload_params=offload["offload_param"], offload_optimizer=offload["offload_optimizer"])  # fmt: skip

    @classmethod
    def from_accelerator(cls, accelerator) -> Layout:
        """The layout of a running job, from what accelerate set up (the script never sees the config file)."""
        from accelerate.utils import DistributedType

        kind, state = accelerator.distributed_type, accelerator.state
        if kind == DistributedType.DEEPSPEED:
            return cls.zero("deepspeed", state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}))
        if kind == DistributedType.FSDP:
            plugin = state.fsdp_plugin
            reshard = plugin.reshard_after_forward  # FSDP2: a bool; FSDP1: a ShardingStrategy
            keep = reshard is False or getattr(reshard, "name", "") == "SHARD_GRAD_OP"
            offload = getattr(plugin.cpu_offload, "offload_params", False) or (
                type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
            )
            mesh = accelerator.parallelism_config
            hybrid = bool(mesh and mesh.dp_replicate_enabled and mesh.dp_shard_enabled)
            return cls("fsdp", "torch", shard_params=True, shard_grads=True, shard_optimizer=True,
                       gathered_through_backward=keep, offload_params=offload, offload_optimizer=offload,
                       hybrid=hybrid, ram_efficient_loading=bool(plugin.cpu_ram_efficient_loading))  # fmt: skip
        return cls(kind.value.lower(), "torch", ddp=accelerator.num_processes > 1)


def strategy_files() -> list[Path]:
    return sorted((PROJECT_ROOT / "accelerate_configs").glob("*.yaml"))


# Bytes per parameter of each persistent state, by precision, for the engine's own bookkeeping.
#   torch (Trainer + torch.optim, FSDP): the weights are the master copy; mixed precision keeps fp32 weights
#     and gradients and casts per op (autocast) or per gathered unit (FSDP's MixedPrecisionPolicy).
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

    @property
    def activation_dtype_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


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
    shape: Shape, layout: Layout, precision: str, optimizer: str, upcast_trainable: bool = False
) -> dict[str, float]:
    """Bytes of the persistent states before sharding: {component: bytes}. `upcast_trainable`: trainable 16-bit
    weights are kept in fp32 (accelerate's FSDP2 under mixed precision)."""
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
    trained = 4 if upcast_trainable else weight
    return {
        "parameters": weight * (P - T) + trained * T,
        "gradients": trained * T,
        "master_weights": 0,
        "optimizer_states": OPTIMIZER_STATE_BYTES[optimizer](trained) * T,
    }


def layer_activation_bytes(shape: Shape, work: Workload) -> int:
    """Bytes one transformer layer keeps for its backward, tensor by tensor (e: bytes of an activation; t = s x b
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
    """Activations kept for backward at the end of the forward pass, per device. Each layer keeps
    layer_activation_bytes, or with activation checkpointing only its input (e*t*h; the layer is recomputed
    during its backward: the `recomputed_layer` component). Outside the layers: each extra norm (input,
    statistics, and its output or, followed by dropout, the mask), the head's input, and for a language model
    the fp32 log-probabilities the cross-entropy keeps (t x vocabulary)."""
    s, b, e = work.seq_length, work.micro_batch, work.activation_dtype_bytes
    t, h = s * b, shape.hidden_size
    layers = shape.num_layers * (e * t * h if work.activation_checkpointing else layer_activation_bytes(shape, work))
    norm = ((4 + e) if shape.rms_norm else e) * t * h + (4 if shape.rms_norm else 8) * t
    follower = work.dropout_mask_bytes if shape.hidden_dropout else e
    extra = shape.extra_norms * (norm + follower * t * h)
    if shape.language_model:
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
    return work.seq_length * work.micro_batch * shape.vocab_size * (work.activation_dtype_bytes + 2 * 4)


def plan_memory(shape: Shape, layout: Layout, work: Workload, gpus_per_node: int, nodes: int = 1) -> Memory:
    world = gpus_per_node * nodes
    shards = gpus_per_node if layout.hybrid else world  # HYBRID_SHARD splits over one node's devices
    # accelerate's FSDP2 upcasts trainable 16-bit weights to fp32 under mixed precision (one dtype per unit;
    # fsdp2_prepare_model): bf16 weights train as fp32 masters with bf16 compute.
    upcast = layout.engine == "torch" and layout.shard_params and work.precision == "bf16"
    states = model_state_bytes(shape, layout, work.precision, work.optimizer, upcast)
    split = {
        "parameters": layout.shard_params,
        "gradients": layout.shard_grads,
        "fp32_gradients": layout.shard_optimizer,
        "master_weights": layout.shard_optimizer,
        "optimizer_states": layout.shard_optimizer,
    }
    per_rank = {k: v / shards if split[k] else v for k, v in states.items()}
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
    elif layout.shard_params:
        gathered = shape.total if layout.gathered_through_backward else 2 * shape.largest_unit
        mem.device["gathered_buffers"] = compute * gathered
    elif layout.ddp:
        mem.device["gathered_buffers"] = int(states["gradients"])  # DDP's gradient buckets: a second copy
    # Loading: every rank reads the whole checkpoint into host RAM, except under RAM-efficient loading (rank 0
    # alone; the others build on the meta device) and ZeRO-3 (each rank keeps only its partition). A copy is
    # the parameters as they sit on the host before sharding: under FSDP mixed precision accelerate upcasts the
    # trainable ones to fp32 there, so a bf16 checkpoint takes twice its size (measured: bench/ram_loading.py).
    if layout.ram_efficient_loading:
        copies = 1
    elif layout.engine == "deepspeed" and layout.shard_params:
        copies = gpus_per_node / world
    else:
        copies = gpus_per_node
    mem.host_loading = int(copies * states["parameters"])
    mem.device["activations"] = activation_bytes(shape, work)
    mem.device["recomputed_layer"] = layer_activation_bytes(shape, work) if work.activation_checkpointing else 0
    mem.device["logits"] = logits_bytes(shape, work)
    mem.device["cuda_context"] = int(work.cuda_context_gib * GIB)
    return mem


@dataclass(frozen=True)
class Verdict:
    config: str
    device_gib: float
    host_gib_per_node: float  # during training (offloaded states)
    host_load_gib_per_node: float  # while loading the pretrained weights
    fits: bool
    micro_batch: int


def verdicts(shape: Shape, work: Workload, device_gib: float, gpus_per_node: int, nodes: int = 1,
             headroom: float = 0.1, layouts: list[Layout] | None = None) -> list[Verdict]:  # fmt: skip
    """Each strategy on this hardware: memory at the workload's micro-batch, and the largest micro-batch that
    fits with `headroom` of the device memory left free."""
    out = []
    budget = device_gib * (1 - headroom) * GIB
    for layout in layouts or [Layout.from_file(p) for p in strategy_files()]:
        if layout.name == "single_gpu" and gpus_per_node * nodes > 1 or layout.ddp and gpus_per_node * nodes == 1:
            continue  # one device is single_gpu's case, several are DDP's
        if layout.hybrid and nodes < 2:
            continue
        mem = plan_memory(shape, layout, work, gpus_per_node, nodes)
        best = 0
        for b in (1, 2, 4, 8, 16, 32, 64):
            trial = plan_memory(shape, layout, Workload(**{**asdict(work), "micro_batch": b}), gpus_per_node, nodes)
            if trial.device_total <= budget:
                best = b
        out.append(Verdict(layout.name, mem.device_total / GIB, mem.host_total / GIB, mem.host_loading / GIB,
                           mem.device_total <= budget, best))  # fmt: skip
    return out


def workload_for(arguments, weights_dtype: torch.dtype, on_gpu: bool) -> Workload:
    """The workload of a resolved recipe (toolkit.arguments.Arguments) whose weights load as `weights_dtype`."""
    t, d = arguments.training, arguments.data
    if weights_dtype in (torch.bfloat16, torch.float16):
        precision = "bf16"
    else:
        precision = "bf16-mixed" if t.bf16 or t.fp16 else "fp32"
    optim = str(getattr(t.optim, "value", t.optim))
    optimizer = "adamw_8bit" if "8bit" in optim else "sgd" if "sgd" in optim else "adamw"
    return Workload(precision=precision, optimizer=optimizer, micro_batch=t.per_device_train_batch_size,
                    seq_length=d.max_seq_length, activation_checkpointing=bool(t.activation_checkpointing),
                    flash_attention=arguments.model.attn_implementation != "eager",
                    cuda_context_gib=Workload.cuda_context_gib if on_gpu else 0.0)  # fmt: skip


def lora_settings(model_args) -> dict | None:
    """The peft LoraConfig arguments of a recipe's ModelArguments, or None without LoRA."""
    if not model_args.use_lora:
        return None
    targets = model_args.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",")]
    return {"r": model_args.lora_r, "lora_alpha": model_args.lora_alpha, "target_modules": targets}


def not_fitting_warning(predicted: int, available: int, threshold: float = 0.95) -> str | None:
    """The loud line printed before training when the plan says a device will run out of memory."""
    if available <= 0 or predicted <= threshold * available:
        return None
    return (f"the memory plan predicts {predicted / GIB:.1f} GiB per device, above {threshold:.0%} of the "
            f"{available / GIB:.1f} GiB available: expect an out-of-memory error. `python -m toolkit plan` lists the "
            "configs and micro-batches that fit.")  # fmt: skip


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# Time and cost.
def training_flops_per_token(shape: Shape, seq_length: int) -> float:
    """Forward + backward FLOPs per token: 6 per trainable parameter, 4 per frozen one (forward, and backward
    to its inputs only), plus attention's 12 * layers * hidden * sequence (Chowdhery et al. 2022, PaLM,
    appendix B: 6N + 12LHQT)."""
    return 6 * shape.trainable + 4 * shape.frozen + 12 * shape.num_layers * shape.hidden_size * seq_length


@dataclass(frozen=True)
class CostEstimate:
    device_hours: float
    usd: float
    usd_spot: float | None


def cost_from_throughput(samples: int, epochs: float, samples_per_second: float, devices: int,
                         usd_per_device_hour: float, overhead: float = 1.3,
                         spot_usd_per_device_hour: float | None = None) -> CostEstimate:  # fmt: skip
    """hours = samples x epochs / samples per second / 3600 (wall, the whole job); device-hours = hours x
    devices; dollars = device-hours x price x overhead (failed runs, tuning, debugging)."""
    device_hours = samples * epochs / samples_per_second / 3600 * devices
    spot = device_hours * spot_usd_per_device_hour * overhead if spot_usd_per_device_hour is not None else None
    return CostEstimate(device_hours, device_hours * usd_per_device_hour * overhead, spot)


def samples_per_second_at_mfu(shape: Shape, seq_length: int, mfu: float, devices: int, peak_tflops: float) -> float:
    """MFU = achieved model FLOPs / peak: samples/s = MFU x devices x peak / (FLOPs per token x tokens per sample)."""
    return mfu * devices * peak_tflops * 1e12 / (training_flops_per_token(shape, seq_length) * seq_length)


# The CLI: python -m toolkit plan MODEL ...
# Preference among configs that fit, fastest first: less communication, then less offload traffic. Memory decides
# what fits; this order only breaks ties between configs that fit.
PREFERENCE = ("single_gpu", "ddp", "zero1", "zero2", "fsdp_shard_grad_op", "fsdp_hybrid", "fsdp2", "zero3", "fsdp",
              "zero2_offload", "fsdp_offload", "zero3_offload")  # fmt: skip
# Assumed model FLOPs utilisation per kind of strategy (stated in the output, --mfu overrides): typical figures
# for well-tuned transformer fine-tuning on A100/H100-class GPUs; offload runs are bound by host transfers.
ASSUMED_MFU = {"replicated": 0.40, "sharded": 0.35, "offload": 0.15}


def assumed_mfu(layout: Layout) -> float:
    if layout.offload_optimizer or layout.offload_params:
        return ASSUMED_MFU["offload"]
    return ASSUMED_MFU["sharded" if layout.shard_params else "replicated"]


def recipe_values(model: str) -> dict:
    """A recipe's RECIPE dict (recipes/<model>.py), or the bare minimum for a Hub id or a local folder."""
    path = PROJECT_ROOT / "recipes" / f"{model}.py"
    if not path.is_file():
        return {"model_name_or_path": model, "task": "sft"}
    import importlib.util
    import sys

    sys.path.insert(0, str(path.parent))  # recipes import each other (llama3_lora builds on llama3_fft)
    spec = importlib.util.spec_from_file_location(f"recipe_{model}", path)
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(sys.stderr):  # importing a recipe imports the toolkit: keep --json clean
        spec.loader.exec_module(module)
    return module.RECIPE


def model_config(name: str):
    """A model's config without its weights: a local folder's, the copy stored in the repo, or the Hub's."""
    from transformers import AutoConfig

    from .arguments import ConfigError
    from .sources import SourceUnavailable, check_hub_model
    from .tiny import HUB_CONFIGS, stored_config

    try:
        return stored_config(name)
    except ConfigError:
        pass
    try:
        check_hub_model(name)  # seconds, not the download client's retries, when the Hub is out of reach
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError, SourceUnavailable) as error:
        recipes = sorted(p.stem for p in (PROJECT_ROOT / "recipes").glob("*.py"))
        raise ConfigError(
            f"'{name}' is not a recipe ({', '.join(recipes)}), a folder with a config.json, or a model whose config "
            f"could be fetched from the Hub ({type(error).__name__}). Offline, put its config.json in {HUB_CONFIGS} "
            "as <org>--<name>.json."
        ) from None


def stored_split_size(values: dict) -> int | None:
    """Rows in the recipe's training split, from toolkit/hub_configs/datasets.json (public card figures)."""
    from .tiny import HUB_CONFIGS

    sizes = json.loads((HUB_CONFIGS / "datasets.json").read_text())
    name = values.get("dataset_name", "")
    key = f"{name}:{values['dataset_config']}" if values.get("dataset_config") else name
    return sizes.get(key, {}).get(values.get("train_split", "train"))


def build_plan(args) -> dict:
    from .cost import device_spec

    values = recipe_values(args.model)
    config = model_config(values["model_name_or_path"])
    task = values.get("task", "sft")
    from .arguments import ModelArguments

    model_fields = {f.name for f in fields(ModelArguments)}
    lora = lora_settings(ModelArguments(**{k: v for k, v in values.items() if k in model_fields}))
    shape = Shape.of(meta_model(config, task, lora), config)
    low_precision = values.get("dtype") in ("bfloat16", "float16")
    mixed = values.get("bf16") or values.get("fp16")
    precision = args.precision or ("bf16" if low_precision else "bf16-mixed" if mixed else "fp32")
    work = Workload(
        precision=precision,
        optimizer=args.optimizer,
        micro_batch=args.micro_batch or values.get("per_device_train_batch_size", 8),
        seq_length=args.seq_length or values.get("max_seq_length", 512),
        activation_checkpointing=values.get("activation_checkpointing", False)
        if args.activation_checkpointing is None
        else args.activation_checkpointing,
        flash_attention=values.get("attn_implementation") != "eager",
        cuda_context_gib=args.cuda_context_gib,
    )
    gpu = device_spec(args.gpu)
    samples = args.samples or stored_split_size(values)
    epochs = args.epochs or values.get("num_train_epochs", 1)
    tokens_per_sample = args.tokens_per_sample or work.seq_length
    results = []
    layouts = {p.stem: Layout.from_file(p) for p in strategy_files()}
    for v in verdicts(shape, work, gpu["memory_gb"], args.gpus, args.nodes, args.headroom, list(layouts.values())):
        row = asdict(v)
        if samples:
            layout = layouts[v.config]
            mfu = args.mfu or assumed_mfu(layout)
            peak = gpu["peak_tflops"]["fp32" if precision == "fp32" else "bf16"]
            rate = samples_per_second_at_mfu(shape, tokens_per_sample, mfu, args.gpus * args.nodes, peak)
            cost = cost_from_throughput(samples, epochs, rate, args.gpus * args.nodes, gpu["on_demand"],
                                        args.overhead, gpu.get("spot"))  # fmt: skip
            row.update(mfu=mfu, samples_per_second=rate, device_hours=cost.device_hours, usd=cost.usd,
                       usd_spot=cost.usd_spot)  # fmt: skip
        results.append(row)
    results.sort(key=lambda r: PREFERENCE.index(r["config"]) if r["config"] in PREFERENCE else len(PREFERENCE))
    fitting = [r for r in results if r["micro_batch"]]  # fits with some micro-batch, in order of preference
    return {
        "model": values["model_name_or_path"],
        "recipe": args.model if (PROJECT_ROOT / "recipes" / f"{args.model}.py").is_file() else None,
        "parameters": {
            "total": shape.total,
            "trainable": shape.trainable,
            "frozen": shape.frozen,
            "largest_module": shape.largest_module,
            "largest_fsdp_unit": shape.largest_unit,
        },  # fmt: skip
        "hardware": {
            "gpu": args.gpu,
            "memory_gib": gpu["memory_gb"],
            "gpus_per_node": args.gpus,
            "nodes": args.nodes,
            "headroom": args.headroom,
        },  # fmt: skip
        "workload": asdict(work),
        "data": {"samples": samples, "epochs": epochs, "tokens_per_sample": tokens_per_sample} if samples else None,
        "flops_per_token": training_flops_per_token(shape, work.seq_length),
        "configs": results,
        "recommended": fitting[0]["config"] if fitting else None,
        "recommended_micro_batch": fitting[0]["micro_batch"] if fitting else None,
    }


def render(plan: dict) -> str:
    p, h, w = plan["parameters"], plan["hardware"], plan["workload"]
    lines = [
        f"model       {plan['model']}" + (f"  (recipe {plan['recipe']})" if plan["recipe"] else ""),
        f"parameters  {p['total']:,} total, {p['trainable']:,} trainable, {p['frozen']:,} frozen; "
        f"largest module {p['largest_module']:,}",
        f"hardware    {h['nodes']} node(s) x {h['gpus_per_node']} x {h['gpu']} ({h['memory_gib']} GB), "
        f"{int(h['headroom'] * 100)}% headroom",
        f"workload    {w['precision']}, {w['optimizer']}, micro-batch {w['micro_batch']} x {w['seq_length']} tokens, "
        f"activation checkpointing {'on' if w['activation_checkpointing'] else 'off'}, "
        f"CUDA context {w['cuda_context_gib']} GiB",
    ]
    if plan["data"]:
        d = plan["data"]
        lines.append(f"data        {d['samples']:,} samples x {d['epochs']:g} epoch(s) x {d['tokens_per_sample']:,} "
                     f"tokens; {plan['flops_per_token']:.3g} training FLOPs per token")  # fmt: skip
    lines.append("")
    costed = "usd" in plan["configs"][0] if plan["configs"] else False
    fits = f"fits@{w['micro_batch']}"
    header = f"{'config':<20}{'GiB/GPU':>9}{'host GiB/node':>15}{'at load':>9}  {fits:<8}{'max micro-batch':>16}"
    if costed:  # cents and hundredths of an hour only where the amounts are small
        cents = 2 if max(r["usd"] for r in plan["configs"]) < 100 else 0
        hour_digits = 2 if max(r["device_hours"] for r in plan["configs"]) < 10 else 1
        header += f"{'MFU':>6}{'GPU-hours':>11}{'$ on-demand':>13}{'$ spot':>10}"
    lines.append(header)
    for r in plan["configs"]:
        line = (f"{r['config']:<20}{r['device_gib']:>9.1f}{r['host_gib_per_node']:>15.1f}"
                f"{r['host_load_gib_per_node']:>9.1f}  {'yes' if r['fits'] else 'no':<8}"
                f"{r['micro_batch'] or '-':>16}")  # fmt: skip
        if costed:
            spot = f"{r['usd_spot']:>10,.{cents}f}" if r["usd_spot"] is not None else f"{'-':>10}"
            line += f"{r['mfu']:>6.2f}{r['device_hours']:>11,.{hour_digits}f}{r['usd']:>13,.{cents}f}{spot}"
        lines.append(line)
    lines.append("")
    if plan["recommended"]:
        lines.append(f"recommended: accelerate_configs/{plan['recommended']}.yaml with --per_device_train_batch_size "
                     f"{plan['recommended_micro_batch']}")  # fmt: skip
    else:
        least = min(plan["configs"], key=lambda r: r["device_gib"])
        lines.append(f"recommended: nothing fits; the least memory, {least['config']}, needs {least['device_gib']:.1f} "
                     f"GiB per GPU at micro-batch {w['micro_batch']}. Add GPUs or nodes, shorten the sequence, "
                     + ("" if w["activation_checkpointing"] else "turn on activation checkpointing, ")
                     + "or train LoRA adapters.")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit plan", description="Memory, fit, time and cost of a "
                                     "fine-tune, before launching it.")  # fmt: skip
    parser.add_argument("model", help="a recipe name (bert, llama3_fft, ...), a Hub id with a stored config, or a "
                        "local folder")  # fmt: skip
    parser.add_argument("--gpu", default="A100-80GB", help="GPU type from toolkit/hardware.yaml")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the recipe's")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="adamw")
    parser.add_argument("--micro_batch", type=int, help="per-device batch; default: the recipe's")
    parser.add_argument("--seq_length", type=int, help="default: the recipe's max_seq_length")
    parser.add_argument("--activation_checkpointing", type=lambda v: v.lower() in ("1", "true", "yes"))
    parser.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free")
    parser.add_argument("--cuda_context_gib", type=float, default=Workload.cuda_context_gib)
    parser.add_argument("--samples", type=int, help="training samples (default: the recipe's split, when known)")
    parser.add_argument("--epochs", type=float, help="default: the recipe's num_train_epochs")
    parser.add_argument("--tokens_per_sample", type=int, help="default: the sequence length (full, packed rows)")
    parser.add_argument("--mfu", type=float, help=f"override the assumed MFU {ASSUMED_MFU}")
    parser.add_argument("--overhead", type=float, default=1.3, help="cost factor for failed runs, tuning, debugging")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for flag in ("gpus", "nodes", "micro_batch", "seq_length", "samples", "tokens_per_sample"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be at least 1, got {value}.")
    from .arguments import ConfigError
    from .cost import UnknownHardware

    try:
        plan = build_plan(args)
    except (ConfigError, UnknownHardware) as error:
        parser.error(str(error))
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0
