"""A mixture of experts in a run: its expert kernels (transformers' `experts_implementation`, the toolkit's
--experts_implementation): eager (each expert in turn), batched_mm and grouped_mm (one grouped matmul over every
expert) compute the same training step on Mixtral's and Qwen3-MoE's architectures, logits and every gradient; the
setting reaches the model and the run's header says which kernel ran; a name transformers does not register is one
line before any weight loads. Its routers' balance (metrics/routing.py) against the routers' own top-k."""

from __future__ import annotations

import math

import pytest
import torch
from test_bad_input import assert_one_clear_line

from toolkit import train
from toolkit.models import tiny
from toolkit.project import load_recipe

MOES = ["mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B"]
KERNELS = ["eager", "batched_mm", "grouped_mm"]


def step(folder, kernel: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of the tiny checkpoint with `kernel`: its logits and its parameters' gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation=kernel)
    assert model.config._experts_implementation == kernel
    outputs = model(input_ids=ids, labels=ids)
    outputs.loss.backward()
    return outputs.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MOES)
def test_every_expert_kernel_computes_the_same_step(name):
    folder = tiny.tiny_checkpoint(name, "sft")
    ids = torch.randint(1, 400, (2, 48), generator=torch.Generator().manual_seed(0))
    reference_logits, reference_grads = step(folder, "eager", ids)
    assert any("experts" in n for n in reference_grads)  # the experts' own weights are among them
    for kernel in KERNELS[1:]:
        logits, grads = step(folder, kernel, ids)
        torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5, msg=kernel)
        assert sorted(grads) == sorted(reference_grads)
        for n, grad in reference_grads.items():
            torch.testing.assert_close(grads[n], grad, rtol=1e-4, atol=1e-6, msg=f"{kernel} {n}")


def test_the_kernel_set_is_the_one_the_header_names(tmp_path, capsys):
    folder = tiny.tiny_checkpoint(MOES[0], "sft")
    data = tiny.write_tiny_dataset("sft")
    flags = ["--model_name_or_path", str(folder), "--dataset_name", str(data), "--train_split", "train",
             "--eval_split", "none", "--max_steps", "1", "--max_seq_length", "64", "--report_to", "none",
             "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
             "--save_strategy", "no"]  # fmt: skip
    for kernel in ("batched_mm", None):
        more = ["--experts_implementation", kernel] if kernel else []
        train(load_recipe("llama3_fft"), [*flags, *more, "--output_dir", str(tmp_path / str(kernel))], "llama3_fft")
        header = capsys.readouterr().out
        auto = " (auto: transformers' grouped_mm where it can run, else eager)"
        assert f"experts       2 of 4 routed experts, kernel {kernel or 'grouped_mm' + auto}\n" in header


