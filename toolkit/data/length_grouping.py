"""Length-grouped batching: a micro-batch of examples of similar length pads little (the trainer draws its
training order from here: training/trainer.py).

On by default (`--train_sampling_strategy group_by_length`, the Trainer's own setting; `random` turns it off).
transformers' `LengthGroupedSampler` does the grouping: shuffle, cut into mega-batches of 50 batches, sort each
by length. The toolkit's sampler adds what a multi-process run needs from it:

- the batch it groups is the *global* batch (per-device batch x accumulation x processes), so any process count
  with the same global batch draws the same examples for each optimizer step (accelerate hands each rank its
  slice of that order): the same run on 1 or 8 devices, and resuming on another process count, stay equal;
- the shuffle is seeded with (seed, epoch), so a run resumed mid-epoch draws the order the interrupted one drew
  (the Trainer restores its RNG only after the resumed epoch's order is drawn).

Lengths come from a `length` column written at tokenization, not by reading every row at start-up.
"""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler

LENGTH = "length"  # dataset column: tokens in the row (removed by the Trainer before the collator)
PAIRED = "chosen_ids"  # a column of TRL's tokenized preference pairs


def sample_lengths(dataset) -> list[int]:
    """Tokens in each training sample: a row's, or a preference pair's two sequences (TRL's prompt, chosen and
    rejected ids; the prompt in each)."""
    if LENGTH in dataset.column_names:
        return dataset[LENGTH]
    if PAIRED in dataset.column_names:
        return [2 * len(p) + len(c) + len(r) for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"],
                                                            dataset["rejected_ids"], strict=True)]  # fmt: skip
    return [len(row) for row in dataset["input_ids"]]


class GlobalLengthGroupedSampler(LengthGroupedSampler):
    """Indices grouped by length in global batches, in an order fixed by (seed, epoch)."""

    def __init__(self, lengths: list[int], global_batch: int, seed: int):
        super().__init__(global_batch, lengths=lengths)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        # An int tuple's hash is the same in every process, and (0, 1) and (1, 0) differ (seed + epoch would not).
        self.generator = torch.Generator().manual_seed(hash((self.seed, self.epoch)) % 2**63)
        return super().__iter__()
