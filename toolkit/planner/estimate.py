"""From a plan's memory to answers: which strategies fit with which micro-batch, the workload of a recipe, and
time and cost at an assumed MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from ..metrics.cost import CostModel
from ..metrics.memory import GIB
from ..models.meta import saved_model_bytes
from ..models.pipeline import bubble
from ..project import strategy_files
from ..settings.tasks import TASKS, fused_head
from ..settings.tasks import task as task_table
from .layout import Layout
from .memory import plan_memory
from .shape import Shape
from .vision import ImageCost
from .workload import Workload


@dataclass(frozen=True)
class Verdict:
    config: str
    device_gib: float
    host_gib_per_node: float  # during training (offloaded states)
    host_load_gib_per_node: float  # while loading the pretrained weights
    fits: bool
    micro_batch: int
    pipeline_stages: int = 1  # a pipeline config's stages for this job (--parallelism_config_pp_size)
    expert_parallel: int = 1  # an expert-parallel config's ep_size for this job (--parallelism_config_ep_size)


def verdicts(shape: Shape, work: Workload, device_gib: float, gpus_per_node: int, nodes: int = 1,
             headroom: float = 0.1, layouts: list[Layout] | None = None, fp8: bool = True,
             shape_for=None) -> list[Verdict]:  # fmt: skip
    """Each strategy on this hardware: memory at the workload's micro-batch, and the largest micro-batch that
    fits with `headroom` of the device memory left free. `fp8`: the devices have FP8 tensor cores; `shape_for(layout)`:
    the shape a config trains (its activations under torch.compile), `shape` for all by default."""
    out = []
    budget, common = device_gib * (1 - headroom) * GIB, shape
    for layout in layouts or [Layout.from_file(p) for p in strategy_files()]:
        if layout.fp8 and not fp8:
            continue
        shape = shape_for(layout) if shape_for is not None else common
        if layout.pipeline_stages > 1 and not (layout := sized_pipeline(layout, shape, work, gpus_per_node, nodes,
                                                                         budget)):  # fmt: skip
            continue
        if layout.expert_parallel > 1 and not (layout := sized_experts(layout, shape, gpus_per_node, nodes)):
            continue
        if layout.name == "single_gpu" and gpus_per_node * nodes > 1 or layout.ddp and gpus_per_node * nodes == 1:
            continue  # one device is single_gpu's case, several are DDP's
        if layout.hybrid and nodes < 2:
            continue
        if layout.tensor_parallel > 1 and layout.mesh_devices != gpus_per_node * nodes:
            continue  # its mesh is exactly that many devices
        if (gpus_per_node * nodes) % layout.sequence_split:
            continue  # a row is split over a group of that many devices
        mem = plan_memory(shape, layout, work, gpus_per_node, nodes)
        best = 0
        for b in (1, 2, 4, 8, 16, 32, 64):
            trial = plan_memory(shape, layout, replace(work, micro_batch=b), gpus_per_node, nodes)
            if trial.device_total <= budget:
                best = b
        out.append(Verdict(layout.name, mem.device_total / GIB, mem.host_total / GIB, mem.host_loading / GIB,
                           mem.device_total <= budget, best, layout.pipeline_stages,
                           layout.expert_parallel))  # fmt: skip
    return out


def workload_for(arguments, weights_dtype: torch.dtype, on_gpu: bool) -> Workload:
    """The workload of a resolved recipe (settings.arguments.Arguments) whose weights load as `weights_dtype`."""
    t, d = arguments.training, arguments.data
    if weights_dtype in (torch.bfloat16, torch.float16):
        precision = "bf16"
    else:
        precision = "bf16-mixed" if t.bf16 or t.fp16 else "fp32"
    optim = str(getattr(t.optim, "value", t.optim))
    optimizer = "adamw_8bit" if "8bit" in optim else "sgd" if "sgd" in optim else "adamw"
    master = precision == "bf16" and master_weights(arguments.model.use_lora, t.bf16 or t.fp16,
                                                    arguments.model.fp32_master_weights)  # fmt: skip
    return Workload(precision=precision, optimizer=optimizer, micro_batch=t.per_device_train_batch_size,
                    micro_batches=t.gradient_accumulation_steps,
                    master_weights=master, trainable_fp32=arguments.model.use_lora or bool(t.fp16),
                    lora_dropout=arguments.model.lora_dropout if arguments.model.use_lora else 0.0,
                    dropout_mask_bytes=1 if on_gpu else 4,
                    seq_length=d.max_seq_length, activation_checkpointing=bool(t.activation_checkpointing),
                    flash_attention=arguments.model.attn_implementation != "eager",
                    cuda_context_gib=Workload.cuda_context_gib if on_gpu else 0.0,
                    weights_4bit=arguments.model.load_in_4bit,
                    reward_model_bytes=reward_model_bytes(d.task, arguments.policy),
                    teacher=teacher_shape(d.task, arguments.model.teacher_model_name_or_path),
                    **task_workload(d.task, arguments.model.use_lora, arguments.model.fused_loss, on_gpu,
                                    arguments.policy.beta or 0.0))  # fmt: skip


def images_caveat(task: str, image: ImageCost | None, why: str) -> str:
    """What the plan of an image-text run leaves out, said where its figures are: the image path, where it could
    not be measured (vision.py)."""
    if task not in TASKS or not task_table(task).images or image is not None:
        return ""
    return (f"the vision tower's activations and FLOPs on each image ({why}; the decoder's are counted, image "
            "tokens as text)")  # fmt: skip


def teacher_shape(task: str, name: str | None) -> Shape | None:
    """distill's teacher, from its config alone (a folder's, the copy stored in the repo, or the Hub's)."""
    if task not in TASKS or not task_table(task).teacher or not name:
        return None
    from ..data.sources import model_config
    from ..models.meta import meta_model

    config = model_config(name)
    return Shape.of(meta_model(config, "sft", None), config)


