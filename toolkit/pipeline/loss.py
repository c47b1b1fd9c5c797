"""SFT's cross-entropy without the vocabulary-wide logits: the output head projects the hidden states a chunk of
tokens at a time inside the loss, and each chunk's logits are recomputed in backward instead of kept.

A causal LM's logits are (tokens x vocabulary), and the plain loss keeps them with an fp32 copy, the fp32
log-probabilities and, at the start of backward, two fp32 gradients of that size: for Llama 3's 128k vocabulary
at 8k tokens, 4 GiB each. Chunked, a step holds one chunk's worth (`loss_chunk_tokens` x vocabulary).

How, for any transformers causal LM and under every strategy: during training the output head's forward
returns its input, so the model hands its hidden states to `loss_function` (set on the model; transformers
calls it with whatever the head returned), which calls the head again per chunk. The head is called as a
module, so ZeRO-3 gathers its weight and FSDP finds it unsharded (it belongs to the root unit) each time; its
parameter names do not change, so checkpoints and exports are untouched. In eval mode the head is itself again:
evaluation, generation and the metrics see real logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


class ChunkedLoss:
    """Installed on a causal LM by `install`; `chunk_tokens` tokens of logits at a time."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int) -> None:
        self.head = model.get_output_embeddings()
        self.project = self.head.forward  # the head's own forward (bound method of its class)
        self.chunk_tokens = chunk_tokens
        self.projecting = False
        self.passed_through = False

    def head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.projecting:
            return self.project(hidden)
        self.passed_through = self.head.training
        # training: the "logits" the model passes to loss_function are the hidden states
        return hidden if self.passed_through else self.project(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.projecting = True
        try:
            return self.head(hidden)  # as a module call: ZeRO-3's and FSDP's hooks see it
        finally:
            self.projecting = False

    def chunk_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                 shift_labels=None, **kwargs) -> torch.Tensor:  # fmt: skip
        """transformers' ForCausalLMLoss, the same labels and reduction, on hidden states."""
        if not self.passed_through:  # eval mode: real logits
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels,
                                   **kwargs)  # fmt: skip
        self.passed_through = False
        if shift_labels is None:  # predict token i + 1 at position i; the last position predicts nothing
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = logits.reshape(-1, logits.shape[-1])
        targets = shift_labels.reshape(-1).to(hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            piece = slice(start, start + self.chunk_tokens)
            if (targets[piece] != ignore_index).any():
                total = total + checkpoint(self.chunk_sum, hidden[piece], targets[piece], use_reentrant=False)
        if num_items_in_batch is None:
            return total / (targets != ignore_index).sum().clamp(min=1)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


def install(model: torch.nn.Module, chunk_tokens: int) -> ChunkedLoss | None:
    """Make a causal LM (or the peft model around one) compute its training loss chunk by chunk; None where it
    has no output head to chunk."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if chunk_tokens <= 0 or base.get_output_embeddings() is None:
        return None
    chunked = ChunkedLoss(base, chunk_tokens)
    chunked.head.forward = chunked.head_forward  # an instance attribute: nn.Module.__call__ finds it first
    base.loss_function = chunked
    return chunked
