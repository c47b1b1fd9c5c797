"""`make bench` (second part): host RAM that 2 ranks take to load a checkpoint of a few hundred MB under FSDP,
with and without RAM-efficient loading (`fsdp_cpu_ram_efficient_loading`).

Each rank reports the peak host RAM (RSS) that `from_pretrained` added (rank report `loaded_host_bytes`) and
the same through FSDP's placing and sharding, up to the first step (`load_host_bytes`: it also counts the
rank's own shard, half a copy, and what sharding allocates on the way). Summed over the ranks and divided by
the checkpoint's size: copies of the model in host RAM. Each setting is launched REPEATS times, interleaved;
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


def checkpoint(folder: Path) -> int:
    """A Llama checkpoint of about 400 MB in fp32 (random weights, the tiny tokenizer), written once."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit import tiny

    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    if not (folder / "model.safetensors").exists():
        config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
                             num_key_value_heads=4, vocab_size=len(tokenizer),
                             max_position_embeddings=1024)  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return (folder / "model.safetensors").stat().st_size


def launch(config: Path, model: Path, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config), "--num_processes",
           "2", "--main_process_port", str(port), str(ROOT / "recipes" / "llama3_fft.py"), "--tiny",
           "--model_name_or_path", str(model), "--max_steps", "1", "--report_to", "none", "--packing", "false",
           "--record_rank_reports", "true", "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted((out / "rank_reports").glob("rank*.json"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="runs/bench")
    args = parser.parse_args(argv)
    work = Path(args.output).resolve() / "ram_loading"
    work.mkdir(parents=True, exist_ok=True)
    size = checkpoint(work / "checkpoint")
    configs = {}
    for efficient in (True, False):
        config = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())
        config["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] = efficient
        configs[efficient] = work / f"fsdp2_ram_efficient_{str(efficient).lower()}.yaml"
        configs[efficient].write_text(yaml.safe_dump(config))
    keys = ("loaded_host_bytes", "load_host_bytes")
    copies: dict[tuple[bool, str], list[float]] = {(e, k): [] for e in configs for k in keys}
    for repeat in range(args.repeats):
        for efficient, config in configs.items():
            reports = launch(config, work / "checkpoint", work / f"run-{efficient}-{repeat}")
            for key in keys:
                copies[efficient, key].append(sum(r[key] for r in reports) / size)
            print(f"repeat {repeat + 1}/{args.repeats} ram_efficient={efficient}: "
                  f"{copies[efficient, keys[0]][-1]:.2f} / {copies[efficient, keys[1]][-1]:.2f} copies",
                  file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"\nFSDP2, 2 processes on CPU, checkpoint {size / 2**20:.0f} MiB (fp32), median of {args.repeats}; host RAM "
        "added, both ranks together, in copies of the model\n"
    )
    print("| fsdp_cpu_ram_efficient_loading | by from_pretrained | through sharding, up to the first step |")
    print("| --- | ---: | ---: |")
    for efficient in (True, False):
        cells = [statistics.median(copies[efficient, key]) for key in keys]
        print(f"| {str(efficient).lower()} | " + " | ".join(f"{c:.2f}x ({c * size / 2**20:,.0f} MiB)" for c in cells)
              + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
