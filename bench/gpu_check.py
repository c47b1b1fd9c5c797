"""`make gpu-check`: the proof, on whatever GPUs a machine has, that every shipped config trains there.

For each shipped config that fits the GPUs present, each decoder recipe in tiny mode at the recipe's own precision
and default flags (on a GPU tiny mode keeps them: bf16, flex attention, the fused loss, --torch_compile auto):
  train      10 steps, a checkpoint at step 5, the export
  resume     (llama3_fft rows, and each recipe's first row) from a copy of checkpoint-5 to step 10: same losses
  reload     the export (or the adapter on its base) loaded with `python -m toolkit generate`, which answers a prompt
then bench/mfu.py (speed, MFU and memory against the plan, one repeat). One table on stdout, one JSON line per row
in OUTPUT/rows.jsonl as each ends; a row that fails holds its error line, and the rest still runs. Offline. On one
GPU: 38 rows, 50 launches (estimated 10-15 minutes with bench/mfu.py; --configs/--recipes narrow it).

    make gpu-check                      # = python bench/gpu_check.py
    python bench/gpu_check.py --dry_run --gpus 8    # what it would launch for 8 GPUs (any machine; the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPES = ("llama3_fft", "llama3_lora", "llama3_qlora", "smollm2_chat")  # decoders whose tiny mode needs no other run
RESUMED = ("llama3_fft",)  # resumed under every config; the other recipes under their first config
STEPS, SAVE_AT = 10, 5
PROMPT = "What is 2 + 3?"
ENGINES = {"DEEPSPEED": "DEEPSPEED", "FSDP": "FSDP"}  # else: replicated (Requested.engine's names)


@dataclass
class Row:
    config: str
    recipe: str
    processes: int
    launch_flags: list[str] = field(default_factory=list)  # accelerate launch flags sizing the mesh
    recipe_flags: list[str] = field(default_factory=list)
    resume: bool = False
    skip: str = ""  # why it is not launched here
    status: str = "pending"
    error: str = ""
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    resumed_losses: list[float] = field(default_factory=list)
    answer: str = ""


def mesh_flags(config: dict, gpus: int) -> tuple[int, list[str], str]:
    """Processes and accelerate flags for a config's mesh on `gpus` GPUs, at tiny size (4 heads, 64-token rows:
    a model-parallel axis of 2); '' or why it cannot run on so few."""
    mesh = {k.removeprefix("parallelism_config_").removesuffix("_size"): int(v)
            for k, v in (config.get("parallelism_config") or {}).items() if k.endswith("_size")}  # fmt: skip
    split = {axis: 2 for axis in ("tp", "cp", "sp", "pp") if mesh.get(axis, 1) > 1}
    if not mesh:
        kind = config.get("distributed_type")
        return (1 if kind == "NO" else gpus), [], ""
    if "pp" in split:  # the tiny Llama's 2 layers: 2 stages, the pipeline replicated over the other GPUs
        if gpus < 2 or ("dp_replicate" in mesh and gpus < 4):
            return 0, [], "needs 4 GPUs (2 stages x 2 replicas)" if "dp_replicate" in mesh else "needs 2 GPUs"
        sizes = {"pp": 2, **({"dp_replicate": gpus // 2} if "dp_replicate" in mesh else {})}
        return 2 * sizes.get("dp_replicate", 1), [f"--parallelism_config_{a}_size={n}" for a, n in sizes.items()], ""
    model_parallel = 1
    for size in split.values():
        model_parallel *= size
    if "dp_replicate" in mesh:  # HYBRID_SHARD: 2 replicas, the shards inside each
        if gpus < 4:
            return 0, [], "HYBRID_SHARD needs 4 GPUs (2 replicas x 2 shards)"
        sizes = {"dp_replicate": 2, "dp_shard": gpus // 2}
    elif "dp_shard" in mesh:  # FSDP2 x TP or CP: the data-parallel ranks are what the split leaves
        if gpus < model_parallel:
            return 0, [], f"needs {model_parallel} GPUs"
        sizes = {**split, "dp_shard": gpus // model_parallel}
    else:
        if gpus < model_parallel:
            return 0, [], f"needs {model_parallel} GPUs"
        sizes = split
    processes = 1
    for size in sizes.values():
        processes *= size
    if "sp" in split:  # DeepSpeed makes the rest of the processes data-parallel
        processes = gpus - gpus % model_parallel
    return processes, [f"--parallelism_config_{axis}_size={size}" for axis, size in sizes.items()], ""


def plan_rows(gpus: int, fp8: bool) -> list[Row]:
    """Every (config, recipe) pair to launch on `gpus` GPUs, with why a pair is not launched."""
    import yaml

    from toolkit.project import load_recipe, strategy_files

    rows: list[Row] = []
    resumed: set[str] = set()
    for path in strategy_files():
        config = yaml.safe_load(path.read_text())
        processes, flags, skip = mesh_flags(config, gpus)
        engine = ENGINES.get(config.get("distributed_type"), "replicated")
        if str(config.get("mixed_precision")).lower() == "fp8" and not fp8:
            skip = "needs FP8 tensor cores (compute capability 8.9+)"
        for recipe in RECIPES:
            row = Row(path.stem, recipe, processes, flags)
            if "tp" in str(flags) and recipe.startswith("llama3"):  # the tiny Llama 3 has 1 key/value head: a
                # user's Llama with 2 (made once)
                row.recipe_flags = ["--model_name_or_path", "{two_kv_heads}"]
            if load_recipe(recipe).get("load_in_4bit") and (engine != "replicated" or "tp" in str(flags)):
                row.skip = "QLoRA trains under single_gpu.yaml or ddp.yaml (the toolkit refuses the pair)"
            elif "tp" in str(flags) and recipe == "smollm2_chat":  # its own model, not the stand-in Llama
                row.skip = "the tiny SmolLM2 has one key/value head, which no tensor-parallel size above 1 divides"
            elif "pp" in str(flags) and load_recipe(recipe).get("load_in_4bit"):
                row.skip = "QLoRA trains under single_gpu.yaml or ddp.yaml (the toolkit refuses the pair)"
            elif "pp" in str(flags) and recipe == "smollm2_chat":
                row.skip = "SmolLM2 ties its head to its embeddings, which pipeline stages refuse"
            elif skip:
                row.skip = skip
            if not row.skip and (recipe in RESUMED or recipe not in resumed):
                row.resume = True
                resumed.add(recipe)
            rows.append(row)
    return rows


def error_line(stderr: str) -> str:
    """The toolkit's own `error:` line, else the last line of a traceback."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("error:")]
    failures = [line for line in lines if "Error" in line.split(":")[0] or "Error:" in line]
    return ((own or failures or lines or ["no output"])[-1]).strip()[:300]