def teacher_flops_per_token(work: Workload, seq_length: float) -> float:
    """The teacher's forward per trained token (2 per weight a token passes through, and attention's 4LHT): a
    forward without gradients, as a reference's (training_flops_per_token's scoring pass); 0 without a teacher."""
    return 0.0 if work.teacher is None else forward_flops_per_token(work.teacher, seq_length)


def teacher_row(work: Workload, name: str | None) -> dict | None:
    """distill's teacher as `toolkit plan` shows it: its size, what a token passes through, its forward's FLOPs."""
    if work.teacher is None:
        return None
    return {"model": name, "parameters": work.teacher.total, "active_per_token": work.teacher.active,
            "forward_flops_per_token": teacher_flops_per_token(work, work.seq_length)}  # fmt: skip


def reward_model_bytes(task: str, policy) -> int:
    """The weights of an online-RL run's learned rewards (settings/policy.py's reward_models), as TRL loads them."""
    if task not in TASKS or not task_table(task).samples_online:
        return 0
    total = 0
    for folder in policy.reward_models():
        try:
            total += saved_model_bytes(folder, "reward")
        except (OSError, ValueError) as error:
            reason = " ".join(str(error).split())[:200]
            raise ConfigError(f"reward model {folder}: its config.json does not load ({reason}): name the folder "
                              "a reward model was saved to (save_pretrained).") from None  # fmt: skip
    return total


def master_weights(lora: bool, mixed_precision: bool, setting: bool | None) -> bool:
    """Whether 16-bit weights train with fp32 master copies of the trainable ones: peft's LoRA adapters are fp32
    anyway; a full fine-tune has them under mixed precision (--bf16/--fp16), unless --fp32_master_weights false."""
    return lora or (mixed_precision and setting is not False)


def task_workload(task: str, lora: bool, fused_loss: bool | None = None, on_gpu: bool = True,
                  beta: float = 0.0) -> dict:  # fmt: skip
    """What a task changes in the Workload: a preference pair's two sequences (dpo, reward) and, without LoRA, DPO's
    reference copy (GRPO's too, where its KL coefficient `beta` is not 0, and its sampling phase); TRL's fused head
    instead of the full logits where the task uses it (tasks.fused_head; --fused_loss)."""
    if task not in TASKS:
        return {}
    kind = task_table(task)
    work: dict = {"fused_head": fused_head(task, fused_loss, on_gpu)}
    if kind.pairs:
        work["sequences_per_sample"] = 2
    if kind.reference:
        work["reference_weights"] = not lora
    if kind.samples_online:  # distill's beta picks a divergence: its frozen model is the teacher (Workload.teacher)
        work.update(reference_weights=not lora and bool(beta) and not kind.teacher, generates=True)
    return work


def not_fitting_warning(predicted: int, available: int, threshold: float = 0.95) -> str | None:
    """The loud line printed before training when the plan says a device will run out of memory."""
    if available <= 0 or predicted <= threshold * available:
        return None
    return (f"the memory plan predicts {predicted / GIB:.1f} GiB per device, above {threshold:.0%} of the "
            f"{available / GIB:.1f} GiB available: expect an out-of-memory error. `python -m toolkit plan` lists the "
            "configs and micro-batches that fit.")  # fmt: skip


