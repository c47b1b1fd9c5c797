"""Trainer part: the optimizer step's overrides: fp32 master weights attached to the optimizer (precision.py), the
gradient norm over every pipeline stage or of the fp32 masters, clipped by it."""

from __future__ import annotations


class OptimizerStep:
    """The Trainer's optimizer and its gradient clipping and norm, for master weights and pipeline stages."""

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.masters is not None:  # the optimizer steps fp32 masters in the bf16 weights' place (precision.py)
            self.masters.attach(optimizer)
        return optimizer

    def _clip_grad_norm(self, model, max_norm: float | None = None):
        with self.phase("optimizer"):  # a profile's split counts clipping with the optimizer's step
            return self._clipped_norm(model, max_norm)

    def _clipped_norm(self, model, max_norm: float | None):
        max_norm = self.args.max_grad_norm if max_norm is None else max_norm
        if self.masters is not None:
            self.masters.take_gradients()  # the norm of the fp32 gradients, and those clipped (precision.py)
        parameters = self.masters.masters if self.masters is not None else list(self.model.parameters())
        if self.pipeline is not None:  # the norm over every stage's gradients
            return self.pipeline.clip(parameters, max_norm)
        if self.masters is None:
            return super()._clip_grad_norm(model)
        return self.accelerator.clip_grad_norm_(parameters, max_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged norm without clipping (--max_grad_norm 0) is the one clipping would use: over every pipeline
        stage, of the fp32 master gradients."""
        if grad_norm is None and (self.pipeline is not None or self.masters is not None):
            grad_norm = self._clip_grad_norm(model, max_norm=float("inf"))
        return super()._get_grad_norm(model, grad_norm)
