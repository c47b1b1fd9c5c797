"""fp32 master weights, on a real checkpoint: 16-bit weights updated in place at a fine-tuning learning rate lose
most AdamW updates (below bf16's resolution); the toolkit's optimizer keeps fp32 masters where no engine does,
beside bf16 compute weights, plans their memory, resumes them exactly, and the header says what is in effect."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from smollm2_chat import RECIPE as SMOLLM2_CHAT

from toolkit import train
from toolkit.data.sources import resolve


def test_master_weights_keep_the_updates_bf16_would_lose(tmp_path, capsys):
    """SmolLM2-135M, every weight trained (no LoRA), llama3_fft's learning rate 2e-5, bf16 weights and bf16
    compute, one AdamW step: the optimizer's fp32 masters take every update; the same update applied to the bf16
    weights leaves most of them where they were (measured here, printed). The compute weights and the residual
    stream stay bf16 (no per-forward casts, no fp32 activations), the masters and AdamW's states are fp32. Two rows
    a step: AdamW's first step moves each weight by about the learning rate whatever the batch, and each row costs
    seconds where bf16 is emulated (AVX2)."""
    flags = ["--use_lora", "false", "--dtype", "bfloat16", "--bf16", "true", "--learning_rate", "2e-5",
             "--warmup_steps", "0", "--max_steps", "1", "--per_device_train_batch_size", "2",
             "--eval_fraction", "0", "--eval_on_start", "false", "--generation_samples", "0",
             "--eval_after_training", "false", "--report_to", "none", "--output_dir", str(tmp_path)]  # fmt: skip
    trainer = train(SMOLLM2_CHAT, flags, "smollm2_chat").trainer
    header = "precision     bf16, weights bfloat16, bf16 weights and compute, fp32 master weights in the optimizer step"
    assert header + "\n" in capsys.readouterr().out
    start = load_file(f"{resolve(SMOLLM2_CHAT['model_name_or_path'])}/model.safetensors")
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    masters = trainer.masters
    assert len(masters.masters) == len(names)
    total = unmoved = lost_in_bf16 = 0
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around torch's AdamW
    for weight, master in zip(masters.weights, masters.masters, strict=True):
        name = names[id(weight)]
        assert weight.dtype == torch.bfloat16 and master.dtype == torch.float32, name
        assert {t.dtype for t in optimizer.state[master].values() if t.dim()} == {torch.float32}, name
        assert torch.equal(weight, master.to(torch.bfloat16)), name  # what the next forward computes with
        loaded = start[name].to(torch.bfloat16).float()  # as the run loaded it
        update = master.detach() - loaded
        total += update.numel()
        unmoved += int((update == 0).sum())
        lost_in_bf16 += int(((loaded + update).to(torch.bfloat16).float() == loaded).sum())
    print(f"share of updates lost: {unmoved / total:.4%} with fp32 masters, {lost_in_bf16 / total:.2%} in bf16")
    assert unmoved / total < 0.01  # tied embeddings: the head's gradient reaches every row
    assert lost_in_bf16 / total > 0.5

    dtypes = []  # the residual stream between layers, under the Trainer's own autocast
    hook = trainer.model.model.layers[0].register_forward_hook(lambda m, i, out: dtypes.append(out[0].dtype))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    with torch.no_grad(), trainer.autocast_smart_context_manager():
        trainer.model(**{k: v for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask")})
    hook.remove()
    assert dtypes == [torch.bfloat16]

    # The plan is what the run holds: bf16 weights, fp32 masters and fp32 Adam states for every trainable weight.
    held, plan = trainer.held_bytes(), trainer.memory_plan.device
    assert plan["parameters"] == held["param_bytes"] == 2 * trainer.param_counts.total
    assert plan["master_weights"] == held["master_bytes"] == 4 * trainer.param_counts.total
    assert plan["optimizer_states"] == held["optimizer_state_bytes"] == 8 * trainer.param_counts.total


@pytest.mark.launch
def test_generation_under_fsdp1_gathers_the_root_units_parameters(tmp_path):
    """FSDP1 (GPU only in the toolkit's runs; torch's FSDP1 runs on CPU over gloo with device_id cpu): `generate`
    on the wrapped model goes around the root unit's forward, so its own parameters (embeddings, final norm) stay
    sharded, and generation fails; with them gathered (root_unsharded, which GenerationSamples uses) it gives the
    unwrapped model's tokens."""
    from conftest import BIN, ROOT, check, free_port, run_cmd

    from toolkit.models import tiny

    out = tmp_path / "outcome.json"
    checkpoint = tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft")
    check(run_cmd([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                   str(ROOT / "tests" / "fsdp1_generation.py"), str(checkpoint), str(out)], cwd=tmp_path))  # fmt: skip
    outcome = json.loads(out.read_text())
    assert outcome["gathered"] == outcome["reference"]
    assert outcome["bypassed"] != outcome["reference"], outcome["bypassed"]


