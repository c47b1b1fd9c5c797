"""Evaluation metrics beside the Trainer's loss, per task.

classification  accuracy: the share of held-out examples whose argmax class is the label
sft             token_accuracy: the share of trained (assistant) tokens whose next-token argmax is right
                answer_accuracy: the share of held-out rows whose every trained token's argmax is right, which is
                whether greedy decoding writes the answers exactly (each token follows a right prefix); not for
                packed rows, which hold several conversations
                perplexity: exp of the mean negative log-likelihood over those tokens, every token weighing the
                same. The Trainer's eval_loss is a mean of batch means, so it moves with how the held-out rows
                are batched and spread over processes (2 processes gave 6.318 where 1 gave 6.219, the same
                weights); this does not.
Each position's prediction and loss are reduced on the device before the evaluation loop gathers them across
ranks (`preprocess_logits_for_metrics`): two numbers per token, not the vocabulary-wide logits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from ..data.conversations import IGNORE_INDEX


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def next_token_scores(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From each position: the most likely next token, and the negative log-likelihood of the true one. A row at
    a time: the fp32 log-probabilities of one row, not of the whole batch, exist at once."""
    logits, targets = logits[:, :-1], labels[:, 1:]
    nll = torch.stack([torch.nn.functional.cross_entropy(row.float(), target, reduction="none",
                                                         ignore_index=IGNORE_INDEX)
                       for row, target in zip(logits, targets, strict=True)])  # fmt: skip
    return logits.argmax(-1), nll


def sft_metrics(eval_pred, answers: bool = True) -> dict[str, float]:
    (predicted, nll), labels = eval_pred.predictions, eval_pred.label_ids
    labels = labels[:, 1:]
    trained = labels != IGNORE_INDEX
    if not trained.any():
        return {}
    figures = {"token_accuracy": float((predicted[trained] == labels[trained]).mean()),
               "perplexity": math.exp(min(float(nll[trained].astype(np.float64).mean()), 100.0))}  # fmt: skip
    if answers:  # rows of one conversation each (not packed)
        wrong = (predicted != labels) & trained
        figures["answer_accuracy"] = float((~wrong.any(axis=1))[trained.any(axis=1)].mean())
    return figures


class LogitsByName:
    """Trainer part: the predictions an evaluation hands its metrics are the model's `logits`, taken by name.

    transformers' prediction_step keeps every output but the loss, in the order the model returns them, and the
    metrics read the first: a mixture of experts with its load-balancing loss on returns `aux_loss` before its
    logits (Qwen3-MoE's MoeCausalLMOutputWithPast), a 0-dim tensor that `next_token_scores` cannot index; an
    image-text model its cache and image features after them. While prediction_step runs, compute_loss hands it
    the logits alone."""

    predicting = False

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.predicting = True
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        finally:
            self.predicting = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not (return_outputs and self.predicting) or not isinstance(result[1], dict):
            return result
        loss, outputs = result
        return loss, {"logits": outputs.get("logits")}


def metrics_for(task: str, packed: bool = False) -> tuple[Callable, Callable | None]:
    """(compute_metrics, preprocess_logits_for_metrics) for the Trainer; `packed`: rows hold several examples."""
    if task == "classification":
        return accuracy, None
    return functools.partial(sft_metrics, answers=not packed), next_token_scores
