"""Trainer part: checkpoints and the export: the optimizer's shards where transformers sharded the model
(sharded_state.py), a pipeline's stages, converted and sharded weights loaded back (converted.py), checkpoints
staged and published whole with the cost so far (checkpoints.py), plain tensors in every save."""

from __future__ import annotations

import functools
import json

from ..metrics.tracking import SPENT_FILE
from . import sharded_state
from .checkpoints import plain_state_dict, staging_dir, untied
from .converted import load_converted, load_sharded


class Saving:
    """The Trainer's checkpoint, resume and export overrides."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharded_state:
            return sharded_state.save(self, output_dir)
        if self.pipeline is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.pipeline.save_optimizer(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.sharded_state:
            return sharded_state.load(self, checkpoint)
        if self.pipeline is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.pipeline.load_optimizer(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.pipeline is None:
            # `model or ...` would ask a compiled model for its truth: OptimizedModule.__len__ raises
            if not self._loaded_converted(resume_from_checkpoint, self.model if model is None else model):
                super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        self.pipeline.load_weights(resume_from_checkpoint)

    def _loaded_converted(self, checkpoint: str, model) -> bool:
        """Whether the weights of `checkpoint` were loaded here because transformers sharded the model at load or
        saved them under converted names (converted.py); FSDP's and DeepSpeed's own checkpoints use the model's
        names and keep their load."""
        engine = self.is_fsdp_enabled or self.is_deepspeed_enabled
        return not engine and (load_sharded(model, checkpoint) or load_converted(model, checkpoint))

    def _load_best_model(self) -> None:
        if self.pipeline is None:
            if not self._loaded_converted(self.state.best_model_checkpoint, self.model):
                super()._load_best_model()
            return
        self.pipeline.load_weights(self.state.best_model_checkpoint)

    def _get_output_dir(self, trial) -> str:
        if self.checkpoints.active:  # while a checkpoint is written: into the staging folder
            return str(staging_dir(self.args.output_dir))
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self.tracker.reduce_tokens(self.state)  # the count the checkpoint's trainer_state.json keeps
        self.checkpoints.save(functools.partial(super()._save_checkpoint, model, trial),
                              {SPENT_FILE: json.dumps(self.tracker.spent())})  # fmt: skip  # resumes add to it

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every save of the weights (checkpoints and the export): plain tensors, not FP8's weight wrappers; a
        gathered state dict (DeepSpeed's) without the second name of tied weights, which it holds as two tensors."""
        if state_dict is not None:
            state_dict = untied(self.model, state_dict)
        super()._save(output_dir, plain_state_dict(self.model, state_dict))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The final save is always a consolidated Hugging Face folder; checkpoints keep their sharded format.
        Pipeline stages write the stages' parts of one folder (checkpoints and the export alike)."""
        if self.pipeline is not None:
            self.pipeline.save(output_dir or self.args.output_dir)
            return
        gathered = None if _internal_call else self.checkpoints.gathered_state_dict()
        if gathered is not None:
            self._save(output_dir, state_dict=gathered)
            return
        super().save_model(output_dir, _internal_call)
