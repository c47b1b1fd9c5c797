"""A GRPO step's time, in its two phases: sampling the step's completions, then training on them.

Sampling is decoding, one token a row at a time, and a decode step is bound by memory bandwidth, not FLOPs: it
reads every weight and each row's KV cache once to produce one token per row. Its time here is that roofline
(bytes read / datasheet bandwidth, or FLOPs / peak where larger), with every completion running to its full length:
what no engine beats, and what transformers' `generate` at small batch (kernel launches, Python) stays well above.
That makes the sampling figure a floor, said so wherever it is printed; the run measures the real split
(`sampling_share`). Training is planned as SFT's is: FLOPs per token at an assumed MFU (estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .estimate import teacher_flops_per_token, training_flops_per_token
from .shape import Shape
from .workload import NF4_BYTES, Workload


@dataclass(frozen=True)
class StepTime:
    sampling: float  # seconds a step, at least: the decode roofline (full-length completions)
    training: float  # seconds a step at the assumed MFU

    @property
    def total(self) -> float:
        return self.sampling + self.training

    @property
    def sampling_share(self) -> float:
        return self.sampling / self.total if self.total else 0.0


def weight_bytes_read(shape: Shape, work: Workload) -> float:
    """Bytes of weights one decode step reads: every weight but the embedding tables (looked up a row at a time:
    nothing) - a mixture's every expert, since a step's many rows are routed to all of them - as stored: 16-bit
    weights 2 bytes, fp32 (and bf16-mixed's fp32 weights, cast as they are read) 4, QLoRA's frozen ones NF4."""
    read = shape.total - shape.lookups
    if work.weights_4bit:
        frozen = shape.frozen - (shape.lookups - shape.lookups_trainable)
        return frozen * NF4_BYTES + (read - frozen) * 4
    return read * (2 if work.precision == "bf16" else 4)


def sampling_seconds(shape: Shape, work: Workload, rows: int, prompt_tokens: int, completion_tokens: int,
                     bandwidth: float, peak_flops: float) -> float:  # fmt: skip
    """One device sampling `rows` completions of `completion_tokens` after prompts of `prompt_tokens`, at the
    roofline: the larger of bytes read / `bandwidth` (bytes/s) and FLOPs / `peak_flops` (FLOP/s). Each of the
    completion's decode steps reads the weights and the KV cache so far (keys and values, kv_size wide, per
    attention layer: the context grows from the prompt to its full length); the FLOPs are 2 per active weight and
    token, the prompts' prefill included."""
    layers = shape.num_layers if shape.attention_layers is None else shape.attention_layers
    per_token_cache = 2 * layers * shape.kv_size * work.activation_dtype_bytes  # one row's keys and values
    contexts = completion_tokens * prompt_tokens + completion_tokens * (completion_tokens + 1) // 2
    bytes_read = completion_tokens * weight_bytes_read(shape, work) + rows * contexts * per_token_cache
    flops = 2 * (shape.active - shape.lookups) * rows * (prompt_tokens + completion_tokens)
    return max(bytes_read / bandwidth, flops / peak_flops)


def grpo_step_time(shape: Shape, work: Workload, prompt_tokens: int, completion_tokens: int, bandwidth: float,
                   peak_flops: float, mfu: float, reference: bool) -> StepTime:  # fmt: skip
    """One device's optimizer step: sampling its rows (micro-batch x micro-batches, sampled at once as TRL does),
    then training on them (6 FLOPs per trainable weight and token, 4 per frozen one; `reference`: the KL term's
    forward of the reference model, 2 more) at `mfu` of `peak_flops`."""
    rows = work.micro_batch * work.micro_batches
    tokens = prompt_tokens + completion_tokens
    sampling = sampling_seconds(shape, work, rows, prompt_tokens, completion_tokens, bandwidth, peak_flops)
    flops = training_flops_per_token(shape, tokens, int(reference)) + teacher_flops_per_token(work, tokens)
    training = rows * tokens * flops / (mfu * peak_flops)
    return StepTime(sampling, training)
