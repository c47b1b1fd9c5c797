"""Trainer part: the order training examples are drawn in, length-grouped over the global batch and seeded per
epoch (data/length_grouping.py), where the run asks for `group_by_length` and the data has lengths."""

from __future__ import annotations

from transformers import TrainerCallback

from ..data.length_grouping import LENGTH, PAIRED, GlobalLengthGroupedSampler, sample_lengths
from ..settings.arguments import global_batch_size


class LengthGroupedOrder(TrainerCallback):
    def __init__(self) -> None:
        self.sampler: GlobalLengthGroupedSampler | None = None

    def sampler_for(self, dataset, args) -> GlobalLengthGroupedSampler | None:
        """The sampler for the training data set (with its length column: the Trainer hands its own sampler hook a
        copy without it), or None for the Trainer's own."""
        columns = getattr(dataset, "column_names", ())
        if args.train_sampling_strategy == "group_by_length" and (LENGTH in columns or PAIRED in columns):
            self.sampler = GlobalLengthGroupedSampler(sample_lengths(dataset), global_batch_size(args),
                                                      args.data_seed or args.seed)  # fmt: skip
        return self.sampler

    def on_epoch_begin(self, args, state, control, **kwargs):
        # Before the epoch's order is drawn. A resumed epoch's loader is wrapped by accelerate's skip_first_batches,
        # through which the Trainer's own set_epoch does not reach the sampler. The epoch starting is the whole
        # part of state.epoch: a resumed state's, or the last epoch's end (epoch + steps/steps, exactly whole).
        if self.sampler is not None:
            self.sampler.set_epoch(int(state.epoch or 0))
