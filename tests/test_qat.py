"""--qat int4: torchao's quantization-aware training. The fake quantizers round as torchao's int4 quantizer does
(so the weights train under the rounding they will get), they are on while the run trains, and the run saves plain
weights in its usual layout."""

from __future__ import annotations

import copy

import pytest
import torch
from llama3_fft import RECIPE as LLAMA3_FFT
from safetensors.torch import load_file

from toolkit import train
from toolkit.errors import ConfigError
from toolkit.models.qat import SCHEMES, prepare
from toolkit.settings.model_arguments import QAT_SCHEMES

SHORT = ["--tiny", "--max_steps", "3", "--report_to", "none", "--learning_rate", "1e-2"]


def tiny_llama(hidden: int = 64):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def test_the_fake_quantizers_round_as_torchaos_int4_quantizer_does():
    """The QAT model's forward is the forward of the same weights quantized to int4 by torchao's own PTQ (groups of
    32, symmetric), the head left as it is in both: what QAT trains under is what quantizing after it gives."""
    from torchao.quantization import quantize_

    assert set(SCHEMES) == set(QAT_SCHEMES)
    model = tiny_llama()
    quantized = copy.deepcopy(model)
    head = quantized.get_output_embeddings()
    quantize_(quantized, SCHEMES["int4"](), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m is not head)
    plain = copy.deepcopy(model)
    assert prepare(model, "int4") == 2 * 7  # q, k, v, o, gate, up, down in each layer; not the head
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        faked, real, unquantized = (m(ids).logits for m in (model, quantized, plain))
    torch.testing.assert_close(faked, real, rtol=1e-4, atol=1e-4)  # fp32: the same rounding, another kernel
    assert (faked - unquantized).abs().max() > 1e-2  # and the rounding is there


def test_a_qat_run_trains_through_the_rounding_and_saves_plain_weights(tmp_path):
    """The same seed and data with and without --qat: the gradients differ (the rounding is in the forward), the
    saved files have the same tensors by name and shape (no quantizer state, no quantization config)."""
    import json

    train(LLAMA3_FFT, [*SHORT, "--output_dir", str(tmp_path / "plain")], "llama3_fft")
    train(LLAMA3_FFT, [*SHORT, "--qat", "int4", "--output_dir", str(tmp_path / "qat")], "llama3_fft")
    plain, qat = (load_file(tmp_path / name / "model.safetensors") for name in ("plain", "qat"))
    assert {k: v.shape for k, v in plain.items()} == {k: v.shape for k, v in qat.items()}
    moved = [k for k in plain if "proj" in k and not torch.equal(plain[k], qat[k])]
    assert moved and not torch.equal(plain["lm_head.weight"], qat["lm_head.weight"])
    assert "quantization_config" not in json.loads((tmp_path / "qat" / "config.json").read_text())


@pytest.mark.parametrize("flags", [["--use_lora", "true"], ["--load_in_4bit", "true", "--use_lora", "true"]])
def test_qat_refuses_weights_that_do_not_train(tmp_path, flags):
    with pytest.raises(ConfigError, match="drop --use_lora"):
        train(LLAMA3_FFT, [*SHORT, "--qat", "int4", *flags, "--output_dir", str(tmp_path / "x")], "llama3_fft")
    assert not (tmp_path / "x").exists()


def test_toolkit_eval_of_a_qat_run_scores_the_saved_weights_not_the_runs_fake_quantized_evaluations(tmp_path):
    """A QAT run evaluates through its fake quantizers (--eval_on_start: the base rounded to int4), so `toolkit eval`
    must not reuse those figures as it does a plain run's: the base it reports is the plain run's base, to the digit."""
    from toolkit.results.evaluation import evaluate_run

    flags = [*SHORT, "--eval_on_start", "true", "--eval_fraction", "0.2"]
    train(LLAMA3_FFT, [*flags, "--output_dir", str(tmp_path / "plain")], "llama3_fft")
    train(LLAMA3_FFT, [*flags, "--qat", "int4", "--output_dir", str(tmp_path / "qat")], "llama3_fft")
    plain, qat = (evaluate_run(tmp_path / name, "held-out") for name in ("plain", "qat"))
    assert plain["held_out_logged_at"] and not qat["held_out_logged_at"]  # the plain run's own figures are reused
    base = {r["metric"]: r["base"] for r in plain["results"]}
    assert {r["metric"]: r["base"] for r in qat["results"]} == pytest.approx(base, rel=1e-6)
