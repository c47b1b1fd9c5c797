"""Reward modelling (task reward): TRL's RewardTrainer with the toolkit's parts in front, as for DPO.

The data is preference pairs, checked by the data room as DPO's are (data/preference.py); TRL applies the chat
template and tokenizes. The model is a sequence classifier with one output (tasks.py: num_labels 1), trained so
that it scores each chosen answer above its rejected one (the Bradley-Terry loss, -log sigmoid(r_chosen -
r_rejected)); its evaluation reports how often it does (accuracy) and by how much (margin). A GRPO recipe names
the exported folder as a reward (training/rewards.py). Imported only by reward runs: TRL takes a second to import.
"""

from __future__ import annotations

from trl import RewardTrainer

from .trainer import ToolkitTrainerMixin


class RecipeRewardTrainer(ToolkitTrainerMixin, RewardTrainer):
    """The toolkit's parts on TRL's `RewardTrainer`."""

    def create_model_card(self, *args, **kwargs) -> None:
        """TRL drafts a card into the output folder at each checkpoint; the toolkit writes the run's own at the end
        (results/card.py), and a checkpoint never touches the run's files."""
