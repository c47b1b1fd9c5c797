"""`make bench` (second part): host RAM that 2 ranks take to load a checkpoint of a few hundred MB under FSDP2,
with and without RAM-efficient loading (`fsdp_cpu_ram_efficient_loading`).

Two settings: the checkpoint in fp32 trained in fp32, and the usual case, a bf16 checkpoint (as the Hub ships
them) trained in bf16 mixed precision, where FSDP keeps fp32 master weights. Each rank samples its memory from
the start of `from_pretrained` to the first step (tracking.HostMemoryPeak): anonymous memory (tensors and copies
the process made) and file-backed pages (the memory-mapped checkpoint: page cache, shared and reclaimable),
both as PSS, so a page two ranks map counts once in their sum. The table gives the peak of the sum over both
ranks at the same moment, in copies of the weights as trained (fp32: the sum of the ranks' shards), plus the
sum of each rank's own peak (a bound that ignores timing). Each setting is launched REPEATS times, interleaved;
the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from toolkit.metrics.memory import peak_over_ranks  # noqa: E402

SETTINGS = {  # name: (checkpoint dtype, training flags)
    "fp32 checkpoint, fp32 training": ("float32", ["--dtype", "float32", "--bf16", "false"]),
    "bf16 checkpoint, bf16 mixed precision": ("bfloat16", ["--dtype", "bfloat16", "--bf16", "true"]),
}


def checkpoint(folder: Path, dtype: str) -> None:
    """A Llama checkpoint of about 400 MB in fp32, 200 MB in bf16 (random weights, the tiny tokenizer), written once."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit.models import tiny

    if (folder / "model.safetensors").exists():
        return
    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
                         num_key_value_heads=4, vocab_size=len(tokenizer),
                         max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def launch(config: Path, model: Path, flags: list[str], out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config), "--num_processes",
           "2", "--main_process_port", str(port), str(ROOT / "recipes" / "llama3_fft.py"), "--tiny",
           "--model_name_or_path", str(model), "--max_steps", "1", "--report_to", "none", "--packing", "false",
           "--record_rank_reports", "true", "--output_dir", str(out), *flags]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted((out / "rank_reports").glob("rank*.json"))]


def measure(reports: list[dict]) -> dict[str, float]:
    copy = sum(r["param_bytes"] for r in reports)  # the weights as trained, summed over the ranks' shards
    series = [r["load_host"]["series"] for r in reports]
    return {
        "anon": peak_over_ranks(series, 1) / copy,
        "file": peak_over_ranks(series, 2) / copy,
        "anon_bound": sum(r["load_host"]["anon"] for r in reports) / copy,
        "copy": copy,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="runs/bench")
    args = parser.parse_args(argv)
    work = Path(args.output).resolve() / "ram_loading"
    work.mkdir(parents=True, exist_ok=True)
    configs = {}
    for efficient in (True, False):
        config = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())
        config["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] = efficient
        configs[efficient] = work / f"fsdp2_ram_efficient_{str(efficient).lower()}.yaml"
        configs[efficient].write_text(yaml.safe_dump(config))
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for name, (dtype, flags) in SETTINGS.items():
        checkpoint(work / f"checkpoint-{dtype}", dtype)
        for repeat in range(args.repeats):
            for efficient, config in configs.items():
                out = work / f"run-{dtype}-{efficient}-{repeat}"
                figures = measure(launch(config, work / f"checkpoint-{dtype}", flags, out))
                results.setdefault((name, efficient), []).append(figures)
                print(f"{name}, ram_efficient={efficient}, repeat {repeat + 1}/{args.repeats}: "
                      f"anonymous {figures['anon']:.2f}, file-backed {figures['file']:.2f} copies",
                      file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"\nFSDP2, 2 processes on CPU, median of {args.repeats}; host RAM (PSS) added from from_pretrained to the "
        "first step, peak over both ranks at once, in copies of the weights as trained (fp32)\n"
    )
    print("| setting | `fsdp_cpu_ram_efficient_loading` | anonymous | file-backed (page cache) | anonymous, sum of "
          "per-rank peaks |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: |")
    for (name, efficient), runs in results.items():
        copy = runs[0]["copy"]
        cells = [statistics.median(run[key] for run in runs) for key in ("anon", "file", "anon_bound")]
        print(f"| {name} | {str(efficient).lower()} | "
              + " | ".join(f"{c:.2f}x ({c * copy / 2**20:,.0f} MiB)" for c in cells) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
