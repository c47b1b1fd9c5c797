"""--per_device_train_batch_size auto: the largest micro-batch that fits, the global batch, the learning rate and the
training itself unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import check, launch
from test_bad_input import assert_one_clear_line

from toolkit import run, train
from toolkit.metrics.memory import GIB
from toolkit.project import load_recipe
from toolkit.training import batch_finder

FLAGS = ["--tiny", "--max_steps", "3", "--report_to", "none", "--save_strategy", "no", "--dropout", "0"]


def trained(tmp_path, name: str, *flags: str):
    out = tmp_path / name
    result = train(load_recipe("llama3_fft"), [*FLAGS, *flags, "--output_dir", str(out)], "llama3_fft")
    losses = [line["loss"] for line in map(json.loads, (out / "run_log.jsonl").read_text().splitlines())
              if "loss" in line]  # fmt: skip
    return result.trainer, losses


def test_the_finder_lands_on_the_largest_micro_batch_that_fits(tmp_path, monkeypatch):
    """Tiny mode trains 8 rows a device a step. Unlimited, 8 fits; under a limit a byte below what the step at 8
    needs (as the probe measured it), 4 is the largest divisor that fits, whatever the plan started from; the global
    batch, the learning rate and the losses are those of a run given 4 x 2 accumulation, to the bit (the probe
    leaves no gradient and no random draw behind)."""
    free, _ = trained(tmp_path, "free", "--per_device_train_batch_size", "auto")
    choice = free.recipe.batch_choice
    assert (choice.micro_batch, choice.accumulation, choice.rows) == (8, 1, 8)
    need = dict(choice.tried)[8]

    monkeypatch.setenv(batch_finder.LIMIT, repr((need - 1) / GIB))
    limited, losses = trained(tmp_path, "limited", "--per_device_train_batch_size", "auto")
    choice = limited.recipe.batch_choice
    assert (limited.args.per_device_train_batch_size, limited.args.gradient_accumulation_steps) == (4, 2)
    assert dict(choice.tried)[4] <= choice.budget < dict(choice.tried)[8]
    monkeypatch.delenv(batch_finder.LIMIT)
    given, given_losses = trained(tmp_path, "given", "--per_device_train_batch_size", "4",
                                  "--gradient_accumulation_steps", "2")  # fmt: skip
    assert limited.args.learning_rate == given.args.learning_rate == free.args.learning_rate
    assert losses == given_losses and len(losses) == 3

    monkeypatch.setenv(batch_finder.LIMIT, repr((need + 1024) / GIB))
    at_need, _ = trained(tmp_path, "at-need", "--per_device_train_batch_size", "auto")
    assert at_need.recipe.batch_choice.micro_batch == 8


def test_a_real_out_of_memory_halves_and_the_header_says_why(tmp_path, monkeypatch, capsys):
    """An allocator's out-of-memory (here CUDA's words, raised for micro-batches above 2) is what accelerate's
    finder halves on; the header names the choice and each micro-batch probed."""
    measured = batch_finder.step_peak

    def small_device(model, batch, training):
        if len(batch["input_ids"]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return measured(model, batch, training)

    monkeypatch.setattr(batch_finder, "step_peak", small_device)
    trainer, _ = trained(tmp_path, "run", "--per_device_train_batch_size", "auto")
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 4)
    header = capsys.readouterr().out
    assert "batch         2 per device x 4 accumulation x 1 processes = 8 global" in header
    assert "8 needs more (out of memory), 4 needs more (out of memory), 2 needs" in header


def test_not_even_one_row_fitting_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv(batch_finder.LIMIT, "0.000001")
    with pytest.raises(SystemExit):
        run(load_recipe("llama3_fft"), [*FLAGS, "--per_device_train_batch_size", "auto"], "llama3_fft")
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, "not even a micro-batch of 1 fits")


@pytest.mark.parametrize(("recipe_auto", "flags", "key"), [
    (False, ["--task", "dpo"], "task dpo batches in TRL's own trainer: pass a number"),
    (True, [], "give the recipe a number (its batch) and pass auto on the command line"),
])  # fmt: skip
def test_a_finder_that_cannot_probe_is_one_line(recipe_auto, flags, key, capsys):
    recipe = {**load_recipe("llama3_fft"), **({"per_device_train_batch_size": "auto"} if recipe_auto else {})}
    with pytest.raises(SystemExit):  # (tiny mode's own micro-batch would stand under the recipe's auto)
        run(recipe, [*FLAGS[recipe_auto:], "--per_device_train_batch_size", "auto", *flags], "llama3_fft")
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, key)


def test_sharded_engines_are_refused_with_the_planners_command():
    from toolkit.settings.parser import parse

    args = parse(load_recipe("llama3_fft"), "llama3_fft", ["--tiny", "--per_device_train_batch_size", "auto"])
    for engine in ("FSDP", "DEEPSPEED", "PIPELINE"):
        with pytest.raises(Exception, match="python -m toolkit plan recipes/llama3_fft.py"):
            batch_finder.check_batch_finder(args, engine)
    batch_finder.check_batch_finder(args, "replicated")


@pytest.mark.launch
def test_ddp_ranks_agree_on_the_choice(tmp_path):
    """Two processes each probe their own device and take the smaller choice: the run keeps 8 rows a device a
    step, 16 global."""
    result = check(launch("ddp", "llama3_fft", *FLAGS, "--per_device_train_batch_size", "auto", "--output_dir",
                          str(tmp_path / "run"), cwd=tmp_path))  # fmt: skip
    assert "= 16 global" in result.stdout and "(auto: 8 rows a device a step kept" in result.stdout
