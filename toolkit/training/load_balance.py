"""Trainer part: a mixture of experts' load-balancing loss at its coefficient, whatever the processes and the
gradient accumulation, and logged as its own metric (`aux_loss`, unweighted).

The family's forward (and TRL's fused head) returns `loss = CE + c x aux`, `aux` over that forward's own tokens.
transformers' Trainer then treats the whole as a token sum over every device's tokens: it multiplies it by the
processes (`average_tokens_across_devices`: right for the cross-entropy, whose gradients are then averaged) and,
its tokens counted over the window, does not divide it by the accumulation steps. For `aux`, a mean over one
micro-batch's tokens, that made the coefficient c x processes x accumulation steps (8 GPUs: 0.001 acted as 0.008).
`BalancedLoss` gives the term back its share: each micro-batch's `aux` weighs 1 / (micro-batches of the global
batch), so the optimizer step sees c x the mean of the micro-batches' `aux`.

The balance is per micro-batch, as in the families' own forward and as Megatron-LM's default: each micro-batch's
routers are balanced over its own tokens, not over the global batch's (a global balance would all-reduce the
expert counts in every layer's forward). One process with the whole global batch in one forward computes `aux`
over all of it: the runs differ by the gap between the micro-batches' mean `aux` and the whole batch's.

Over real tokens only: a packed batch reaches the model without its attention mask (data/packing.py), so the
family's forward balances its padding too, and each rank pads to its own longest row. Its router logits are
balanced again here with the batch's mask (`ROUTING_MASK`, beside the model's inputs), as pipeline stages do;
TRL's fused head hands them on too (fused_loss.py).

Label smoothing (--label_smoothing_factor): the Trainer keeps the labels from the model and smooths its logits
itself, so the family's forward computes `aux` and adds nothing to a loss: the term is added here alone.
"""

from __future__ import annotations

import torch

from ..data.packing import model_inputs
from ..models.balance import balance_loss, balance_settings, routing_sums

ROUTING_MASK = "routing_mask"  # a packed batch's attention mask, for the balance alone (never the model's input)


class LoadBalance:
    """The coefficient, and the interval's `aux` values for the log (each rank's own, summed over ranks)."""

    def __init__(self, coef: float, experts: int, top_k: int):
        self.coef, self.experts, self.top_k = coef, experts, top_k
        self.total, self.count = 0.0, 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> LoadBalance | None:
        settings = balance_settings(model.config)
        return cls(*settings) if settings else None

    @staticmethod
    def model_inputs(inputs: dict) -> dict:
        """What of a batch reaches the model (data/packing.py's model_inputs), with a packed batch's attention mask
        beside it for the balance."""
        kept = model_inputs(inputs)
        if "attention_mask" in inputs and "attention_mask" not in kept:
            kept = {**kept, ROUTING_MASK: inputs["attention_mask"]}
        return kept

    def loss(self, router_logits, mask: torch.Tensor | None) -> torch.Tensor:
        """The load-balancing loss of one forward's router logits over its real tokens."""
        return balance_loss(routing_sums(router_logits, self.experts, self.top_k, mask))

    def record(self, aux: torch.Tensor) -> None:
        self.total, self.count = self.total + aux.detach().float(), self.count + 1

    def metrics(self, reduce=None) -> dict[str, float]:
        """The mean `aux` of the micro-batches since the last log, over every rank (`reduce`: a tensor -> its sum
        over the ranks); cleared."""
        figures = torch.stack([torch.as_tensor(self.total, dtype=torch.float32).cpu(), torch.tensor(self.count * 1.0)])
        self.total, self.count = 0.0, 0
        if reduce is not None:
            figures = reduce(figures)
        return {"aux_loss": float(figures[0] / figures[1])} if figures[1] > 0 else {}


class BalancedLoss:
    """The RecipeTrainer's loss with the load-balancing term at its share (module docstring)."""

    balance: LoadBalance | None  # set by ToolkitTrainerMixin

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        balance = self.balance
        hidden = inputs.get(ROUTING_MASK)  # a packed batch's mask, which the model did not see
        inputs = {k: v for k, v in inputs.items() if k != ROUTING_MASK}
        # the model adds its term to the loss it computes from the labels; with label smoothing the Trainer takes
        # the labels from it and smooths the logits: the model computed its `aux_loss` and added nothing
        smoothed = self.label_smoother is not None
        if balance is None or "labels" not in inputs or self.compute_loss_func is not None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        computed = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        if computed is not None:
            computed = computed.to(loss.device)
            # balanced again only where the model balanced padding too (TRL's fused head: fused_loss.py hands on
            # the router logits)
            logits = outputs.get("router_logits") if hidden is not None else None
            aux = balance.loss(logits, hidden).to(loss.device) if logits else computed
            scale, share = self.term_scaling(num_items_in_batch, model.training)
            added = 0.0 if smoothed else computed * scale  # the family's c x aux x scale, replaced
            loss = loss + balance.coef * (aux * share - added)
            if model.training:
                balance.record(aux)
        return (loss, outputs) if return_outputs else loss

    def term_scaling(self, num_items_in_batch, training: bool) -> tuple[float, float]:
        """(what transformers' compute_loss multiplied the model's loss by, the share a micro-batch's term should
        have after it), by the Trainer's own rules (transformers 5: Trainer.compute_loss and training_step), for a
        loss with no compute_loss_func."""
        token_sum = bool(self.model_accepts_loss_kwargs) and num_items_in_batch is not None
        scale = 1.0
        if self.args.average_tokens_across_devices and token_sum:
            scale = self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu
        # a loss not scaled for accumulation the Trainer divides by the steps itself; a token sum it does not
        scaled = token_sum if self.loss_is_scaled_for_ga is None else self.loss_is_scaled_for_ga
        share = 1.0 / self.current_gradient_accumulation_steps if training and scaled else 1.0
        return scale, share
