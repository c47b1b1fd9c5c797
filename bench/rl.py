"""`make bench` (rl): GRPO's samplers on the same prompts and seed: sampled tokens a second, and the share of a
training step spent sampling.

  generate     transformers' generate on the left-padded generation batch (TRL's default; --sampler generate)
  continuous   transformers' continuous batching (`generate_batch`) with a paged KV cache sized to the batch
               (--sampler continuous; settings/policy.py's paged_cache)

Part 1, the engines alone: a random-weight model of the recipe's architecture (tiny mode's on a CPU, Qwen3-0.6B's
shape with --full on a GPU) samples the same prompts to the same lengths; greedy, the two engines' tokens are
checked equal (the table says where they are not). Part 2, a tiny GRPO run (smollm2_grpo --tiny) per sampler: the
run's own sampling share and sampled tokens a second (its run_summary.json). Median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

SAMPLERS = ("generate", "continuous")


def model_and_prompts(full: bool, rows: int, prompt_tokens: int, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.data.sources import stored_config
    from toolkit.models import tiny

    name = "Qwen/Qwen3-0.6B"
    config = stored_config(name) if full else tiny.shrunk_config(stored_config(name), 1024)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(prompt_tokens // 2, prompt_tokens + 1, (rows,), generator=generator).tolist()
    prompts = [torch.randint(10, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    return model, prompts


def sample(model, prompts: list[list[int]], engine: str, new_tokens: int, greedy: bool) -> list[list[int]]:
    """Completions of `new_tokens` each (no end token: the same work for both engines)."""
    import torch
    from transformers import GenerationConfig

    from toolkit.settings.policy import paged_cache

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=not greedy,
                              temperature=1.0, pad_token_id=0, eos_token_id=None)  # fmt: skip
    with torch.no_grad():
        if engine == "continuous":
            from transformers.generation import ContinuousBatchingConfig

            longest = max(map(len, prompts)) + new_tokens
            batching = ContinuousBatchingConfig(**paged_cache(len(prompts), longest))
            out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                                       progress_bar=False)  # fmt: skip
            return [list(o.generated_tokens) for o in out.values()]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return [row[width:].tolist() for row in out]


def engines(args) -> list[dict]:
    model, prompts = model_and_prompts(args.full, args.rows, args.prompt_tokens, args.device)
    greedy = {engine: sample(model, prompts, engine, args.new_tokens, True) for engine in SAMPLERS}
    rows = []
    for engine in SAMPLERS:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sample(model, prompts, engine, args.new_tokens, False)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append({"engine": engine, "rows": len(prompts), "tokens_per_second": len(prompts) * args.new_tokens /
                     seconds, "greedy_equal": greedy[engine] == greedy["generate"]})  # fmt: skip
    return rows


def runs(args) -> list[dict]:
    from smollm2_grpo import RECIPE

    from toolkit import train

    rows = []
    for engine in SAMPLERS:
        with tempfile.TemporaryDirectory() as folder:
            train(RECIPE, ["--tiny", "--max_steps", str(args.steps), "--report_to", "none", "--save_strategy", "no",
                           "--sampler", engine, "--output_dir", folder], "smollm2_grpo")  # fmt: skip
            summary = json.loads((Path(folder) / "run_summary.json").read_text())["summary"]
        rows.append({"engine": engine, "sampling_share": summary.get("sampling_share"),
                     "sampled_tokens_per_second": summary.get("sampling_tokens_per_second_per_device"),
                     "step_seconds": summary["training_seconds"] / summary["steps"]})  # fmt: skip
    return rows


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="Qwen3-0.6B's shape (a GPU); default: tiny mode's")
    parser.add_argument("--rows", type=int, default=16, help="prompts sampled at once (a generation batch)")
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="steps of each tiny GRPO run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(
        f"| sampler | rows | sampled tokens/s | greedy equal to generate |  ({args.device}, "
        f"{'Qwen3-0.6B' if args.full else 'tiny Qwen3'}, {args.prompt_tokens} prompt, {args.new_tokens} new)"
    )
    print("|---|---:|---:|---|")
    for row in engines(args):
        print(f"| {row['engine']} | {row['rows']} | {row['tokens_per_second']:,.0f} | {row['greedy_equal']} |")
    print("\n| sampler | tiny GRPO: sampling share of the step | sampled tokens/s | step s |")
    print("|---|---:|---:|---:|")
    for row in runs(args):
        share, rate = row["sampling_share"], row["sampled_tokens_per_second"]
        print(f"| {row['engine']} | {share:.0%} | {rate:,.0f} | {row['step_seconds']:.3f} |" if share and rate else
              f"| {row['engine']} | - | - | {row['step_seconds']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
