"""What a plan sizes beside the model and the strategy: the precision, the optimizer, the micro-batch and its
tokens, activation checkpointing and the kernels, the task's extra copies (DPO's pairs and reference, GRPO's reward
models and sampling), QLoRA's 4-bit weights (memory.py prices them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    # distill's frozen teacher (planner/shape.py's Shape of it): its weights in the run's dtype, placed as a
    # reference is, and its forward over every trained token (estimate.py's teacher_flops_per_token).
    teacher: Any = None
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
