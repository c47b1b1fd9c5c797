"""What pipeline stages exchange beside the schedule's activations (training/pipeline.py's part): the replicas'
gradients summed and the norm over every stage, the loader sharded over the replicas and evaluation gathered over
them, and generation through the stages in turn."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..models.pipeline import text_model


class PipelineExchange:
    """The stages' collectives outside the schedule (self: the Pipeline)."""

    def reduce_gradients(self) -> None:
        """Each replica's gradients are its part of the whole batch's: summed over the replicas, one flat buffer
        per dtype."""
        grads = [p.grad for p in self.trainer.model.parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch._utils._flatten_dense_tensors(same)
            dist.all_reduce(flat, group=self.dp_group)
            for grad, reduced in zip(same, torch._utils._unflatten_dense_tensors(flat, same), strict=True):
                grad.copy_(reduced)

    def clip(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradients: each stage's squares summed over the stages."""
        grads = [p.grad for p in parameters if p.grad is not None]
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        for grad in grads:
            squares += grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=self.pp_group)
        total = squares.sqrt()
        if 0 < max_norm < float("inf"):
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    def shard(self, loader):
        """The Trainer's loader, prepared by accelerate over every rank, sharded over the replicas instead: the
        stages of one pipeline read the same rows."""
        sampler = getattr(loader, "batch_sampler", None)
        if sampler is not None and hasattr(sampler, "num_processes"):
            sampler.num_processes, sampler.process_index = self.replicas, self.replica
        return loader

    def gather(self, data):
        """The Trainer's gather_function for evaluation: over the replicas (a pipeline's stages hold the same rows),
        the last batch cut to the rows the data set has, as accelerate's gather_for_metrics does."""
        from accelerate.utils import recursively_apply

        def over_replicas(tensor: torch.Tensor) -> torch.Tensor:
            if self.replicas == 1:
                return tensor
            parts = [torch.empty_like(tensor) for _ in range(self.replicas)]
            dist.all_gather(parts, tensor.contiguous(), group=self.dp_group)
            return torch.cat(parts)

        gathered = recursively_apply(over_replicas, data)
        state = self.trainer.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return recursively_apply(lambda tensor: tensor[: state.remainder], gathered)
        return gathered

    @contextlib.contextmanager
    def generating(self):
        """`generate` on every rank, each forward through the stages in turn (without a KV cache: each stage's
        cache would count only its own layers' positions), the last stage's next-token logits sent to all."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        decoder, group = self.decoder, self.pp_group
        base = text_model(decoder)
        neighbours = [dist.get_global_rank(group, s) for s in range(self.stages)]

        def forward(input_ids=None, attention_mask=None, position_ids=None, **_):
            inputs = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            hidden = (*input_ids.shape, decoder.config.hidden_size)
            if self.first:
                x = base(input_ids=input_ids, **inputs).last_hidden_state
            else:
                x = torch.empty(hidden, dtype=self.hidden_dtype, device=self.device)
                dist.recv(x, src=neighbours[self.stage - 1], group=group)
            if self.last:
                logits = type(decoder).forward(decoder, inputs_embeds=x, **inputs).logits[:, -1:].float()
            else:
                if not self.first:
                    x = base(inputs_embeds=x, **inputs).last_hidden_state
                dist.send(x.to(self.hidden_dtype).contiguous(), dst=neighbours[self.stage + 1], group=group)
                logits = torch.empty((input_ids.shape[0], 1, decoder.config.vocab_size), device=self.device)
            dist.broadcast(logits, src=self.last_rank, group=group)
            return CausalLMOutputWithPast(logits=logits)

        decoder.forward = forward
        try:
            yield
        finally:
            del decoder.forward

    @property
    def hidden_dtype(self):
        """The dtype the stages pass on: their weights' (the most of them; LoRA's fp32 adapters aside)."""
        counts: dict[torch.dtype, int] = {}
        for p in self.decoder.parameters():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        return max(counts, key=counts.get)