def test_an_unknown_kernel_is_one_line_naming_transformers_own(monkeypatch, capsys):
    from toolkit import run

    monkeypatch.setattr("toolkit.models.loading.load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(SystemExit):
        run(load_recipe("llama3_fft"), ["--tiny", "--experts_implementation", "fast"], "llama3_fft")
    captured = capsys.readouterr()
    assert_one_clear_line(
        captured.out + captured.err,
        "experts_implementation 'fast' is not one of eager, deepgemm, batched_mm, grouped_mm",
    )


@pytest.mark.parametrize("name", MOES)
def test_router_health_counts_what_the_routers_chose(name):
    """The tokens each expert receives, counted at the experts' input, equal the routers' own top-k choices (read
    off each router's output here); the imbalance is the busiest expert's share times the experts, the load's entropy
    over log E, by hand; pairs sent to no expert counted apart."""
    from transformers import AutoModelForCausalLM

    from toolkit.metrics.routing import RouterStats

    model = AutoModelForCausalLM.from_pretrained(tiny.tiny_checkpoint(name, "sft"), dtype=torch.float32)
    stats = RouterStats.of(model)
    chosen = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
    assert len(routers) == len(stats.counts) == model.config.num_hidden_layers
    for router in routers:
        router.register_forward_hook(lambda module, args, out: chosen.append(out[-1]))  # (logits, scores, indices)
    ids = torch.randint(1, 400, (2, 48), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids)
    experts = stats.counts[0].numel() - 2  # and the pairs sent to no expert, and the tokens
    counts = torch.stack([torch.bincount(c.reshape(-1), minlength=experts) for c in chosen])
    k = model.config.num_experts_per_tok  # 2 of the tiny 4, both families
    assert k < experts and torch.equal(torch.stack(stats.counts)[:, :experts], counts)
    assert int(counts.sum()) == len(routers) * 96 * k and [int(row[-1]) for row in stats.counts] == [96] * len(routers)
    busiest = [int(row.max()) / 96 for row in counts]
    imbalance = [experts * int(row.max()) / int(row.sum()) for row in counts]
    entropy = [-sum(n / row.sum() * math.log(n / row.sum()) for n in row.tolist() if n) / math.log(experts)
               for row in counts]  # fmt: skip
    stats.counts[0][experts] += 3  # as a capacity's mark of three pairs sent nowhere (dropless here) would count
    figures = stats.metrics()
    assert figures["router_imbalance"] == pytest.approx(max(imbalance))
    assert figures["router_imbalance_mean"] == pytest.approx(sum(imbalance) / len(imbalance))
    assert figures["experts_idle"] == int((counts == 0).sum())
    assert figures["router_load_entropy"] == pytest.approx(min(entropy)) and figures["tokens_dropped"] == 3
    assert figures["router_busiest_share"] == pytest.approx(max(busiest))
    assert figures["router_busiest_layer"] == busiest.index(max(busiest))
    assert stats.metrics() == {}  # cleared: nothing routed since
    assert RouterStats.of(AutoModelForCausalLM.from_pretrained(tiny.tiny_checkpoint("meta-llama/Meta-Llama-3-8B",
                                                                                    "sft"))) is None  # fmt: skip


def test_a_collapsed_router_warns_in_one_line(tmp_path, capsys):
    """Mixtral's routers zeroed: every token's logits tie and go to experts 0 and 1, half of each layer's 4 idle.
    The run's log holds the figures and stderr one warning naming the load-balancing loss, once."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.tiny_checkpoint(MOES[0], "sft"), dtype=torch.float32)
    for module in model.modules():
        if type(module).__name__.endswith("Router"):
            torch.nn.init.zeros_(module.weight)
    model.save_pretrained(tmp_path / "collapsed")
    tiny.tiny_tokenizer(MOES[0], "sft").save_pretrained(tmp_path / "collapsed")
    saved = load_file(tmp_path / "collapsed" / "model.safetensors")  # under Mixtral's legacy names
    assert not saved["model.layers.0.block_sparse_moe.gate.weight"].any()
    flags = ["--model_name_or_path", str(tmp_path / "collapsed"), "--dataset_name", str(tiny.write_tiny_dataset("sft")),
             "--train_split", "train", "--eval_split", "none", "--max_steps", "2", "--logging_steps", "1",
             "--max_seq_length", "64", "--report_to", "none", "--per_device_train_batch_size", "2",
             "--gradient_accumulation_steps", "1", "--save_strategy", "no", "--learning_rate", "1e-9",
             "--output_dir", str(tmp_path / "run")]  # fmt: skip
    train(load_recipe("llama3_fft"), flags, "llama3_fft")
    rows = [json.loads(line) for line in (tmp_path / "run" / "run_log.jsonl").read_text().splitlines()]
    assert [row["experts_idle_share"] for row in rows if "loss" in row] == [0.5, 0.5]
    err = capsys.readouterr().err  # the warning once, after the progress bar's carriage return
    assert err.count("warning: router collapse") == 1
    assert (
        "warning: router collapse: 50% of one layer's experts got no token in the last logging interval: turn "
        "on the load-balancing loss (--router_aux_loss_coef 0.001, say), or lower the learning rate\n"
    ) in err


def uneven_conversations(folder) -> str:
    """A data set whose packed rows (64 tokens) hold one conversation each, of 40 to 60 tokens: in random order
    nearly every micro-batch pads its shorter rows, which a packed batch hands the model without its mask."""
    import json

    rows = [{"messages": [{"role": "user", "content": " ".join(f"What is {i} plus {j}?" for j in range(3 + i % 4))},
                          {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}]} for i in range(64)]  # fmt: skip
    path = folder / "uneven.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def first_step(folder, data: str, out, coef: str, *more: str) -> tuple[float, dict[str, torch.Tensor]]:
    """A 1-process fp32 run's first logged loss (one micro-batch of 2 packed rows) and that micro-batch, as the
    trainer's loss received it (a packed batch's mask beside it, and whether it asked for the fused head)."""
    import json

    from toolkit.training.load_balance import BalancedLoss

    batches, compute = [], BalancedLoss.compute_loss

    def seen(self, model, inputs, *args, **kwargs):
        if model.training:
            batch = {k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}
            batches.append({**batch, "fused_lm_head": torch.tensor(inputs.get("fused_lm_head", False))})
        return compute(self, model, inputs, *args, **kwargs)

    flags = ["--model_name_or_path", str(folder), "--dataset_name", data, "--train_split", "train",
             "--eval_split", "none", "--max_steps", "1", "--logging_steps", "1", "--max_seq_length", "64",
             "--report_to", "none", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
             "--train_sampling_strategy", "random", "--save_strategy", "no", "--dtype", "float32", "--bf16",
             "false", "--router_aux_loss_coef", coef, *more, "--output_dir", str(out)]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BalancedLoss, "compute_loss", seen)
        train(load_recipe("llama3_fft"), flags, "llama3_fft")
    return json.loads((out / "run_log.jsonl").read_text().splitlines()[0])["loss"], batches[0]


def family_losses(folder, batch: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """The batch's cross-entropy, and the family's load-balancing loss (Mixtral's `load_balancing_loss_func`) over
    its real tokens and over every token: transformers' own, from the checkpoint the run started from."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    real = batch.get("routing_mask", batch.get("attention_mask"))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True)
    labels = batch["labels"][:, 1:].reshape(-1)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(labels.numel(), -1), labels, ignore_index=-100)
    experts, top_k = model.config.num_local_experts, model.config.num_experts_per_tok
    aux = [load_balancing_loss_func(out.router_logits, experts, top_k, mask) for mask in (real, None)]
    return float(ce), float(aux[0]), float(aux[1])


