"""A mixture of experts' load-balancing loss at the coefficient the user set, on N processes as on one.

The recipe's tiny Qwen3-MoE routes each token to 2 of its 4 experts, with the recipe's coefficient 0.001. The
Trainer once multiplied the whole loss, the family's `c x aux` in it, by the processes and left it undivided by the
accumulation steps: 2 processes x 2 steps made c act as 4c, and pipeline stages dropped the term (issue 65)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import check, logged, reference_run
from safetensors.torch import load_file
from test_pipeline import toolkit_launch

from toolkit.models import tiny
from toolkit.models.balance import balance_loss, routing_sums

RECIPE, COEF = "qwen3_moe_fft", 0.001
FLAGS = ["--tiny", "--report_to", "none", "--max_steps", "4", "--logging_steps", "1", "--save_strategy", "no"]
# Each micro-batch's routers are balanced over its own tokens (training/load_balance.py): 2-row or 4-row
# micro-batches' mean aux differs from the 8-row batch's by ~0.5% of aux (~0.01), c x that ~1e-5 a step, and the
# weights that difference moves add as much again over 4 AdamW steps (measured: at most 2e-5); the coefficient
# doubled moves the loss by c x aux ~ 2e-3. Real tokens only: pipeline stages pad every row to max_seq_length, and
# a packed batch reaches the model without its mask; balanced with the padding, the pipeline's run was 1.2e-4 off.
BOUND = 5e-5
# Evaluated during the run (its held-out rows, at its last step and its end) and afterwards by `toolkit eval`
EVALUATED = ["--tiny", "--report_to", "none", "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "no",
             "--eval_fraction", "0.2", "--max_eval_samples", "16", "--eval_strategy", "steps", "--eval_steps",
             "2"]  # fmt: skip
HELD_OUT = ("perplexity", "token_accuracy")


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The exported weights (a pipeline's stages write one file each)."""
    return {k: v for file in sorted(run.glob("model*.safetensors")) for k, v in load_file(file).items()}


