"""`make bench`: non-padding tokens/s of the same SFT job under four trainers, measured in one go.

  baseline   plain transformers.Trainer, batches padded to their longest row
  recipe     RecipeTrainer with all its tracking (throughput, MFU, cost, health, budget guard), no packing,
             batches drawn at random as the baseline's: what the tracking costs
  grouped    RecipeTrainer with length-grouped batches (its default without packing; data/length_grouping.py)
  packed     RecipeTrainer with packing (data/packing.py), its SFT default
  trl        TRL's SFTTrainer with its packing (best fit decreasing, padding-free)

Same model (SmolLM2-135M's architecture; on a machine without a GPU the same architecture scaled down so the
bench runs in minutes), same random init, same variable-length chat-shaped data: every variant trains two epochs of
the same rows and is timed over the second, so each times exactly the same tokens, in its own order and rows (a
count of optimizer steps would not: a length-grouped variant's first steps were a mega-batch's longest rows). Each
(variant, repeat) runs in a fresh subprocess, variants interleaved, so each has its own peak memory and no
variant is favoured by warm caches; the first epoch warms up. Ratios are against the baseline's
median; p is the share of the baseline's batch tokens that are padding (counted in its collator), and 1/(1-p)
the ideal speed-up of removing it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("baseline", "recipe", "grouped", "packed", "trl")
# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json, public): a Llama with tied embeddings.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu")  # fmt: skip
CPU_SCALE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                 num_key_value_heads=1, vocab_size=8192)  # fmt: skip


def model_config(on_gpu: bool):
    from transformers import LlamaConfig

    return LlamaConfig(**{**SMOLLM2_135M, **({} if on_gpu else CPU_SCALE)})


def chat_data(rows: int, max_len: int, vocab: int, seed: int = 0):
    """Chat-shaped rows: log-normal lengths (median 96 tokens, a long tail to max_len), a prompt then an
    answer that carries the loss; the spread makes padding to the longest row in a batch wasteful."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(rows, generator=g) * 0.9 + math.log(96)).clamp(16, max_len).long().tolist()
    data = {"input_ids": [], "labels": [], "assistant_masks": []}
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompt = n // 3
        data["input_ids"].append(ids)
        data["labels"].append([-100] * prompt + ids[prompt:])
        data["assistant_masks"].append([0] * prompt + [1] * (n - prompt))
    return Dataset.from_dict(data)