def test_the_load_balancing_loss_is_a_setting_said_in_the_header(tmp_path, capsys, monkeypatch):
    """--router_aux_loss_coef turns on the family's own load-balancing loss (its router logits requested) at that
    coefficient: the header says so and the first step's loss is the cross-entropy plus c x the family's loss over
    the batch's real tokens, both computed by transformers alone from the batch; on a dense model the setting is
    one line before any weight loads."""
    from toolkit import run

    folder = tiny.tiny_checkpoint(MOES[0], "sft")
    data = uneven_conversations(tmp_path)
    losses = {}
    for coef in ("0", "0.5"):
        losses[coef], batch = first_step(folder, data, tmp_path / coef, coef)
        header = capsys.readouterr().out
        assert ("load-balancing loss x 0.5\n" in header) == (coef == "0.5")
    ce, aux, _ = family_losses(folder, batch)
    assert losses["0"] == pytest.approx(ce, abs=1e-5)
    assert losses["0.5"] - losses["0"] == pytest.approx(0.5 * aux, abs=1e-5)  # aux: about 2 for 2 of 4 experts

    monkeypatch.setattr("toolkit.models.loading.load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(SystemExit):
        run(load_recipe("llama3_fft"), ["--tiny", "--router_aux_loss_coef", "0.01"], "llama3_fft")
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, "llama has no load-balancing loss")