def training_flops_per_token(shape: Shape, seq_length: int, scoring_passes: int = 0) -> float:
    """Forward + backward FLOPs per token: 6 per trainable parameter, 4 per frozen one (forward, and backward
    to its inputs only), plus attention's 12 * layers * hidden * sequence (Chowdhery et al. 2022, PaLM,
    appendix B: 6N + 12LHQT). N counts the parameters a token passes through: in a mixture of experts the shared
    ones and the k of E routed experts it is sent to (Shape.inactive: the rest), as Switch Transformer / Mixtral
    count FLOPs by active parameters; a frozen weight LoRA adapts in place (Shape.merged_frozen) has its gradient
    computed (6), the factors of that update multiply once per forward pass, not per token (none counted). Embedding
    tables that are only looked up cost nothing (a tied output head's weights count as the head's matmul), as in
    torchtitan's MFU. `scoring_passes`: forwards without gradients over as many tokens (2N + 4LHT each): DPO's
    reference (1), KTO's reference and its KL rows through both models (3). An image-text model's
    tower and projector run per image, not per token: their measured FLOPs (Shape.image) spread over the row's
    tokens."""
    layers = shape.num_layers if shape.attention_layers is None else shape.attention_layers
    attention = 12 * layers * shape.hidden_size * seq_length
    trainable = shape.trainable - shape.lookups_trainable - shape.inactive_trainable - shape.merged_adapters
    frozen = shape.frozen - (shape.lookups - shape.lookups_trainable) - (shape.inactive - shape.inactive_trainable)
    images = 0.0
    if shape.image is not None:
        trainable -= shape.image.trainable
        frozen -= shape.image.parameters - shape.image.trainable
        images = shape.image.flops_per_sample / seq_length
    flops = 6 * trainable + 4 * frozen + 2 * shape.merged_frozen + attention + images
    return flops + scoring_passes * forward_flops_per_token(shape, seq_length)


def forward_flops_per_token(shape: Shape, seq_length: float) -> float:
    """One forward without gradients per token: 2 per weight a token passes through (looked-up embeddings none)
    and attention's 4LHT, a third of training's 12LHT: a reference's scoring pass, a teacher's forward."""
    layers = shape.num_layers if shape.attention_layers is None else shape.attention_layers
    return 2 * (shape.active - shape.lookups) + 4 * layers * shape.hidden_size * seq_length


@dataclass(frozen=True)
class CostEstimate:
    device_hours: float
    usd: float
    usd_spot: float | None


def cost_from_throughput(samples: int, epochs: float, samples_per_second: float, devices: int,
                         usd_per_device_hour: float, overhead: float = 1.3,
                         spot_usd_per_device_hour: float | None = None) -> CostEstimate:  # fmt: skip
    """seconds = samples x epochs / samples per second (wall, the whole job), priced as a running job is
    (metrics/cost.py): device-hours = hours x devices; dollars = device-hours x price x overhead (failed runs,
    tuning, debugging)."""
    seconds = samples * epochs / samples_per_second
    on_demand = CostModel("planned", "GPU", devices, usd_per_device_hour, "on_demand", overhead)
    spot = None
    if spot_usd_per_device_hour is not None:
        spot = replace(on_demand, usd_per_unit_hour=spot_usd_per_device_hour, pricing="spot").usd(seconds)
    return CostEstimate(on_demand.unit_hours(seconds), on_demand.usd(seconds), spot)


def samples_per_second_at_mfu(shape: Shape, seq_length: int, mfu: float, devices: int, peak_tflops: float,
                              sequences: int = 1, scoring_passes: int = 0) -> float:  # fmt: skip
    """MFU = achieved model FLOPs / peak: samples/s = MFU x devices x peak / (FLOPs per token x tokens per sample);
    a DPO sample is `sequences` 2 of `seq_length` tokens, with the reference's forward (`scoring_passes`)."""
    flops = training_flops_per_token(shape, seq_length, scoring_passes) * seq_length * sequences
    return mfu * devices * peak_tflops * 1e12 / flops


