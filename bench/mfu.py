"""MFU at a size people train: a Llama-3.2-1B-shaped model fine-tuned on packed 4,096-token rows, one GPU.

Every variant does the same work: the same rows, each conversation attending only to itself (the plain Trainer
gets the batch without the collator's all-ones attention mask, which would switch off transformers' packed-row
detection and let rows attend across conversations), the same FLOPs counted.

  trainer          plain transformers.Trainer, sdpa with the document mask, the full logits, pure bf16 (baseline)
  trainer_compile  the same with --torch_compile true
  toolkit          RecipeTrainer with its defaults: packing, the fused loss on a GPU (training/fused_loss.py),
                   attention that skips what packing masks (flash-attn's varlen path where installed, else flex),
                   bf16 weights with fp32 masters in the optimizer, --torch_compile auto (settings/compile.py)
  no_compile       toolkit with --torch_compile false
  sdpa             toolkit with --attn_implementation sdpa: what the attention choice changes
  full_logits      toolkit with --fused_loss false: what the fused loss changes
  no_masters       toolkit with --fp32_master_weights false: what the optimizer's fp32 masters cost
  liger            toolkit with --use_liger_kernel true (where liger-kernel is installed: RMSNorm, SwiGLU, RoPE)
  compile_liger    liger with --torch_compile true
  fp8              toolkit in mixed precision fp8 (torchao float8 linears), --torch_compile false
  fp8_compile      fp8 with --torch_compile true (what --torch_compile auto gives under FP8)
  qlora            toolkit with llama3_qlora's settings: LoRA r=16 on every linear layer over a 4-bit NF4 base
                   (bitsandbytes), loaded from a checkpoint as the runner loads it; MFU counts 4 FLOPs per frozen weight
  moe              toolkit on a small mixture of experts (Qwen3-30B-A3B's layer, 8 of them, 64 experts, 8 a token),
                   its experts run by transformers' default kernel (grouped_mm: one grouped matmul over all experts)
  moe_batched      moe with --experts_implementation batched_mm
  moe_eager        moe with --experts_implementation eager (each expert in turn): what the grouped kernels change

Each row: non-padding tokens/s after WARMUP untimed steps, MFU (the planner's FLOPs per token x tokens/s over
the datasheet's dense bf16 peak, toolkit/metrics/hardware.yaml; FP8 rows too, so they compare), the peak memory
torch.cuda.max_memory_allocated measured, and what the run's own plan predicted without the CUDA context
(RecipeTrainer rows). Random init, bf16 weights, AdamW (fused), activation checkpointing off. Each (variant,
repeat) in a fresh process, variants interleaved, median of the repeats; each run's row is appended to
rows.jsonl as it ends, and a variant that fails is reported in the table and not repeated while the others go on.
Without a GPU it runs the same code at toy size (`--toy`, what the tests run): the figures then say nothing
about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolkit.errors import ConfigError, command  # noqa: E402

# variant -> the toolkit's flags on top of its defaults (the plain Trainer's rows: its TrainingArguments)
OPTIONS = {
    "trainer": {},
    "trainer_compile": {"torch_compile": True},
    "toolkit": {},
    "no_compile": {"torch_compile": False},
    "sdpa": {"attn_implementation": "sdpa"},
    "full_logits": {"fused_loss": False},
    "no_masters": {"fp32_master_weights": False},
    "liger": {"use_liger_kernel": True},
    "compile_liger": {"use_liger_kernel": True, "torch_compile": True},
    "fp8": {"torch_compile": False},
    "fp8_compile": {"torch_compile": True},
    "qlora": {},
    "moe": {},
    "moe_batched": {"experts_implementation": "batched_mm"},
    "moe_eager": {"experts_implementation": "eager"},
}
VARIANTS = tuple(OPTIONS)
PLAIN = ("trainer", "trainer_compile")  # transformers.Trainer itself
WARMUP = 3
# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json, public): tied embeddings, 128k vocabulary.
LLAMA_32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                   rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu")  # fmt: skip
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=2048)  # fmt: skip
# Qwen3-30B-A3B's layer (Qwen/Qwen3-30B-A3B config.json, public), 8 layers of 64 experts: 2.6B parameters, whose
# AdamW states fit one 80 GB GPU beside the activations.
QWEN3_MOE_SMALL = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=8,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64,
                       num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)  # fmt: skip
TOY_MOE = {**TOY, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}


def model_config(toy: bool, moe: bool = False):
    from transformers import LlamaConfig, Qwen3MoeConfig

    if moe:
        return Qwen3MoeConfig(**{**QWEN3_MOE_SMALL, **(TOY_MOE if toy else {})})
    return LlamaConfig(**{**LLAMA_32_1B, **(TOY if toy else {})})


def packed_rows(rows: int, row_length: int, vocab: int, seed: int = 0):
    """`rows` rows of exactly row_length tokens filled with chat-shaped conversations (log-normal lengths, median
    300 tokens, the prompt's third unscored; a row's last one cut to fit), position ids restarting per conversation
    as the toolkit's packing gives them: every step trains batch x row_length real tokens, so the timed tokens are
    counted from the steps (the toolkit's own count is read only at log lines)."""
    import math

    import torch
    from datasets import Dataset

    from toolkit.data.length_grouping import LENGTH

    g = torch.Generator().manual_seed(seed)
    data = {"input_ids": [], "labels": [], "position_ids": []}
    for _ in range(rows):
        ids, labels, positions = [], [], []
        while len(ids) < row_length:
            n = min(row_length - len(ids), max(16, round(math.exp(float(torch.randn(1, generator=g)) * 0.7
                                                                  + math.log(300)))))  # fmt: skip
            conversation = torch.randint(3, vocab, (n,), generator=g).tolist()
            ids += conversation
            labels += [-100] * max(1, n // 3) + conversation[max(1, n // 3) :]  # no label across a boundary
            positions += range(n)
        data["input_ids"].append(ids)
        data["labels"].append(labels)
        data["position_ids"].append(positions)
    data[LENGTH] = [row_length] * rows
    return Dataset.from_dict(data)


def plain_collator(collator):
    """The plain Trainer's collator: the toolkit's batches without their bookkeeping and all-ones attention mask
    (data/packing.py's model_inputs, what RecipeTrainer hands its model): a mask would switch off transformers'
    packed-row detection, and the rows would attend across conversations, less work than the toolkit does."""
    from toolkit.data.packing import model_inputs

    return lambda rows: model_inputs(collator(rows))


def qlora_settings() -> dict:
    """llama3_qlora's adapter over its 4-bit base, read from the recipe."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from llama3_qlora import RECIPE

    return {k: v for k, v in RECIPE.items() if k.startswith("lora_") or k in ("use_lora", "load_in_4bit")}


def run_variant(variant: str, steps: int, batch: int, row_length: int, toy: bool, out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from toolkit.data.packing import PackedCollator
    from toolkit.metrics.cost import detect_device, peak_tflops
    from toolkit.models import tiny
    from toolkit.models.attention import choose_attention, pad_multiple
    from toolkit.planner import Shape, meta_model
    from toolkit.planner.estimate import training_flops_per_token

    on_gpu = torch.cuda.is_available()
    config = model_config(toy, moe=variant.startswith("moe"))
    torch.manual_seed(0)
    setting = "sdpa" if variant in (*PLAIN, "sdpa") else "auto"  # the runner's choice for packed rows
    attention, _ = choose_attention(config, setting, "sft", packing=True, on_gpu=on_gpu)
    kernel = OPTIONS[variant].get("experts_implementation")  # as load_model passes --experts_implementation
    with torch.device("cuda" if on_gpu else "cpu"):  # random init on the GPU: seconds of a lent machine's time
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention,
                                                 **({"experts_implementation": kernel} if kernel else {}))  # fmt: skip
    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")  # for its pad id only
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    data = packed_rows(max(64, steps * batch * 2), row_length, config.vocab_size)
    times: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == WARMUP:
                times["start"] = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            times["seconds"] = time.perf_counter() - times["start"]
            times["tokens"] = (state.global_step - WARMUP) * batch * row_length  # full rows (packed_rows)

    common = dict(output_dir=str(out), per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-5,
                  logging_steps=5, save_strategy="no", report_to="none", bf16=True, use_cpu=not on_gpu,
                  dataloader_drop_last=True, disable_tqdm=True, seed=0)  # fmt: skip
    collator = PackedCollator(tokenizer.pad_token_id, flatten="flash" in attention,
                              pad_to_multiple_of=pad_multiple(attention))  # fmt: skip
    planned, lora, compiled, masters = None, None, variant == "trainer_compile", ""
    # At toy size on a CPU the bench proves each variant runs (dynamo's trace and AOTAutograd's graphs, the FP8
    # subclasses through them), not its speed: inductor's C++ kernels, which a GPU never builds (it builds Triton's),
    # took a minute of gcc a variant, so a CPU compiles with aot_eager
    backend = {"torch_compile_backend": "aot_eager"} if toy and not on_gpu else {}
    if variant in PLAIN:  # the batch as the model sees it in the toolkit: no all-ones mask (the same work)
        options = {**OPTIONS[variant], **(backend if compiled else {})}
        trainer = Trainer(model=model, args=TrainingArguments(**common, **options), train_dataset=data,
                          data_collator=plain_collator(collator), processing_class=tokenizer,
                          callbacks=[Clock()])  # fmt: skip
    else:
        from toolkit.models.counts import ParameterCounts
        from toolkit.settings.compile import choose_compile, set_compile
        from toolkit.settings.parser import parse
        from toolkit.settings.tasks import fused_head
        from toolkit.training.trainer import RecipeTrainer

        options = dict(OPTIONS[variant])
        if variant == "qlora":
            options.update(qlora_settings(), model_name_or_path=str(out / "checkpoint"))
            model.save_pretrained(out / "checkpoint")
        recipe = {"model_name_or_path": "bench", "task": "sft", "dataset_name": "bench", "dtype": "bfloat16",
                  "max_seq_length": row_length, **common, **options}  # fmt: skip
        arguments = parse(recipe, "bench", [])
        fp8 = variant.startswith("fp8")
        if fp8:  # as the runner sets it under an fp8 config; one process: no FSDP2 all-gather wrapper
            arguments.training.mixed_precision = "fp8"
            os.environ.update(ACCELERATE_FP8_BACKEND="AO", ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER="false")
        compiled = arguments.torch_compile
        if compiled == "auto":  # as the runner resolves it (one process, no sharding)
            compiled, _ = choose_compile("auto", fp8=fp8, on_gpu=on_gpu, processes=1, replicated=True,
                                         lora=arguments.model.use_lora, attention=attention,
                                         liger=bool(arguments.training.use_liger_kernel))  # fmt: skip
        set_compile(arguments.training, compiled)
        if compiled and backend:
            arguments.training.torch_compile_backend = backend["torch_compile_backend"]
        if variant == "qlora":  # bitsandbytes quantizes as a checkpoint's weights load, as in the runner
            from toolkit.models.loading import load_model
            from toolkit.models.lora import add_lora

            del model
            arguments.model.attn_implementation = attention
            model = add_lora(load_model(arguments.model, "sft", tokenizer, None), arguments.model, "sft")
            lora = arguments.model.lora_settings()  # for the FLOPs: 4 per frozen weight, not 6
        trainer = RecipeTrainer(model=model, args=arguments.training, train_dataset=data, data_collator=collator,
                                processing_class=tokenizer, arguments=arguments, param_counts=ParameterCounts.of(model),
                                fused_loss=fused_head("sft", arguments.model.fused_loss, on_gpu),
                                callbacks=[Clock()])  # fmt: skip
        plan = trainer.memory_plan.device
        planned = sum(v for k, v in plan.items() if k != "cuda_context")
        masters = trainer.master_weights
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if on_gpu else None
    tokens_per_second = times["tokens"] / times["seconds"]
    flops = training_flops_per_token(Shape.of(meta_model(config, "sft", lora), config), row_length)
    device = detect_device()
    peak_flops = peak_tflops(device, "bf16")
    return {"tokens_per_second": tokens_per_second, "mfu": flops * tokens_per_second / (peak_flops * 1e12)
            if peak_flops else None, "peak_gib": peak / 2**30 if peak else None,
            "planned_gib": planned / 2**30 if planned else None, "attention": attention, "compile": bool(compiled),
            "masters": masters, "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
            "experts": getattr(model.config, "_experts_implementation", None)}  # fmt: skip


def available(variant: str) -> str | None:
    """Why a variant cannot run here, or None: the toolkit's own refusal of its settings."""
    from toolkit.distributed.strategy import check_fp8, cuda_capability
    from toolkit.settings.arguments import check_liger
    from toolkit.settings.model_arguments import ModelArguments

    try:
        if "liger" in variant:
            check_liger()
        elif variant == "qlora":
            ModelArguments("bench", **qlora_settings())  # --load_in_4bit without bitsandbytes is refused
        elif variant.startswith("fp8"):  # FP8 tensor cores and torchao (TOOLKIT_FP8_ON_CPU=1: the toy run)
            check_fp8("AO", False, cuda_capability(), "replicated")
    except ConfigError as refused:
        return str(refused)
    return None


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--row_length", type=int, default=4096)
    parser.add_argument(
        "--toy", action="store_true", help="toy size, for a CPU: the code runs, the speed means nothing"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one variant in this process, JSON out
    parser.add_argument("--output", default="runs/bench_mfu")
    args = parser.parse_args(argv)
    if args.toy:
        args.row_length = min(args.row_length, 256)
    if args.run:
        result = run_variant(args.run, args.steps, args.batch, args.row_length, args.toy, Path(args.output) / args.run)
        print("BENCH " + json.dumps(result))
        return 0

    requested = args.variants.split(",")
    unknown = [v for v in requested if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variant {', '.join(unknown)}: pick from {','.join(VARIANTS)}")
    import torch

    if not args.toy and not torch.cuda.is_available():  # a 1B model on a CPU: each variant runs out of memory
        raise ConfigError("no GPU here (torch sees none): this measures a GPU; pass --toy to run the code at toy size")
    skipped = {v: reason for v in requested if (reason := available(v))}
    variants = [v for v in requested if v not in skipped]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    failed: dict[str, str] = {}
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    rows = output / "rows.jsonl"  # one line per finished run, so a run cut short (a time limit) keeps what it had
    rows.write_text("")

    def measure(variant: str, repeat: int) -> None:
        cmd = [sys.executable, __file__, "--run", variant, "--steps", str(args.steps), "--batch", str(args.batch),
               "--row_length", str(args.row_length), "--output", args.output]  # fmt: skip
        cmd += ["--toy"] if args.toy else []
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
        seconds = time.perf_counter() - start
        line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
        if proc.returncode or not line:  # the other variants still run: a variant that fails is a finding
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            failed[variant] = f"exit {proc.returncode}: {last[:200]}"
            row = {"variant": variant, "repeat": repeat, "error": failed[variant]}
        else:
            results[variant].append(json.loads(line[0][6:]))
            row = {"variant": variant, "repeat": repeat, **results[variant][-1]}
        with rows.open("a") as f:
            f.write(json.dumps({**row, "wall_seconds": round(seconds, 1)}) + "\n")
        outcome = "failed" if variant in failed else f"{results[variant][-1]['tokens_per_second']:,.0f} tokens/s"
        print(f"repeat {repeat + 1}/{args.repeats} {variant:11s} {outcome} ({seconds:.0f} s with start-up)",
              file=sys.stderr, flush=True)  # fmt: skip

    interrupted = False
    try:
        for repeat in range(args.repeats):
            for variant in [v for v in variants if v not in failed]:
                measure(variant, repeat)
    except KeyboardInterrupt:  # a time limit's SIGINT: the table of what finished, as gpu_check prints its own
        interrupted = True
        print("interrupted: the table holds the variants measured so far", file=sys.stderr)

    def median(v: str, key: str) -> float | None:
        values = [r[key] for r in results[v] if r[key] is not None]
        return statistics.median(values) if values else None

    measured = [v for v in variants if results[v]]
    base = median("trainer", "tokens_per_second") if results.get("trainer") else None
    device = results[measured[0]][0]["device"] if measured else "-"
    print(
        f"\n{device}, Llama-3.2-1B shape{' (toy size)' if args.toy else ''}, bf16, packed rows of "
        f"{args.row_length} tokens x {args.batch}, {args.steps} steps ({WARMUP} untimed), median of {args.repeats}\n"
    )
    print("| variant | attention | compile | tokens/s | vs trainer | MFU | peak GiB (measured) | planned GiB |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for v in measured:
        rate, mfu, peak, planned = (median(v, k) for k in ("tokens_per_second", "mfu", "peak_gib", "planned_gib"))
        first = results[v][0]
        cells = [first["attention"], "on" if first.get("compile") else "off", f"{rate:,.0f}",
                 f"{rate / base:.2f}x" if base else "-", f"{100 * mfu:.1f}%" if mfu else "-",
                 f"{peak:.2f}" if peak else "-", f"{planned:.2f}" if planned else "-"]  # fmt: skip
        print(f"| {v} | " + " | ".join(cells) + " |")
    for v, reason in {**skipped, **failed}.items():
        print(f"| {v} | {'failed' if v in failed else 'not run'}: {reason} | | | | | | |")
    (output / "results.json").write_text(json.dumps({"runs": results, "skipped": skipped, "failed": failed}))
    return 130 if interrupted else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
