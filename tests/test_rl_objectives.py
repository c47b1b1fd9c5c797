"""GRPO's objective as settings, checked against TRL's own lists: the loss (`loss_type`) and the level of its
importance ratios (`importance_sampling_level`, GSPO's sequence level); a value TRL does not take is one line
(`--loss_type gspo` naming what GSPO is), a pairing TRL warns of is one warning line of ours naming the fix (TRL's
own held back), and the header and the model card name the objective in words."""

from __future__ import annotations

import inspect
import logging
import re

import pytest
from smollm2_grpo import RECIPE as GRPO
from test_rl import grpo_flags

from toolkit import train
from toolkit.errors import ConfigError
from toolkit.models.tiny import tiny_layer
from toolkit.settings.objectives import grpo_losses, importance_levels, objective, pairing, warn_once
from toolkit.settings.parser import parse

NAME = "smollm2_grpo"


def parsed(*flags: str):
    return parse(GRPO, NAME, ["--tiny", *flags], tiny_defaults=tiny_layer)


def test_the_ratio_levels_are_trls_and_each_reaches_grpoconfig():
    """The levels are read from GRPOConfig's help, and TRL's loss takes exactly those (its error for another names
    them); each reaches TRL's config, token by default; another is refused in one line naming TRL's."""
    from trl import GRPOTrainer

    levels = importance_levels()
    assert set(levels) == {"token", "sequence"}
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert set(re.findall(r"'(\w+)'", source.partition("Possible values are")[2].partition(".")[0])) == set(levels)
    assert parsed().training.importance_sampling_level == "token"
    for level in levels:
        config = parsed("--loss_type", "grpo", "--importance_sampling_level", level).training
        assert type(config).__name__ == "GRPOConfig" and config.importance_sampling_level == level
    with pytest.raises(ConfigError) as error:
        parsed("--importance_sampling_level", "tokens")
    assert "\n" not in str(error.value)
    assert str(error.value).startswith(f"importance_sampling_level 'tokens' is not one of TRL's ({', '.join(levels)})")


def test_loss_type_gspo_is_one_line_naming_the_fix():
    with pytest.raises(ConfigError) as error:
        parsed("--loss_type", "gspo")
    assert "\n" not in str(error.value) and str(error.value).endswith(
        "GSPO is --loss_type grpo --importance_sampling_level sequence.")  # fmt: skip
    assert "sapo" in grpo_losses() and "gspo" not in grpo_losses()
    with pytest.raises(ConfigError, match=r"loss_type 'sigmoid' is not among TRL's GRPO losses .*: pass --loss_type "
                       r"dapo \(TRL's default\)\.$"):  # fmt: skip
        parsed("--loss_type", "sigmoid")


def test_the_level_is_grpos_alone():
    with pytest.raises(ConfigError, match="importance_sampling_level 'sequence' is read only by task grpo, and this "
                       "run's task is rloo"):  # fmt: skip
        parsed("--task", "rloo", "--importance_sampling_level", "sequence")


@pytest.mark.parametrize(
    "loss, level, fix",
    [
        ("dapo", "sequence", "that is not GSPO, which is --loss_type grpo --importance_sampling_level sequence."),
        ("luspo", "token", "pass --importance_sampling_level sequence."),
        ("vespo", "sequence", "drop --importance_sampling_level sequence."),
    ],
)
def test_a_pairing_trl_warns_of_is_one_warning_line_naming_the_fix(loss, level, fix, capsys):
    """Taken, as TRL takes it, with one line of ours."""
    warn_once.cache_clear()
    assert parsed("--loss_type", loss, "--importance_sampling_level", level).training.loss_type == loss
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].endswith(fix), err


def test_the_pairings_are_trls():
    """TRL warns of luspo without sequence, vespo with it, and sequence with the losses that sum over tokens
    (GRPOTrainer.__init__); GSPO (grpo, sequence) and the token-level losses pass in silence."""
    warned = {(loss, level) for loss in grpo_losses() for level in importance_levels() if pairing(loss, level)}
    summed = {(loss, "sequence") for loss in ("bnpo", "dr_grpo", "dapo", "cispo")}
    assert warned == {("luspo", "token"), ("vespo", "sequence"), *summed}


def test_the_objective_in_words():
    assert objective("grpo", "sequence").startswith("grpo with sequence-level ratios = GSPO, clipped; ")
    assert objective("dapo", "token") == "dapo: token-level ratios, clipped; a mean over all the step's tokens " \
        "(TRL's GRPO)"  # fmt: skip
    assert all(objective(loss, "token").endswith("(TRL's GRPO)") and "TRL's;" not in objective(loss, "token")
               for loss in grpo_losses())  # every loss of TRL's is worded  # fmt: skip


def test_the_header_and_the_card_name_the_objective_and_trls_warning_is_held(tmp_path, capsys, caplog):
    """A 1-step tiny run of dapo at sequence level: the header's loss line and the card's objective row name it,
    TRL's GRPOConfig trains it, and ours is the one warning of the pairing (TRL's own, on its logger, held back)."""
    warn_once.cache_clear()
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        trainer = train(GRPO, grpo_flags(out, 1, "--loss_type", "dapo", "--importance_sampling_level", "sequence",
                                         "--save_strategy", "no"), NAME).trainer  # fmt: skip
    assert trainer.args.importance_sampling_level == "sequence" and trainer.importance_sampling_level == "sequence"
    captured = capsys.readouterr()
    named = objective("dapo", "sequence")
    assert f"loss          {named}\n" in captured.out
    assert captured.err.count("warning: loss_type dapo with importance_sampling_level sequence") == 1
    assert not [r for r in caplog.records if "importance_sampling_level" in r.getMessage()]
    assert f"| objective | {named} |" in (out / "README.md").read_text()