class Clock:
    """Wall time of the second epoch, the timed one (a Trainer callback)."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kwargs):
                if int(state.epoch or 0) == 1:
                    clock.start = time.perf_counter()

            def on_train_end(self, args, state, control, **kwargs):
                clock.seconds = time.perf_counter() - clock.start

        self.callback = Callback()


def run_variant(variant: str, steps: int, batch: int, max_len: int, out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from toolkit.data.packing import PackedCollator, pack
    from toolkit.models import tiny

    on_gpu = torch.cuda.is_available()
    config = model_config(on_gpu)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")  # for its pad id only
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    data = chat_data(steps * batch, max_len, config.vocab_size)  # an epoch of `steps` padded batches
    clock = Clock()
    common = dict(output_dir=str(out), per_device_train_batch_size=batch, max_steps=-1, num_train_epochs=2,
                  learning_rate=1e-4, logging_steps=5, save_strategy="no", report_to="none", bf16=on_gpu,
                  use_cpu=not on_gpu, disable_tqdm=True, seed=0)  # fmt: skip
    seq2seq = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True)
    counted = {"real": 0, "batch": 0}

    def padded(features):  # counts the padding the baseline pays for: p
        batch = seq2seq(features)
        counted["real"] += int(batch["attention_mask"].sum())
        counted["batch"] += batch["attention_mask"].numel()
        return batch

    if variant == "trl":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common, packing=True, max_length=max_len, dataset_num_proc=None)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data.remove_columns("labels"),
                             processing_class=tokenizer, callbacks=[clock.callback])  # fmt: skip
    elif variant == "baseline":
        args = TrainingArguments(**common)
        trainer = Trainer(model=model, args=args, train_dataset=data.remove_columns("assistant_masks"),
                          data_collator=padded, processing_class=tokenizer, callbacks=[clock.callback])  # fmt: skip
    else:
        from toolkit.data.length_grouping import LENGTH
        from toolkit.models.counts import ParameterCounts
        from toolkit.settings.parser import parse
        from toolkit.training.trainer import RecipeTrainer

        recipe = {"model_name_or_path": "bench", "task": "sft", "dataset_name": "bench", "max_seq_length": max_len,
                  **common}  # fmt: skip
        if variant == "recipe":
            recipe["train_sampling_strategy"] = "random"
        arguments = parse(recipe, "bench", [])
        train = data.remove_columns("assistant_masks")
        if variant == "grouped":  # the length column data.py writes at tokenization
            train, collator = train.add_column(LENGTH, [len(x) for x in train["input_ids"]]), padded
        elif variant == "packed":
            train, collator = pack(train, max_len), PackedCollator(tokenizer.pad_token_id)
        else:
            collator = padded
        trainer = RecipeTrainer(model=model, args=arguments.training, train_dataset=train, data_collator=collator,
                                processing_class=tokenizer, arguments=arguments,
                                param_counts=ParameterCounts.of(model), callbacks=[clock.callback])  # fmt: skip
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if on_gpu:
        peak = torch.cuda.max_memory_allocated()
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = sum(len(row) for row in data["input_ids"])  # the timed epoch's, the same in every variant
    return {"tokens_per_second": tokens / clock.seconds, "tokens": tokens, "seconds": clock.seconds,
            "padding_share": 1 - counted["real"] / counted["batch"] if counted["batch"] else None,
            "peak_memory_gib": peak / 2**30, "device": torch.cuda.get_device_name(0) if on_gpu else "cpu"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one variant in this process, JSON out
    parser.add_argument("--output", default="runs/bench")
    args = parser.parse_args(argv)
    if args.run:
        result = run_variant(args.run, args.steps, args.batch, args.max_len, Path(args.output) / args.run)
        print("BENCH " + json.dumps(result))
        return 0

    variants = args.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants:
            cmd = [sys.executable, __file__, "--run", variant, "--steps", str(args.steps), "--batch", str(args.batch),
                   "--max_len", str(args.max_len), "--output", args.output]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
            line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
            if proc.returncode or not line:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{variant} failed (exit {proc.returncode})")
            results[variant].append(json.loads(line[0][6:]))
            print(f"repeat {repeat + 1}/{args.repeats} {variant:9s} {results[variant][-1]['tokens_per_second']:,.0f} "
                  "tokens/s", file=sys.stderr, flush=True)  # fmt: skip

    import torch

    on_gpu = torch.cuda.is_available()
    p = statistics.median(r["padding_share"] for r in results["baseline"]) if "baseline" in results else float("nan")
    median = {v: statistics.median(r["tokens_per_second"] for r in results[v]) for v in variants}
    base = median.get("baseline")
    device = results[variants[0]][0]["device"]
    print(f"\n{device}, {model_config(on_gpu).num_hidden_layers}-layer SmolLM2-135M architecture"
          f"{'' if on_gpu else ' (scaled down for CPU)'}, batch {args.batch}, max_len {args.max_len}, "
          f"2 epochs of {args.steps} padded steps' rows (the second timed), median of {args.repeats}")  # fmt: skip
    print(f"baseline padding share p = {p:.3f}; ideal speed-up of packing 1/(1-p) = {1 / (1 - p):.2f}x\n")
    print("| variant | non-padding tokens/s (median) | vs baseline | padding share | peak memory GiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for v in variants:
        ratio = f"{median[v] / base:.2f}x" if base else "-"
        shares = [r["padding_share"] for r in results[v] if r["padding_share"] is not None]
        share = f"{statistics.median(shares):.3f}" if shares else "-"  # packed rows are counted by no collator here
        peak = statistics.median(r["peak_memory_gib"] for r in results[v])
        print(f"| {v} | {median[v]:,.0f} | {ratio} | {share} | {peak:.2f} |")
    if "packed" in median and "trl" in median:
        print(f"\npacked vs TRL SFTTrainer packing: {median['packed'] / median['trl']:.2f}x")
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / "results.json").write_text(json.dumps({"p": p, "median": median, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
