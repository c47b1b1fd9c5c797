"""Preference tuning from labelled completions (task kto): TRL's KTOTrainer with the toolkit's parts in front, as
for DPO (preference.py, whose frozen reference it shares).

KTO's loss pushes each completion's log-ratio to the reference above (desirable) or below (undesirable) a KL
estimate: the mean log-ratio of mismatched rows, each row's prompt with another row's completion. TRL pairs them
once, before training, by rotating the completions within blocks of `per_device_train_batch_size` rows, and
averages the estimate over the ranks' micro-batches. On N processes a micro-step runs N such blocks, one per rank,
where one process runs one block of N times the rows: the same rows, other mismatched pairs, another KL, another
loss. Here the blocks are the micro-step's rows over all ranks (per device x processes), as accelerate deals them
out in order, so N processes form the pairs one process does. Imported only by kto runs: TRL takes a second to
import.
"""

from __future__ import annotations

from trl import KTOTrainer

from .trainer import ToolkitTrainerMixin


class RecipeKTOTrainer(ToolkitTrainerMixin, KTOTrainer):
    """The toolkit's parts on TRL's `KTOTrainer`."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """TRL's, its KL rows rotated within each micro-step's rows over all ranks (the module's docstring)."""
        per_device = args.per_device_train_batch_size
        args.per_device_train_batch_size = per_device * args.world_size  # what TRL's rotation reads, only here
        try:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        finally:
            args.per_device_train_batch_size = per_device

    def create_model_card(self, *args, **kwargs) -> None:
        """The toolkit writes the run's own card at the end (results/card.py), not TRL's draft at checkpoints."""