def launch(row: Row, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "toolkit", "launch", "--config_file", str(ROOT / "accelerate_configs" /
           f"{row.config}.yaml"), "--num_processes", str(row.processes), *row.launch_flags,
           str(ROOT / "recipes" / f"{row.recipe}.py"), "--tiny", "--max_steps", str(STEPS), "--save_strategy", "steps",
           "--save_steps", str(SAVE_AT), "--logging_steps", "1", "--report_to", "none", "--output_dir", str(out),
           *row.recipe_flags, *extra]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def losses(folder: Path) -> list[float]:
    log = folder / "run_log.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return [line["loss"] for line in lines if "loss" in line]


def run_row(row: Row, output: Path) -> None:
    start = time.perf_counter()
    out = output / row.config / row.recipe
    shutil.rmtree(out, ignore_errors=True)
    stage = "train"
    try:
        result = launch(row, out / "run", [])
        if result.returncode:
            raise RuntimeError(error_line(result.stderr))
        row.losses = losses(out / "run")
        if row.resume:
            stage = "resume"
            (out / "resumed").mkdir(parents=True)
            shutil.copytree(out / "run" / f"checkpoint-{SAVE_AT}", out / "resumed" / f"checkpoint-{SAVE_AT}")
            result = launch(row, out / "resumed", ["--resume", "auto"])
            if result.returncode:
                raise RuntimeError(error_line(result.stderr))
            row.resumed_losses = losses(out / "resumed")[-(STEPS - SAVE_AT) :]
            expected = row.losses[-(STEPS - SAVE_AT) :]
            if any(abs(a - b) > 2e-3 * max(abs(b), 1) for a, b in zip(row.resumed_losses, expected, strict=True)):
                raise RuntimeError(f"resumed losses {row.resumed_losses} differ from {expected}")
            stage = "reload"
            generated = subprocess.run([sys.executable, "-m", "toolkit", "generate", str(out / "run"), "--prompt",
                                        PROMPT, "--max_new_tokens", "8"], capture_output=True, text=True,
                                       env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT)  # fmt: skip
            if generated.returncode:
                raise RuntimeError(error_line(generated.stderr))
            row.answer = generated.stdout.strip().splitlines()[-1][:80] if generated.stdout.strip() else ""
        row.status = "ok"
    except RuntimeError as failure:
        row.status, row.error = f"failed: {stage}", str(failure)
    row.seconds = round(time.perf_counter() - start, 1)


