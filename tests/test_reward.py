"""Reward models (task reward) on TRL's RewardTrainer with the toolkit's parts: a tiny run learns the tiny preference
pairs, its held-out accuracy is what the export scores when each sequence is scored alone, a pair counts as one
example, and the export is a reward that a GRPO run names by its folder, weighted beside a checker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import check, launch, logged
from qwen3_reward import RECIPE as REWARD
from safetensors.torch import load_file
from smollm2_grpo import RECIPE as GRPO

from toolkit import train
from toolkit.data.loading import load_raw
from toolkit.models import tiny
from toolkit.planner.estimate import task_workload
from toolkit.settings.parser import parse

FLAGS = ["--tiny", "--eval_fraction", "0.1", "--eval_on_start", "true", "--report_to", "none"]


def held_out_pairs_of_the_tiny_runs():
    """The pairs the tiny runs here hold out (FLAGS' tenth of the tiny data), loaded as the runs load them."""
    return load_raw(parse(REWARD, "qwen3_reward", FLAGS, tiny.tiny_layer, here=True).data)["eval"]


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> Path:
    """A tiny reward model: 20 steps of 8 pairs (the right sum stated, against a wrong one hedged)."""
    out = tmp_path_factory.mktemp("reward") / "judge"
    train(REWARD, [*FLAGS, "--output_dir", str(out)], "qwen3_reward")
    return out


def test_a_reward_model_learns_the_preference_it_is_shown(judge):
    """Held-out accuracy (chosen scored above rejected) from a random head's to all but a few, and the same figure
    recomputed here from the export: each sequence alone through the chat template and the model, the accuracy
    averaged over the evaluation's batches of 8 as TRL logs it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    before, after = logged(judge, "eval_accuracy")[0], logged(judge, "eval_accuracy")[-1]
    assert logged(judge, "eval_margin")[-1] > 1 and after >= 0.9 and after > before + 0.2
    model = AutoModelForSequenceClassification.from_pretrained(judge).eval()
    tokenizer = AutoTokenizer.from_pretrained(judge)
    assert model.config.num_labels == 1

    def score(messages) -> float:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            return model(**ids).logits[0, 0].item()

    held_out = held_out_pairs_of_the_tiny_runs()
    right = [score(row["chosen"]) > score(row["rejected"]) for row in held_out]
    batches = [right[i : i + 8] for i in range(0, len(right), 8)]
    assert after == pytest.approx(sum(sum(b) / len(b) for b in batches) / len(batches), abs=1e-6)


@pytest.mark.launch
def test_a_reward_model_trains_under_zero3_as_on_one_process(judge, tmp_path):
    """2 processes under ZeRO-3 (the classifier's weights and its score head partitioned, gathered for the export),
    4 pairs each: the 1-process run's loss at every logged step and its exported weights."""
    out = tmp_path / "run"
    check(launch("zero3", "qwen3_reward", *FLAGS, "--per_device_train_batch_size", "4", "--output_dir", str(out),
                 cwd=tmp_path))  # fmt: skip
    assert len(logged(judge, "loss")) == 20 and logged(out, "loss") == pytest.approx(logged(judge, "loss"), rel=1e-4)
    ours, reference = load_file(out / "model.safetensors"), load_file(judge / "model.safetensors")
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-3, atol=5e-5, msg=name)


def test_a_pair_is_one_example(judge):
    """The tracker counts pairs, not the 16 sequences a batch of 8 holds (the planner's 2 sequences a sample)."""
    rows = [json.loads(line) for line in (judge / "run_log.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "samples_per_second" in row and "step_seconds" in row]
    assert steps and all(row["samples_per_second"] * row["step_seconds"] == pytest.approx(8, rel=0.01)
                         for row in steps)  # fmt: skip
    assert task_workload("reward", lora=False) == {"fused_head": False, "sequences_per_sample": 2}  # no reference
    card = (judge / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "- reward" in card


def test_toolkit_eval_scores_both_models_as_the_run_did(judge):
    """`toolkit eval` on a reward run: each model's held-out accuracy and margin, TRL's evaluation on the run's
    pairs, equal to the run's own at step 0 (the base model, its new head seeded as the run's was) and at its end
    (the export); the table reuses those, and the card carries the run's."""
    from toolkit.results.card import figure
    from toolkit.results.evaluation import evaluate_run, load
    from toolkit.results.held_out_pairs import held_out_pairs
    from toolkit.results.record import RunRecord

    record = RunRecord.read(judge)
    held_out = held_out_pairs_of_the_tiny_runs()
    for which, at in (("base", 0), ("tuned", -1)):
        model, tokenizer = load(record, which)
        found = held_out_pairs(record, model, tokenizer, held_out)
        assert found == pytest.approx({k: logged(judge, f"eval_{k}")[at] for k in ("accuracy", "margin")}, abs=1e-5)
    rows = {(r["metric"], r["base"], r["tuned"]) for r in evaluate_run(judge)["results"]}
    assert {m for m, *_ in rows} == {"accuracy", "margin"}
    assert ("accuracy", logged(judge, "eval_accuracy")[0], logged(judge, "eval_accuracy")[-1]) in rows
    summary = json.loads((judge / "run_summary.json").read_text())["summary"]
    assert f"| eval accuracy | {figure(summary['eval_accuracy'])} |" in (judge / "README.md").read_text()


def test_grpo_takes_the_reward_model_beside_a_checker(judge, tmp_path):
    """The export named as a reward (its folder), weighted 0.5 beside the accuracy checker: TRL scores each
    completion with it, logs its mean and spread under the folder's name, and the step's reward is the weighted
    sum of the two means; the run's memory plan counts the reward model's weights."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "grpo"
    train(GRPO, ["--tiny", "--max_steps", "2", "--report_to", "none", "--output_dir", str(out), "--reward_funcs",
                 f"accuracy,{judge}", "--reward_weights", "1,0.5"], "smollm2_grpo")  # fmt: skip
    learned, checked = logged(out, "rewards/judge/mean"), logged(out, "rewards/accuracy/mean")
    assert len(learned) == 2 and all(std > 0 for std in logged(out, "rewards/judge/std"))
    for total, a, b in zip(logged(out, "reward"), checked, learned, strict=True):
        assert total == pytest.approx(a + 0.5 * b, rel=1e-5, abs=1e-6)
    # the plan holds the reward model beside the policy: its weights as TRL loaded them (fp32, as saved)
    plan = json.loads((out / "run_summary.json").read_text())["config"]["memory_plan"]["device"]
    model = AutoModelForSequenceClassification.from_pretrained(judge)
    assert model.dtype == torch.float32
    assert plan["reward_models"] == sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_plan_of_a_reward_model_measures_its_pairs(capsys):
    """`toolkit plan qwen3_reward`: the activations measured on the sequence classifier itself (it failed without a
    padding id, Qwen3's config has none, and fell back to the formula), two sequences a pair, no reference model."""
    from toolkit.planner.cli import main

    argv = ["qwen3_reward", "--gpu", "H100-80GB", "--gpus", "8", "--tokens_per_sample", "600"]
    assert main(argv) == 0
    assert "activations measured: the bytes autograd saves" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["workload"]["sequences_per_sample"] == 2 and not plan["workload"]["reference_weights"]


@pytest.mark.parametrize(("config", "shards"), [("ddp", 1), ("zero2", 1), ("zero3", 8), ("fsdp2", 8)])
def test_a_grpo_plan_places_its_reward_models_as_trl_does(config, shards):
    """TRL holds a reward model whole on every device (DDP, ZeRO-1/2: DeepSpeed's stage 0 for it) or sharded where
    the policy's parameters are (ZeRO-3 partitions it, FSDP wraps it), as the reference model: 8 GPUs."""
    from conftest import ROOT

    from toolkit.planner import Layout, Shape, Workload, meta_model, plan_memory

    model = tiny.stored_config("Qwen/Qwen3-0.6B")
    shape = Shape.of(meta_model(model, "sft"), model)
    layout = Layout.from_file(ROOT / "accelerate_configs" / f"{config}.yaml")
    work = Workload(reward_model_bytes=1_199_570_944)  # Qwen3-0.6B's 599,785,472 bf16 weights
    assert plan_memory(shape, layout, work, 8).device["reward_models"] == 1_199_570_944 // shards
    assert "reward_models" not in plan_memory(shape, layout, Workload(), 8).device


def test_the_base_model_of_a_new_head_is_the_one_the_run_started_from(tmp_path, capsys):
    """A reward model from a language model's checkpoint starts with a new, random score head: `toolkit eval`'s base
    model gets the head the run started with (seeded as the runner seeds its load), so its held-out figures are
    the run's own at step 0, not another random head's."""
    from toolkit.results.evaluation import load
    from toolkit.results.held_out_pairs import held_out_pairs
    from toolkit.results.record import RunRecord

    causal = tiny.tiny_checkpoint("Qwen/Qwen3-0.6B", "sft")  # no score head
    out = tmp_path / "judge"
    train(REWARD, [*FLAGS, "--model_name_or_path", str(causal), "--max_steps", "1", "--output_dir", str(out)],
          "qwen3_reward")  # fmt: skip
    assert "batch         8 pairs per device x 1 accumulation" in capsys.readouterr().out  # the header counts pairs
    record = RunRecord.read(out)
    torch.manual_seed(1234)  # whatever the process drew before
    model, tokenizer = load(record, "base")
    held_out = held_out_pairs_of_the_tiny_runs()
    found = held_out_pairs(record, model, tokenizer, held_out)
    assert found["margin"] == pytest.approx(logged(out, "eval_margin")[0], abs=1e-5)