@pytest.mark.parametrize("more", [["--label_smoothing_factor", "0.1"], ["--fused_loss", "true"]],
                         ids=["label_smoothing", "fused_head"])  # fmt: skip
def test_the_balance_term_holds_under_label_smoothing_and_the_fused_head(more, tmp_path):
    """The first step's loss at c is the same step's at 0 plus c x the family's load-balancing loss over the real
    tokens. With label smoothing the Trainer keeps the labels from the model, which then adds no term: the term was
    absent. TRL's fused head (the default on a GPU) returned no router logits: a packed batch's padding was
    balanced too."""
    folder = tiny.tiny_checkpoint(MOES[0], "sft")
    data = uneven_conversations(tmp_path)
    losses = {}
    for coef in ("0", "0.5"):
        losses[coef], batch = first_step(folder, data, tmp_path / coef, coef, *more)
    assert bool(batch["fused_lm_head"]) == ("--fused_loss" in more)
    _, real, every = family_losses(folder, batch)
    assert abs(real - every) > 1e-3  # the batch pads: balancing its padding too is told apart
    assert losses["0.5"] - losses["0"] == pytest.approx(0.5 * real, abs=1e-5)


def test_an_image_text_moe_takes_the_load_balancing_loss(tmp_path):
    """An image-text MoE (a toy Qwen3-VL-MoE: 2 of 4 experts) reads the load-balancing settings from its text config,
    where from_pretrained's keywords set the outer one: --router_aux_loss_coef failed on the keyword as the weights
    loaded, and a rank building the model on the meta device kept no term. Both now see it, and the forward adds
    c x the family's loss."""
    from types import SimpleNamespace

    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from toolkit.models.balance import balance_settings
    from toolkit.models.loading import load_model
    from toolkit.settings.model_arguments import ModelArguments

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    text = dict(vocab_size=400, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                rope_parameters=rope)  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path
    )
    args = ModelArguments(model_name_or_path=str(tmp_path), dtype="float32", router_aux_loss_coef=0.5)
    tokenizer = SimpleNamespace(pad_token_id=0)  # all load_model reads of it
    on_meta = load_model(args, "vlm_sft", tokenizer, None, on_meta=True)
    assert balance_settings(on_meta.config) == (0.5, 4, 2)
    model = load_model(args, "vlm_sft", tokenizer, None)
    assert balance_settings(model.config) == (0.5, 4, 2)
    ids = torch.randint(1, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 400), ids[:, 1:].reshape(-1))
    aux = load_balancing_loss_func(out.router_logits, 4, 2)
    torch.testing.assert_close(out.loss, ce + 0.5 * aux)


def test_lora_on_fused_experts_trains_them_and_refuses_dropout(tmp_path, monkeypatch, capsys):
    """qwen3_moe_lora: "all-linear" adapts the fused experts' 3-D weights too (peft's adapters on parameters), and
    their adapters train; peft takes no dropout there, which was its traceback after the weights loaded: one line
    before, naming --lora_dropout 0."""
    from toolkit import run

    flags = ["--tiny", "--max_steps", "1", "--report_to", "none", "--save_strategy", "no"]
    trainer = train(load_recipe("qwen3_moe_lora"), [*flags, "--output_dir", str(tmp_path)], "qwen3_moe_lora").trainer
    adapted = {n for n, p in trainer.model.named_parameters() if p.requires_grad and "experts" in n}
    assert any("lora_A" in n for n in adapted) and any("lora_B" in n for n in adapted)
    assert all(trainer.model.get_parameter(n).any() for n in adapted if "lora_B" in n)  # zeros at the start
    capsys.readouterr()
    monkeypatch.setattr("toolkit.models.loading.load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(SystemExit):
        run(load_recipe("qwen3_moe_lora"), [*flags, "--lora_dropout", "0.05"], "qwen3_moe_lora")
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, "peft's adapters on parameters take no dropout: pass "
                                                       "--lora_dropout 0")  # fmt: skip


