"""What expert parallelism sends and what it saves: the all-to-alls' bytes a step (each token's hidden state to
each of its k experts and back, forward and backward, (ep - 1) / ep of it off the rank), and the experts' bytes FSDP
would gather instead.
"""

from __future__ import annotations

from .shape import Shape
from .workload import Workload


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
