"""SFT evaluation: assistant-token accuracy and perplexity beside the loss, and answers to held-out prompts at each
evaluation, under sharded models too (every rank takes part in each forward)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import check, exported_weights, launch
from llama3_fft import RECIPE as LLAMA3_FFT
from safetensors.torch import load_file

from toolkit import train
from toolkit.__main__ import entry
from toolkit.data.packing import IGNORE_INDEX
from toolkit.metrics.samples import read_samples

EVALUATED = ["--tiny", "--max_steps", "4", "--eval_fraction", "0.1", "--max_eval_samples", "32",
             "--eval_on_start", "true", "--generation_samples", "2", "--generation_max_new_tokens", "8",
             "--report_to", "none", "--packing", "false"]  # fmt: skip
# The best model kept and exported: the tiny Llama's eval loss falls clearly between the evaluations at steps 2 and
# 4 (5.90 -> 5.82 at its 2e-3), far beyond the 1-vs-2-process difference: "greater is better" makes the first one
# the best, a checkpoint that is not the last, which rotation (save_total_limit 1) would otherwise delete.
BEST = ["--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
        "--save_total_limit", "1", "--load_best_model_at_end", "true", "--metric_for_best_model", "loss",
        "--greater_is_better", "true"]  # fmt: skip
GLOBAL_BATCH = 16  # the sharded runs' 2 x 8
# The samples' steps: before training, each evaluation, and the final one, of the exported (best) model
STEPS = [0, 0, 2, 2, 4, 4, 4, 4]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    flags = [*EVALUATED, *BEST, "--per_device_train_batch_size", str(GLOBAL_BATCH), "--output_dir", str(out)]
    return train(LLAMA3_FFT, flags, "llama3_fft"), out


def test_token_accuracy_and_perplexity_are_what_they_say(one_process):
    """eval_token_accuracy: the share of label tokens the model's argmax predicts; eval_perplexity: exp of the mean
    negative log-likelihood over those tokens; eval_answer_accuracy: the share of rows whose every label token the
    argmax predicts. All recomputed here row by row from the saved model."""
    result, out = one_process
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    right = total = answered = rows = 0
    nll = 0.0
    for row in result.trainer.eval_dataset:
        with torch.no_grad():
            logits = model(torch.tensor([row["input_ids"]])).logits[0, :-1]
        labels = torch.tensor(row["labels"][1:])
        trained = labels != IGNORE_INDEX
        right += int((logits.argmax(-1)[trained] == labels[trained]).sum())
        nll += float(torch.nn.functional.cross_entropy(logits[trained], labels[trained], reduction="sum"))
        total += int(trained.sum())
        answered += bool((logits.argmax(-1)[trained] == labels[trained]).all())
        rows += 1
    metrics = result.metrics
    assert metrics["eval_answer_accuracy"] == pytest.approx(answered / rows, abs=1e-9)
    assert metrics["eval_token_accuracy"] == pytest.approx(right / total, abs=1e-9)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(nll / total), rel=1e-5)


def test_samples_at_each_evaluation(one_process):
    _, out = one_process
    samples = read_samples(out)
    assert [s["step"] for s in samples] == STEPS  # before training, and each evaluation
    assert all(s["messages"][-1]["role"] == "user" and s["reference"] for s in samples)


@pytest.mark.launch
@pytest.mark.parametrize("config", ["zero3", "fsdp2"])
def test_sharded_evaluation_and_samples_equal_one_process(config, one_process, tmp_path, capsys):
    """2 processes under ZeRO-3 and FSDP2: before training (the same weights), the held-out perplexity, token
    accuracy and greedy answers equal the 1-process run's, every rank having generated with the sharded model.
    (The Trainer's eval_loss, a mean of batch means, does not: it moves with how the rows are batched.) The data,
    prepared beforehand by `python -m toolkit prepare`, comes from the cache: the launch tokenizes nothing.
    load_best_model_at_end under their own checkpoint formats and loaders: the "best" is the first evaluation's
    (the higher loss, greater_is_better), checkpoint-2 is kept, and the exported model is its weights, as the
    1-process run with the same global batch gets them."""
    reference, reference_out = one_process
    out = tmp_path / "run"
    assert entry("prepare")(["llama3_fft", *EVALUATED]) == 0
    prepared = capsys.readouterr().out
    launched = check(launch(config, "llama3_fft", *EVALUATED, *BEST, "--per_device_train_batch_size",
                            str(GLOBAL_BATCH // 2), "--output_dir", str(out), cwd=tmp_path))  # fmt: skip
    folder = re.search(r"(?:kept in|from the cache) (\S+)", prepared).group(1)
    assert re.search(rf"data          \S+ \(messages, detected\); from the cache {re.escape(folder)}", launched.stdout)
    samples, expected = read_samples(out), read_samples(reference_out)
    assert [s["step"] for s in samples] == STEPS
    assert [s["answer"] for s in samples[:2]] == [s["answer"] for s in expected[:2]]
    logged = [line for line in reference.trainer.state.log_history if line.get("step") == 0 and "eval_loss" in line]
    ours = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
    ours = [line for line in ours if line.get("step") == 0 and "eval_loss" in line]
    for key in ("eval_perplexity", "eval_token_accuracy"):
        assert ours[0][key] == pytest.approx(logged[0][key], rel=1e-4), key

    # The best model: checkpoint-2 kept through rotation, loaded at the end and exported, as on 1 process.
    assert "Could not locate the best model" not in launched.stderr + launched.stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(out / "checkpoint-2")
    best = load_file(reference_out / "checkpoint-2" / "model.safetensors")  # 1 process exported its best, exactly
    assert all(torch.equal(value, best[name]) for name, value in load_file(reference_out / "model.safetensors").items())
    exported = exported_weights(reference_out, "llama3_fft")
    for name, value in exported_weights(out, "llama3_fft").items():
        torch.testing.assert_close(value, exported[name], rtol=1e-3, atol=2e-4, msg=name)