def distance(ours: dict, theirs: dict) -> float:
    """Over the weights both name alike (the routers, attention, norms: one process exports the experts under
    transformers' per-expert names, pipeline stages their fused tensors)."""
    return float(
        torch.cat([(ours[k].float() - theirs[k].float()).flatten() for k in sorted(ours.keys() & theirs.keys())]).norm()
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[float, Path]:
    """One process, the global batch of 8 in one forward, at c and at 2c (what 2 processes made of c, before)."""
    return {coef: reference_run(RECIPE, [*FLAGS, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps",
                                         "1", "--router_aux_loss_coef", str(coef)],
                                tmp_path_factory.mktemp(f"balance-{coef}"))
            for coef in (COEF, 2 * COEF)}  # fmt: skip


def test_the_tiny_moe_routes_and_its_balance_is_the_familys():
    """The sums the pipeline's stages pass on add up to transformers' own load-balancing loss, with and without an
    attention mask, and the tiny model routes (top-k below the experts), so the loss has a gradient to give."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = AutoModelForCausalLM.from_pretrained(tiny.tiny_checkpoint("Qwen/Qwen3-30B-A3B", "sft"))
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    assert top_k < experts
    ids = torch.randint(1, 400, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    logits = model(input_ids=ids, output_router_logits=True).router_logits
    for given in (None, mask):
        whole = load_balancing_loss_func(logits, experts, top_k, given)
        by_layer = sum(routing_sums(logits[i : i + 1], experts, top_k, given) for i in range(len(logits)))
        torch.testing.assert_close(balance_loss(by_layer), whole)


@pytest.mark.launch
@pytest.mark.parametrize("config", ["fsdp2", "fsdp2_ep", "zero3", "pp"])
def test_the_balance_loss_is_the_one_process_runs(config, one_process, tmp_path):
    """2 processes, 2 accumulation steps, the same global batch of 8: the losses and the weights after 4 steps
    are the 1-process run's at c within what per-micro-batch balancing makes (BOUND), far nearer it than the run at
    2c; the aux loss and the routers' figures are in the run's log, as on one process."""
    per_device = "4" if config == "pp" else "2"  # a pipeline's stages share their rows
    out = tmp_path / "run"
    check(toolkit_launch(config, RECIPE, *FLAGS, "--per_device_train_batch_size", per_device,
                         "--gradient_accumulation_steps", "2", "--output_dir", str(out), cwd=tmp_path,
                         processes=2))  # fmt: skip
    ours, at_c, at_2c = (torch.tensor(logged(run, "loss")) for run in (out, one_process[COEF], one_process[2 * COEF]))
    assert len(ours) == 4 and (ours - at_c).abs().max() < BOUND, (ours - at_c).tolist()
    assert (ours - at_c).abs().sum() < 0.1 * (ours - at_2c).abs().sum()
    moved = weights(out)
    assert distance(moved, weights(one_process[COEF])) < 0.5 * distance(moved, weights(one_process[2 * COEF]))
    aux = logged(out, "aux_loss")
    assert aux == pytest.approx(logged(one_process[COEF], "aux_loss"), rel=0.02) and len(aux) == 4
    # the routers' figures, counted over every rank's real tokens (a pipeline's stages: each its own layers'; its
    # schedule's first step, which also runs torch's shape inference, uncounted), as on one process
    for key in ("router_imbalance", "router_load_entropy", "router_busiest_share"):
        assert logged(out, key)[-3:] == pytest.approx(logged(one_process[COEF], key)[-3:], rel=0.02), key


def evaluated_afresh(run: Path, copy: Path) -> dict[str, float]:
    """The exported model's held-out figures as `toolkit eval RUN --tasks held-out` computes them (the run's own
    evaluations left out of a copy of its log, which the command would otherwise read); the base model's too."""
    from toolkit.results.evaluation import evaluate_run

    shutil.copytree(run, copy)
    log = copy / "run_log.jsonl"
    log.write_text("".join(f"{line}\n" for line in log.read_text().splitlines() if '"eval_loss"' not in line))
    return {r["metric"]: r["tuned"] for r in evaluate_run(copy, "held-out")["results"]}


@pytest.mark.parametrize("recipe", ["qwen3_moe_fft", "qwen3_moe_lora"])
def test_a_moe_with_its_balance_term_evaluates(recipe, tmp_path):
    """Its forward returns `aux_loss` before its logits, and the Trainer's prediction_step hands the metrics every
    output in that order: the recipes' first evaluation (their step 500) took the 0-dim `aux_loss` for the logits
    and died, as did `toolkit eval` of the export, whose config keeps output_router_logits. Now it evaluates during
    the run, and `toolkit eval` computes the figures the run logged."""
    out = reference_run(recipe, EVALUATED, tmp_path / "run")
    if recipe == "qwen3_moe_fft":
        assert json.loads((out / "config.json").read_text())["output_router_logits"] is True
    assert logged(out, "aux_loss")
    fresh = evaluated_afresh(out, tmp_path / "fresh")
    for figure in HELD_OUT:
        assert fresh[figure] == pytest.approx(logged(out, f"eval_{figure}")[-1], rel=1e-5), figure


@pytest.mark.launch
def test_a_moe_with_its_balance_term_evaluates_on_2_processes(tmp_path):
    """The same on 2 processes (fsdp2.yaml, as the LoRA recipe runs): every rank's predictions gathered, the logits
    alone; then `toolkit eval` of its export."""
    out = tmp_path / "run"
    result = check(toolkit_launch("fsdp2", "qwen3_moe_lora", *EVALUATED, "--output_dir", str(out), cwd=tmp_path,
                                  processes=2))  # fmt: skip
    assert "strategy      FSDP, 2 process(es)" in result.stdout and logged(out, "aux_loss")
    fresh = evaluated_afresh(out, tmp_path / "fresh")
    for figure in HELD_OUT:
        assert fresh[figure] == pytest.approx(logged(out, f"eval_{figure}")[-1], rel=1e-5), figure
