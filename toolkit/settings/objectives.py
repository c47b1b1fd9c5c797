"""GRPO's objective as TRL names it: the loss (`loss_type`) and the level of its importance ratios
(`importance_sampling_level`), each checked against TRL's own list, and put in words for the header and the card.

GSPO is no loss of TRL's: it is grpo with one ratio a completion (sequence level). TRL takes every pairing of the
two and warns of those its papers do not make (GRPOTrainer.__init__); the toolkit says that once, as its own
warning naming the fix, when the settings resolve, and the trainer holds TRL's back (training/rl.py).
"""

from __future__ import annotations

import re
from dataclasses import fields
from functools import cache

from ..errors import ConfigError, warn

# How each of TRL's GRPO losses uses a completion's ratio, and how its tokens' terms become the step's loss
# (GRPOConfig's docstring, trl/trainer/grpo_config.py; GRPOTrainer._compute_loss).
LOSSES = {
    "grpo": ("clipped", "each completion's tokens averaged, then the completions"),
    "dr_grpo": ("clipped", "summed over the tokens, divided by completions x max_completion_length"),
    "dapo": ("clipped", "a mean over all the step's tokens"),
    "bnpo": ("clipped", "a mean over each micro-batch's tokens"),
    "cispo": ("clipped, then a fixed weight on the log-probability", "a mean over all the step's tokens"),
    "sapo": ("a soft gate in place of the clip", "each completion's tokens averaged, then the completions"),
    "luspo": ("clipped", "each completion's term times its length, then the completions averaged"),
    "vespo": ("Gamma-shaped, on the log-probability (no clip)", "a mean over all the step's tokens"),
}  # fmt: skip
RLOO = "RLOO's (TRL's): each completion's reward less its siblings' mean, clipped per sequence"
SUMMED = ("bnpo", "dr_grpo", "dapo", "cispo")  # TRL's losses that sum a sequence-level ratio over the tokens


@cache
def grpo_losses() -> tuple[str, ...]:
    """GRPOConfig.loss_type's values, as TRL's own help for the field lists them (it keeps no constant)."""
    return quoted("loss_type", "Supported values are")


@cache
def importance_levels() -> tuple[str, ...]:
    """GRPOConfig.importance_sampling_level's values, as its help's first sentence quotes them ('token' or
    'sequence'; TRL keeps no constant)."""
    return quoted("importance_sampling_level")


def quoted(name: str, after: str = "") -> tuple[str, ...]:
    """The words quoted in the first sentence of GRPOConfig's help for `name` (after `after`), each once."""
    from trl import GRPOConfig

    help_text = next(f for f in fields(GRPOConfig) if f.name == name).metadata["help"]
    sentence = (help_text.partition(after)[2] if after else help_text).partition(". ")[0]
    return tuple(dict.fromkeys(re.findall(r"'(\w+)'", sentence)))


def objective(loss_type: str, level: str) -> str:
    """The objective in words (the header's loss line, the card's objective row)."""
    ratio, averaged = LOSSES.get(loss_type, ("", "TRL's"))
    head = f"{loss_type}: {level}-level ratios"
    if loss_type == "vespo":  # its weights are a completion's, from the token ratios, whatever the level
        head = "vespo: one weight a completion, from its token ratios"
    elif (loss_type, level) == ("grpo", "sequence"):
        head = "grpo with sequence-level ratios = GSPO"
    return f"{head}, {ratio}; {averaged} (TRL's GRPO)"


def pairing(loss_type: str, level: str) -> str | None:
    """TRL's warning of a loss and level its papers do not pair (GRPOTrainer.__init__), in one line with the fix."""
    if loss_type == "luspo" and level != "sequence":
        return ("loss_type luspo with importance_sampling_level token: LUSPO is GSPO's sequence-level loss, one "
                "ratio a completion: pass --importance_sampling_level sequence.")  # fmt: skip
    if loss_type == "vespo" and level != "token":
        return ("loss_type vespo weighs each completion from its token ratios itself, and TRL expects "
                "importance_sampling_level token with it: drop --importance_sampling_level sequence.")  # fmt: skip
    if level == "sequence" and loss_type in SUMMED:
        return (f"loss_type {loss_type} with importance_sampling_level sequence sums each completion's one ratio "
                "over its tokens, so a long completion counts for more: that is not GSPO, which is --loss_type grpo "
                "--importance_sampling_level sequence.")  # fmt: skip
    return None


def check_objective(loss_type: str, level: str) -> None:
    """grpo's loss and ratio level against TRL's lists, in one line each; a pairing TRL warns of, a warning."""
    if loss_type not in grpo_losses():
        fix = ("GSPO is --loss_type grpo --importance_sampling_level sequence" if str(loss_type).lower() == "gspo"
               else "pass --loss_type dapo (TRL's default)")  # fmt: skip
        raise ConfigError(f"loss_type {loss_type!r} is not among TRL's GRPO losses ({', '.join(grpo_losses())}): "
                          f"{fix}.")  # fmt: skip
    if level not in importance_levels():
        raise ConfigError(f"importance_sampling_level {level!r} is not one of TRL's ({', '.join(importance_levels())})"
                          ": token is one ratio a token (TRL's default), sequence one a completion (GSPO with "
                          "--loss_type grpo).")  # fmt: skip
    said = pairing(loss_type, level)
    if said:
        warn_once(said)


@cache
def warn_once(message: str) -> None:
    """A warning said once a process: a run's settings resolve again for its evaluation."""
    warn(message)