@pytest.mark.parametrize("version", ["1", "2"])
def test_receiving_ranks_placeholders_take_rank_0s_dtype_when_fsdp_sends_it(version, monkeypatch, tmp_path):
    """RAM-efficient FSDP loading of a bf16 checkpoint under bf16 mixed precision: rank 0 loads bf16 weights; FSDP1
    broadcasts them as loaded (sync_module_states, at wrapping, before accelerate's upcast), FSDP2 once accelerate
    has upcast the trainable ones to fp32. The other ranks' placeholders take that dtype, tensor by tensor (they were
    fp32 under FSDP1 too: its flat parameters could not agree)."""
    from toolkit.distributed.launch import weights_arrive_upcast
    from toolkit.models import tiny
    from toolkit.models.loading import allocate_placeholders, load_model
    from toolkit.settings.model_arguments import ModelArguments

    checkpoint = tmp_path / "bf16"
    source = tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(source)
    monkeypatch.setenv("FSDP_VERSION", version)
    args = ModelArguments(model_name_or_path=str(checkpoint), dtype="auto")
    rank0 = dict(load_model(args, "sft", tokenizer, None).named_parameters())
    receiving = load_model(args, "sft", tokenizer, None, on_meta=True)
    allocate_placeholders(receiving, upcast=weights_arrive_upcast(mixed_precision=True))
    sent = {name: torch.float32 if version == "2" and p.requires_grad else p.dtype for name, p in rank0.items()}
    assert {name: p.dtype for name, p in receiving.named_parameters()} == sent
    assert set(sent.values()) == {torch.bfloat16 if version == "1" else torch.float32}


def test_a_bf16_run_resumes_its_masters_exactly(tmp_path):
    """A tiny Llama saved in bf16, trained in bf16 with the optimizer's fp32 masters: saved at step 3 and resumed,
    it ends bit-identical with the uninterrupted run, weights and masters, since the masters travel in the
    optimizer's state dict (re-derived from the saved bf16 weights, they would lose every update below bf16's
    resolution and drift)."""
    from llama3_fft import RECIPE
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.models import tiny
    from toolkit.training.precision import STATE_KEY

    source = tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B", "sft")
    checkpoint = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(source).save_pretrained(checkpoint)
    flags = ["--tiny", "--model_name_or_path", str(checkpoint), "--dtype", "bfloat16", "--bf16", "true",
             "--learning_rate", "2e-5", "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3",
             "--report_to", "none"]  # fmt: skip
    whole = train(RECIPE, [*flags, "--output_dir", str(tmp_path / "whole")], "llama3_fft").trainer
    saved = torch.load(tmp_path / "whole" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert [m.dtype for m in saved[STATE_KEY]] == [torch.float32] * len(whole.masters.masters)
    resumed = train(RECIPE, [*flags, "--output_dir", str(tmp_path / "resumed"), "--resume",
                             str(tmp_path / "whole" / "checkpoint-3")], "llama3_fft").trainer  # fmt: skip
    for a, b in zip(whole.masters.masters + whole.masters.weights,
                    resumed.masters.masters + resumed.masters.weights, strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert {w.dtype for w in resumed.masters.weights} == {torch.bfloat16}