# Preference among configs that fit, fastest first: less communication, then less offload traffic. Memory decides
# what fits; this order only breaks ties between configs that fit. A mixture of experts' experts, most of its
# weights, move less under expert parallelism (its tokens, to the experts) than under sharding (every expert,
# gathered to every rank): fsdp2_ep before fsdp2 (refused for dense models).
PREFERENCE = ("single_gpu", "ddp", "zero1", "zero2", "fsdp_shard_grad_op", "fsdp_hybrid", "fsdp2_ep", "fsdp2", "zero3",
              "fsdp", "tp", "fsdp2_tp", "zero3_sp", "fsdp2_cp", "fsdp2_fp8", "pp", "pp_ddp", "zero2_offload",
              "fsdp_offload", "zero3_offload")  # fmt: skip
# FP8 (fsdp2_fp8.yaml): throughput over bf16, torchao's published end-to-end float8 speed-up with torch.compile
# at 8 GPUs / 8B parameters (docs.pytorch.org/ao, "Quantized Training": "up to 1.25x"; up to 1.5x at 512 GPUs /
# 405B). It assumes compile, which --torch_compile auto turns on under FP8: one H100 measured 1.26x over bf16
# compile with it and 0.46x of bf16 without (../shared/gpu/README.md, 1 GPU, Llama-3.2-1B shape); one H200 1.10x
# over the toolkit's compiled bf16 defaults, same shape (docs/benchmarks.md): a 1B model's GEMMs gain less than 8B's.
FP8_SPEEDUP = 1.25
# Assumed model FLOPs utilisation per kind of strategy (stated in the output, --mfu overrides). sharded:
# torchtitan's published Llama 3.1 8B FSDP run on 8 x H100 without torch.compile (docs/performance.md, Table 1:
# 5,762 tokens/s per GPU, 33.7% by this module's FLOPs per token; tests/test_planner.py). replicated: above it,
# since nothing is gathered (an assumption; not yet measured); offload: bound by host transfers (an assumption).
ASSUMED_MFU = {"replicated": 0.40, "sharded": 0.34, "offload": 0.15}


def assumed_mfu(layout: Layout, micro_batches: int = 1) -> float:
    """The strategy's assumed MFU; under pipeline stages, a replicated model's over the time with the bubble
    ((stages - 1) / micro-batches of idle time on top of each step's work, models/pipeline.py)."""
    if layout.offload_optimizer or layout.offload_params:
        return ASSUMED_MFU["offload"]
    if layout.pipeline_stages > 1:
        return ASSUMED_MFU["replicated"] / (1 + bubble(layout.pipeline_stages, micro_batches))
    # Tensor parallelism all-reduces activations in every layer: assumed no better than sharding (not measured).
    return ASSUMED_MFU["sharded" if layout.shard_params or layout.tensor_parallel > 1 else "replicated"]


def sized_experts(layout: Layout, shape: Shape, gpus_per_node: int, nodes: int) -> Layout | None:
    """An expert-parallel config sized for the job, as a launch sizes it (--parallelism_config_ep_size and
    _dp_shard_size): the experts split over the most ranks of one node that divides them (the all-to-alls stay on
    the node's links), every rank an FSDP2 shard of the rest. None for a dense model (no row: nothing to split),
    and where no split of 2 or more fits a node."""
    ep = math.gcd(shape.experts_per_layer, gpus_per_node) if shape.experts_per_layer else 1
    return Layout.experts(layout.name, ep, gpus_per_node * nodes) if ep > 1 else None


def sized_pipeline(layout: Layout, shape: Shape, work: Workload, gpus_per_node: int, nodes: int,
                   budget: float) -> Layout | None:  # fmt: skip
    """A pipeline config sized for the job, as a launch sizes it (settings/mesh.py's job_mesh; the stage count by
    --parallelism_config_pp_size): the fewest stages that divide the blocks and the devices and fit `budget`, else
    the most; replicas filling the rest. One pipeline (pp.yaml: no replicas) only where the stages are the devices,
    replicated ones (pp_ddp.yaml) only with two replicas or more. None where no stage count can."""
    world = gpus_per_node * nodes
    replicated = layout.ddp
    blocks = shape.blocks or shape.num_layers
    counts = [n for n in range(2, blocks + 1) if blocks % n == 0 and world % n == 0
              and (world // n >= 2 if replicated else n == world)]  # fmt: skip
    sized = [Layout.pipeline(layout.name, n, layout.pipeline_schedule, world // n) for n in counts]
    for candidate in sized:
        if plan_memory(shape, candidate, work, gpus_per_node, nodes).device_total <= budget:
            return candidate
    return sized[-1] if sized else None
