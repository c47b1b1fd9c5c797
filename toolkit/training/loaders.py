"""Trainer part: the data's overrides: loaders sharded over a pipeline's replicas, the data wait timed, the training
order length-grouped per global batch (order.py), preference pairs evaluated in order."""

from __future__ import annotations

from torch.utils.data import SequentialSampler

from ..data.length_grouping import PAIRED
from ..metrics.tracking import TimedIterator


class Loaders:
    """The Trainer's loaders and samplers."""

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        return self.pipeline.shard(loader) if self.pipeline is not None else loader

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        return self.pipeline.shard(loader) if self.pipeline is not None else loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """An optimizer step's batches, fetched before it starts: the data wait timed (and a profile's window
        opened at its first step's fetch, profiling.py)."""
        if self.profiler is not None:
            self.profiler.starting_step(self.state.global_step + 1)
        with self.phase("data wait"):
            return super().get_batch_samples(TimedIterator(epoch_iterator, self.tracker), num_batches, device)

    def _get_train_sampler(self, train_dataset=None):
        return self.order.sampler_for(self.train_dataset, self.args) or super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        """transformers groups the held-out rows by length too, reading each row's `input_ids`: TRL's tokenized
        preference pairs have none (chosen_ids, rejected_ids), so theirs are read in order, as transformers reads
        them ungrouped (one process: in order; several: accelerate's split of that order)."""
        if PAIRED in getattr(eval_dataset, "column_names", ()):
            return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None
        return super()._get_eval_sampler(eval_dataset)