def two_kv_heads_llama(output: Path) -> Path:
    """A user's small Llama whose 2 key/value heads split over 2 tensor-parallel ranks, in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit.models import tiny

    folder = output / "llama-two-kv-heads"
    if not (folder / "config.json").is_file():
        tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=len(tokenizer),
                             max_position_embeddings=1024)  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def table(rows: list[Row]) -> str:
    lines = ["| config | recipe | processes | result | seconds | last loss | resumed | answer |",
             "| --- | --- | ---: | --- | ---: | ---: | --- | --- |"]  # fmt: skip
    for r in rows:
        result = r.status if r.status != "pending" else "-"
        if r.skip:
            result = f"not run: {r.skip}"
        elif r.error:
            result = f"{r.status}: {r.error}"
        resumed = "same losses" if r.resumed_losses else ("-" if not r.resume else "")
        last = f"{r.losses[-1]:.3f}" if r.losses else "-"
        lines.append(f"| {r.config} | {r.recipe} | {r.processes or '-'} | {result} | {r.seconds or '-'} | {last} | "
                     f"{resumed} | {r.answer.replace('|', '/')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, help="GPUs to plan for (default: those present)")
    parser.add_argument("--dry_run", action="store_true", help="list what would be launched, launch nothing")
    parser.add_argument("--configs", help="comma-separated config names (default: every shipped one)")
    parser.add_argument("--recipes", help=f"comma-separated recipes (default: {','.join(RECIPES)})")
    parser.add_argument("--no_bench", action="store_true", help="skip bench/mfu.py at the end")
    parser.add_argument("--output", default="runs/gpu_check")
    args = parser.parse_args(argv)
    import torch

    gpus = args.gpus or torch.cuda.device_count()
    if not gpus:
        parser.error("no GPU here: pass --dry_run --gpus N to see what it would launch")
    fp8 = args.dry_run or (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))
    rows = plan_rows(gpus, fp8)
    rows = [r for r in rows if (not args.configs or r.config in args.configs.split(","))
            and (not args.recipes or r.recipe in args.recipes.split(","))]  # fmt: skip
    if args.dry_run:
        for r in rows:
            what = f"not run: {r.skip}" if r.skip else "train" + (", resume, reload" if r.resume else "")
            flags = " ".join(r.launch_flags + [f.replace("{two_kv_heads}", "<a Llama with 2 kv heads>")
                                               for f in r.recipe_flags])  # fmt: skip
            print(f"{r.config:20s} {r.recipe:14s} {r.processes:>2} process(es) {flags:40s} {what}")
        print(f"{sum(not r.skip for r in rows)} launches planned for {gpus} GPU(s), then bench/mfu.py")
        return 0
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    kv2 = str(two_kv_heads_llama(output))
    (output / "rows.jsonl").write_text("")
    for row in rows:
        row.recipe_flags = [f.replace("{two_kv_heads}", kv2) for f in row.recipe_flags]
        if not row.skip:
            run_row(row, output)
            print(f"{row.config:20s} {row.recipe:14s} {row.status} ({row.seconds} s) {row.error}", flush=True)
        with (output / "rows.jsonl").open("a") as f:
            f.write(json.dumps(asdict(row)) + "\n")
    print(f"\n{torch.cuda.get_device_name(0)} x {gpus}, {time.strftime('%Y-%m-%d')}\n\n{table(rows)}\n", flush=True)
    failed = [r for r in rows if r.status.startswith("failed")]
    if not args.no_bench:
        bench = subprocess.run([sys.executable, str(ROOT / "bench" / "mfu.py"), "--repeats", "1", "--output",
                                str(output / "mfu")], cwd=ROOT)  # fmt: skip
        failed += [Row("bench/mfu.py", "-", 0)] if bench.returncode else []
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
