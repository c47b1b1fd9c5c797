"""Length-grouped batching pads less, and its order is fixed by (seed, epoch): resumes draw the same rows.

That the order does not depend on the process count is checked by the strategy matrix (tests/test_strategies.py):
its 2-process runs, grouped by default, train on the rows of the 1-process reference, step by step.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from bert import RECIPE
from conftest import check, launch, rank_reports

from toolkit import train
from toolkit.data.length_grouping import GlobalLengthGroupedSampler


def chat_lengths(n: int = 4096, seed: int = 0) -> list[int]:
    """Log-normal lengths, median 96 tokens, cut at 512: the shape of chat data."""
    rng = random.Random(seed)
    return [min(512, max(8, round(rng.lognormvariate(math.log(96), 0.9)))) for _ in range(n)]


def padding_share(order: list[int], lengths: list[int], batch: int) -> float:
    """Share of a padded micro-batch's tokens that are padding, over the whole order."""
    real = total = 0
    for i in range(0, len(order) - batch + 1, batch):
        rows = [lengths[j] for j in order[i : i + batch]]
        real, total = real + sum(rows), total + max(rows) * len(rows)
    return 1 - real / total


def test_grouped_micro_batches_pad_far_less_than_shuffled_ones():
    lengths = chat_lengths()
    order = list(GlobalLengthGroupedSampler(lengths, global_batch=32, seed=0))
    assert sorted(order) == list(range(len(lengths)))  # every row once
    shuffled = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    grouped, plain = padding_share(order, lengths, 8), padding_share(shuffled, lengths, 8)
    assert plain > 0.55 and grouped < 0.05, (plain, grouped)  # measured: 0.605 and 0.013


def test_order_is_fixed_by_seed_and_epoch():
    lengths = chat_lengths(512)
    a, b = GlobalLengthGroupedSampler(lengths, 32, seed=0), GlobalLengthGroupedSampler(lengths, 32, seed=0)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(a) != list(GlobalLengthGroupedSampler(lengths, 32, seed=1).__iter__())


@pytest.mark.launch
def test_two_processes_and_a_resume_in_a_later_epoch_train_on_the_rows_of_one_process(tmp_path):
    # 64 rows, global batch 8: 8 steps per epoch. The 2-process run saves at step 12, mid-way through the second
    # epoch, where the Trainer's set_epoch does not reach the sampler of a resumed loader (training/order.py sets it).
    flags = ["--tiny", "--report_to", "none", "--record_rank_reports", "true", "--max_train_samples", "64",
             "--max_steps", "-1", "--num_train_epochs", "2", "--save_strategy", "steps",
             "--save_steps", "12"]  # fmt: skip
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    train(RECIPE, [*flags, "--output_dir", str(one), "--per_device_train_batch_size", "8"], "bert")
    halves = [*flags, "--per_device_train_batch_size", "4", "--output_dir"]
    check(launch("ddp", "bert", *halves, str(two), cwd=tmp_path))
    check(launch("ddp", "bert", *halves, str(resumed), "--resume_from_checkpoint", str(two / "checkpoint-12"),
                 cwd=tmp_path))  # fmt: skip

    def steps(out):  # per optimizer step, the rows of every rank in rank order
        ranks = [r["rows"] for r in rank_reports(out)]
        b = 8 // len(ranks)
        return [sum((rows[i : i + b] for rows in ranks), []) for i in range(0, len(ranks[0]), b)]

    def losses(out):
        return [e["loss"] for e in map(json.loads, (out / "run_log.jsonl").read_text().splitlines()) if "loss" in e]

    assert len(steps(one)) == 16 and steps(two) == steps(one)
    assert sorted(sum(steps(one)[:8], [])) == sorted(sum(steps(one)[8:], [])) != sum(steps(one)[8:], [])
    assert steps(resumed) == steps(two)[12:]  # the second epoch's order, not the first's
    assert losses(resumed) == losses(two)[12:]


def test_the_first_batches_are_not_the_longest():
    """Each mega-batch's batches in a random order: the first global batches of an epoch are as long as any (they
    were the longest: transformers' sampler runs each mega-batch longest to shortest, its longest batch first)."""
    lengths = chat_lengths()
    order = list(GlobalLengthGroupedSampler(lengths, global_batch=32, seed=0))
    mean = sum(lengths) / len(lengths)
    first = [lengths[i] for i in order[: 5 * 32]]  # 5 steps' rows
    assert 0.7 < sum(first) / len(first) / mean < 1.3, sum(first) / len(first) / mean
    starts = [sum(lengths[i] for i in order[b : b + 32]) for b in range(0, 50 * 32, 32)]  # the first mega-batch's
    assert starts != sorted(starts, reverse=True)
