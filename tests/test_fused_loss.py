"""SFT's loss on TRL's fused head (--fused_loss, training/fused_loss.py) trains as the full logits' loss does: the
same losses and weights with packing and gradient accumulation, evaluation unchanged. The strategy matrix
(test_strategies.py) runs its 2-process SFT launches with it against plain 1-process references; the memory it
saves is checked against the plan in test_planner.py."""

from __future__ import annotations

import json

import pytest
import torch
from bert import RECIPE as BERT
from llama3_dpo import RECIPE as DPO
from llama3_fft import RECIPE as SFT
from safetensors.torch import load_file

from toolkit import train
from toolkit.errors import ConfigError
from toolkit.models import tiny
from toolkit.settings.tasks import fused_head


def test_fused_loss_and_gradients_equal_the_full_logits():
    """One forward and backward of a tiny Llama on packed rows (labels -100 at each conversation's start and on
    the prompts), through TRL's head and through the model's own loss: the loss and every parameter's gradient
    agree to float rounding."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft"))
    add_fused_lm_head(model)
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 96))
    position_ids = torch.cat([torch.arange(40), torch.arange(56)]).repeat(2, 1)  # two conversations a row
    labels = ids.masked_fill((position_ids < 8), -100)  # a prompt, and no label across the boundary
    grads = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(
            input_ids=ids,
            position_ids=position_ids,
            labels=labels,
            fused_lm_head=fused,
            use_cache=False,
            num_items_in_batch=int(labels[:, 1:].ne(-100).sum()),
        )  # fmt: skip  (use_cache: as PackedCollator)
        out.loss.backward()
        grads[fused] = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (plain_loss, plain), (fused_loss, fused) = grads[False], grads[True]
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-4, atol=2e-6, msg=name)  # measured: 9.5e-7 at most


def test_fused_loss_trains_as_the_full_logits(tmp_path):
    """Packed rows (each conversation's first token unscored), 2 micro-batches per step normalised by the
    Trainer's token count: each step's loss within 1e-5 of the full logits' run, the weights as close as the
    strategy matrix's, the evaluation (logits kept for its metrics) equal."""
    runs = {}
    for fused in ("false", "true"):
        out = tmp_path / fused
        flags = ["--tiny", "--max_steps", "4", "--gradient_accumulation_steps", "2", "--fused_loss", fused,
                 "--eval_strategy", "steps", "--eval_steps", "4", "--eval_fraction", "0.1", "--report_to", "none",
                 "--output_dir", str(out)]  # fmt: skip
        trainer = train(SFT, flags, "llama3_fft").trainer
        assert ("forward" in vars(trainer.model)) == (fused == "true")  # TRL's head patched onto the model
        assert ("fused_head" in trainer.memory_plan.device) == (fused == "true")
        rows = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
        runs[fused] = ([r["loss"] for r in rows if "loss" in r], [r["eval_loss"] for r in rows if "eval_loss" in r],
                       load_file(out / "model.safetensors"))  # fmt: skip
    (losses, evals, weights), (plain_losses, plain_evals, plain_weights) = runs["true"], runs["false"]
    assert len(losses) == 4 and losses == pytest.approx(plain_losses, rel=1e-5)
    assert evals and evals == pytest.approx(plain_evals, rel=1e-6)
    for name, value in plain_weights.items():
        # the strategy matrix's tolerance: Adam divides by the root of tiny second moments in the embedding rows of
        # rarely seen tokens, where a float-order difference shows (measured: 1.1e-4 there, 1.1e-6 on the head)
        torch.testing.assert_close(weights[name], value, rtol=1e-3, atol=2e-4, msg=name)


def test_fused_loss_where_it_applies(tmp_path):
    """On by default where TRL's kernels score a tile in place (a GPU), on request on a CPU; DPO's trainer always
    uses it; a classifier has no vocabulary head: asking for it there, or turning DPO's off, is one line."""
    assert fused_head("sft", None, on_gpu=True) and not fused_head("sft", None, on_gpu=False)
    assert fused_head("sft", True, on_gpu=False) and not fused_head("sft", False, on_gpu=True)
    assert fused_head("dpo", None, on_gpu=False) and not fused_head("classification", None, on_gpu=True)
    with pytest.raises(ConfigError, match="task classification has no such head: drop --fused_loss"):
        train(BERT, ["--tiny", "--fused_loss", "true", "--output_dir", str(tmp_path / "bert")], "bert")
    with pytest.raises(ConfigError, match="task dpo always scores with TRL's fused head"):
        model = tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "dpo")
        train(DPO, ["--tiny", "--fused_loss", "false", "--model_name_or_path", str(model)], "llama3_dpo")
