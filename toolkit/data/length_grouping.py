"""Length-grouped batching: a micro-batch of examples of similar length pads little (the trainer draws its
training order from here: training/trainer.py).

On by default (`--train_sampling_strategy group_by_length`, the Trainer's own setting; `random` turns it off), for
unpacked and packed rows alike (packed rows vary in length too, less). As transformers' `LengthGroupedSampler`: the
rows shuffled, cut into mega-batches (50 batches, or a quarter of the data when that is fewer), each sorted by
length and cut into batches; then, unlike it, each mega-batch's batches are drawn in a random order. transformers
puts the longest batch first to meet an out-of-memory error early, and every mega-batch runs longest to shortest:
a run's first logging windows were its longest rows (the chat demo's first window: loss 1.18, then 2.31, from row
length, not learning), and a run shorter than a mega-batch trained only on the longest rows of one. The planner and
the health warning on memory do the early warning instead. What a multi-process run needs from it:

- the batch it groups is the *global* batch (per-device batch x accumulation x processes), so any process count
  with the same global batch draws the same examples for each optimizer step (accelerate hands each rank its
  slice of that order): the same run on 1 or 8 devices, and resuming on another process count, stay equal;
- the shuffle is seeded with (seed, epoch), so a run resumed mid-epoch draws the order the interrupted one drew
  (the Trainer restores its RNG only after the resumed epoch's order is drawn).

Lengths come from a `length` column written at tokenization, not by reading every row at start-up.
"""

from __future__ import annotations

import torch

LENGTH = "length"  # dataset column: tokens in the row (removed by the Trainer before the collator)
PAIRED = "chosen_ids"  # a column of TRL's tokenized preference pairs
LABELLED = "completion_ids"  # a column of TRL's tokenized KTO rows


def sample_lengths(dataset) -> list[int]:
    """Tokens in each training sample: a row's, a preference pair's two sequences (TRL's chosen and rejected ids:
    DPOTrainer's without the prompt, which is in each sequence, RewardTrainer's whole), or a KTO row's one."""
    if LENGTH in dataset.column_names:
        return dataset[LENGTH]
    if PAIRED in dataset.column_names:
        pairs = [len(c) + len(r) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"], strict=True)]
        if "prompt_ids" not in dataset.column_names:
            return pairs
        return [pair + 2 * len(p) for pair, p in zip(pairs, dataset["prompt_ids"], strict=True)]
    if LABELLED in dataset.column_names:  # TRL's KTO rows: the prompt and the labelled completion
        return [len(p) + len(c) for p, c in zip(dataset["prompt_ids"], dataset[LABELLED], strict=True)]
    return [len(row) for row in dataset["input_ids"]]


class GlobalLengthGroupedSampler(torch.utils.data.Sampler):
    """Indices grouped by length in global batches, drawn in a random order, fixed by (seed, epoch)."""

    def __init__(self, lengths: list[int], global_batch: int, seed: int):
        self.lengths, self.batch_size = list(lengths), global_batch
        self.seed, self.epoch = seed, 0

    def __len__(self) -> int:
        return len(self.lengths)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        # An int tuple's hash is the same in every process, and (0, 1) and (1, 0) differ (seed + epoch would not).
        generator = torch.Generator().manual_seed(hash((self.seed, self.epoch)) % 2**63)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        mega = max(1, min(len(order) // (4 * self.batch_size), 50)) * self.batch_size  # transformers' size
        out: list[int] = []
        for start in range(0, len(order), mega):
            block = sorted(order[start : start + mega], key=self.lengths.__getitem__, reverse=True)
            whole = len(block) // self.batch_size * self.batch_size  # a short last batch stays last
            batches = [block[i : i + self.batch_size] for i in range(0, whole, self.batch_size)]
            out += [i for k in torch.randperm(len(batches), generator=generator).tolist() for i in batches[k]]
            out += block[whole:]
        return iter(out)