def test_batched_mm_at_a_training_batch_is_refused_before_the_weights(monkeypatch, capsys):
    """transformers' batched_mm copies each token's k experts' weights: bench/mfu.py's moe_batched row (Qwen3-30B-A3B's
    layer, 2 x 4,096 tokens) asked an H200 for 384.00 GiB at its gate/up gather (torch's out-of-memory message,
    2026-11-28), the formula's gate/up share; a run needing more than its device holds is one line, no weights."""
    import sys

    from conftest import ROOT
    from transformers import Qwen3MoeConfig

    from toolkit import run
    from toolkit.models.model_checks import gathered_expert_bytes

    sys.path.insert(0, str(ROOT / "bench"))
    from mfu import QWEN3_MOE_SMALL

    gathered = gathered_expert_bytes(Qwen3MoeConfig(**QWEN3_MOE_SMALL), "sft", 2 * 4096, 2)
    assert gathered * 2 / 3 == 384 * 2**30  # gate/up: 2 x 768 of each expert's 3 x 768 rows of 2,048
    monkeypatch.setattr("toolkit.checks.device_memory", lambda: 2**20)
    monkeypatch.setattr("toolkit.models.loading.load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(SystemExit):
        run(load_recipe("qwen3_moe_fft"), ["--tiny", "--experts_implementation", "batched_mm"], "qwen3_moe_fft")
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, "batched_mm copies each token's experts' weights")
    assert "use grouped_mm (auto's choice on a GPU) or eager" in captured.err


def test_a_router_sending_most_tokens_to_one_expert_warns_once(capsys):
    """Layer 1's router sends 97 of 100 tokens to expert 0 (their second expert spread over the other three, so
    none is idle, and the collapse warning of idle experts is silent): one warning, naming the layer and the
    shares; routers near their fair share (k/E = 50% of the tokens each for 2 of 4 experts) warn of nothing."""
    from toolkit.metrics.health import Health
    from toolkit.metrics.routing import RouterStats

    class Experts(torch.nn.Module):  # a fused experts module as transformers 5 calls it: its tokens' top-k indices
        def __init__(self):
            super().__init__()
            self.num_experts, self.gate_up_proj = 4, torch.nn.Parameter(torch.zeros(4, 2, 2))

        def forward(self, hidden, top_k_index, top_k_weights):
            return hidden

    layers = [Experts(), Experts()]
    stats = RouterStats(layers)
    rng = torch.Generator().manual_seed(0)
    balanced = torch.stack([torch.randperm(4, generator=rng)[:2] for _ in range(100)])
    first = torch.tensor([0] * 97 + [1, 2, 3])
    second = torch.tensor([1, 2, 3] * 33 + [0])
    hot = torch.stack([first, torch.where(second == first, (second + 1) % 4, second)], dim=1)
    health = Health(None, is_main=True)
    for index in (balanced, balanced):
        layers[0](torch.zeros(100, 2), top_k_index=index, top_k_weights=None)
        layers[1](torch.zeros(100, 2), top_k_index=index, top_k_weights=None)
        health.check(stats.metrics(), 0.1)
    assert capsys.readouterr().err == ""
    for _ in range(2):
        layers[0](torch.zeros(100, 2), top_k_index=balanced, top_k_weights=None)
        layers[1](torch.zeros(100, 2), top_k_index=hot, top_k_weights=None)
        figures = stats.metrics()
        assert figures["experts_idle"] == 0 and figures["router_busiest_layer"] == 1
        assert figures["router_busiest_share"] == pytest.approx(0.98)  # expert 0: 97 first choices, 1 second
        health.check(figures, 0.1)
    assert capsys.readouterr().err == (
        "warning: router imbalance: layer 1's busiest expert took 98% of its tokens in the last logging interval, "
        "2.0x its fair share of 50%: turn on the load-balancing loss or raise it (--router_aux_loss_coef 0.001, "
        "say), or lower the learning rate\n"
    )
