"""What one step holds beside the model states (memory.py's part): the activations autograd saves (the measured
fit, else the Llama/BERT-style formula), the layer activation checkpointing recomputes, the logits or the fused
head's tile, LoRA's dropout masks, and GRPO's sampling (its KV cache).
"""

from __future__ import annotations

from .shape import Shape
from .workload import Workload


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
    # Compiled, the cross-entropy's backward is one fused kernel: one fp32 gradient of the logits (compiled.py)
    gradients = 1 if shape.activations is not None and shape.activations.compiled else 2
    return work.seq_length * work.micro_batch * shape.vocab_size * (work.activation_dtype_bytes + gradients * 4)


# TRL's ChunkedLogProbFunction (trl/kernels/chunked_logprob.py) projects TOKEN_CHUNK_SIZE tokens by
# _CHUNKED_LOGPROB_CHUNK_SIZE vocabulary entries at a time (trl/trainer/utils.py); tests compare with TRL's values.
FUSED_HEAD_TILE = (4096, 32768)
# distill's loss, TRL's ChunkedDivergenceFunction (trl/kernels/chunked_divergence.py): TOKEN_CHUNK_SIZE tokens by
# VOCAB_CHUNK_SIZE entries of both models' logits at a time, each tile fp32 whatever the weights' dtype.
DIVERGENCE_TILE = (4096, 32768)


def fused_head_bytes(shape: Shape, work: Workload) -> int:
    """A fused head's share of the backward peak. Its weight's fp32 gradient (vocabulary x hidden; none when the
    head is frozen, as under LoRA) is made at the start of backward and stays: a full copy even where gradients
    are sharded or 16-bit, so counted here beside `gradients`. With it, the larger of: the head's own working
    set (its input's fp32 gradient, t x hidden, and one logits tile in the compute dtype: Triton's kernels work
    in it in place on a GPU; TRL's CPU fallback makes a few fp32 copies; distill's divergence holds two fp32 tiles,
    one a model), or, without full logits to dwarf it, the last layer's MLP backward (two t x intermediate
    gradients), where a CPU step was measured to peak."""
    t, e = work.seq_length * work.micro_batch, work.activation_dtype_bytes
    tile = min(t, FUSED_HEAD_TILE[0]) * min(shape.vocab_size, FUSED_HEAD_TILE[1]) * e
    if work.teacher is not None:  # distill: two fp32 tiles (the student's and the teacher's logits), and the
        # teacher's last hidden states, kept for the backward
        rows, columns = min(t, DIVERGENCE_TILE[0]), min(shape.vocab_size, DIVERGENCE_TILE[1])
        tile = 2 * 4 * rows * columns + e * t * shape.hidden_size
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
