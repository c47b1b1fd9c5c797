"""`make gpu-check`: the proof, on whatever GPUs a machine has, that every shipped config trains there.

For each shipped config that fits the GPUs present, each decoder recipe in tiny mode at the recipe's own precision
and flags (and the GRPO, image-text and MoE LoRA recipes under the config each documents): only the model's width
and depth, the data and the run's length are tiny mode's (on a GPU it keeps bf16, flex attention, the fused loss,
--torch_compile auto; the training flags it changes are set back, OWN_FLAGS):
  train      10 steps, a checkpoint at step 5 and at step 10, the export
  resume     (llama3_fft rows, and each recipe's first row) from a copy of checkpoint-5 to step 10: same losses
  reload     the model `toolkit generate` loads from the export (or the adapter on its base) holds the weights of
             checkpoint-10, read as a resume reads them (DeepSpeed's partitions, FSDP's shards, safetensors)
  generate   (the rows that resume) `python -m toolkit generate` answers a prompt
then bench/mfu.py (speed, MFU and memory against the plan, one repeat). One table on stdout, also when a row raises
or the sweep is interrupted; one JSON line per row in OUTPUT/rows.jsonl as each ends; a row that fails, whatever it
raised, holds its error and the rest still runs. Offline. On one GPU: 42 rows, 61 launches (the expert-parallel
row needs 2 GPUs); on an H100 a row took 20-140 s (the resumed and compiled ones longest): about 40 minutes one
row at a time, estimated, so on one GPU 3 rows run side by side (--jobs; 3 sweeps side by side ran 11 rows in
285 s there); then bench/mfu.py's 15 variants, 30-110 s each. --configs/--recipes narrow it (a task recipe
named in --recipes runs under each config named, not only its own).

    make gpu-check                      # = python bench/gpu_check.py
    python bench/gpu_check.py --jobs 1 --no_bench   # one row at a time, no speed table
    python bench/gpu_check.py --dry_run --gpus 8    # what it would launch for 8 GPUs (any machine; the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the toolkit, imported below from the checkout

from toolkit.errors import ConfigError, command  # noqa: E402

RECIPES = ("llama3_fft", "llama3_lora", "llama3_qlora", "smollm2_chat")  # decoders whose tiny mode needs no other run
EXPERT_RECIPES = ("qwen3_moe_fft",)  # what an expert-parallel config trains: a mixture of experts, every weight
# Online RL, image-text and MoE LoRA recipes, each under the config its docstring launches it with
TASK_RECIPES = {"qwen3_grpo": "fsdp2", "gemma3_vlm_lora": "ddp", "qwen2_5_vl_lora": "fsdp2", "qwen3_moe_lora": "fsdp2"}
RESUMED = ("llama3_fft",)  # resumed under every config; the other recipes under their first config
STEPS, SAVE_AT = 10, 5
PROMPT = "What is 2 + 3?"
ENGINES = {"DEEPSPEED": "DEEPSPEED", "FSDP": "FSDP"}  # else: replicated (Requested.engine's names)
# Training flags tiny mode changes (toolkit/models/tiny.py's TINY_TRAINING) and a row sets back to the recipe's:
# pipeline stages take the accumulation steps as micro-batches, checkpointing recomputes activations, dropout draws
# masks a resume must replay, the recipe's attention kernel, its evaluation as it trains (smollm2_chat's held-out
# fraction and answers to held-out prompts, generated under each strategy). Tiny mode's sizes, data, 10 steps, a
# learning rate at which a random model's loss moves (a wrong resume shows) and no evaluation after training (a
# command of its own) stay. The decoders' configs have no dropout of their own (Llama 3's attention_dropout is
# 0.0), so the tiny model's, set to 0, is theirs.
OWN_FLAGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "activation_checkpointing", "lora_dropout",
             "attn_implementation", "eval_fraction", "generation_samples")  # fmt: skip


STDOUT = threading.Lock()  # rows run side by side (--jobs) swap sys.stdout one at a time, and print between


class RowFailure(Exception):
    """A row's own check failed (a launch's exit, resumed losses, reloaded weights): its message is the error."""


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
    reload: str = ""
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
    if "ep" in mesh:  # the tiny MoE's 4 experts over 2 ranks, every GPU an FSDP2 shard
        if gpus < 2:
            return 0, [], "needs 2 GPUs"
        shards = gpus - gpus % 2
        return shards, [f"--parallelism_config_dp_shard_size={shards}", "--parallelism_config_ep_size=2"], ""
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


@functools.cache
def own_flags(recipe: str) -> tuple[str, ...]:
    """Flags setting OWN_FLAGS back to the recipe's values (defaults included) where tiny mode changes them."""
    from toolkit.models.tiny import TINY_TRAINING
    from toolkit.project import load_recipe
    from toolkit.settings.parser import parse

    args = parse(load_recipe(recipe), recipe, [])
    parts = (args.model, args.data, args.run, args.training)
    flags: list[str] = []
    for key in OWN_FLAGS:
        value = next(getattr(part, key) for part in parts if hasattr(part, key))
        if key in TINY_TRAINING and value != TINY_TRAINING[key] and (key != "lora_dropout" or args.model.use_lora):
            flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return tuple(flags)


def plan_rows(gpus: int, fp8: bool, named: tuple[str, ...] = ()) -> list[Row]:
    """Every (config, recipe) pair to launch on `gpus` GPUs, with why a pair is not launched. The task recipes run
    under the config each documents, and under every config where `named` (--recipes) names them."""
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
        section = config.get("parallelism_config") or {}
        experts = "parallelism_config_ep_size" in section
        tasks = tuple(recipe for recipe, own in TASK_RECIPES.items() if own == path.stem or recipe in named)
        for recipe in EXPERT_RECIPES if experts else RECIPES + tasks:
            row = Row(path.stem, recipe, processes, flags, list(own_flags(recipe)))
            if "tp" in str(flags) and recipe.startswith("llama3"):  # the tiny Llama 3 has 1 key/value head: a
                # user's Llama with 2 (made once)
                row.recipe_flags += ["--model_name_or_path", "{two_kv_heads}"]
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
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".log").write_text(result.stdout + result.stderr)  # beside the run: the whole story of a failure
    return result


def losses(folder: Path) -> list[float]:
    log = folder / "run_log.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return [line["loss"] for line in lines if "loss" in line]


def plain_name(name: str) -> str:
    """A weight's name without what wrappers add (compile's _orig_mod, DDP's module, FSDP1's and checkpointing's
    wrappers) nor peft's adapter name, which its files leave out."""
    skip = {"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "default"}
    return ".".join(part for part in name.split(".") if part not in skip)


def checkpoint_weights(folder: Path) -> dict:
    """A checkpoint's weights as a resume reads them: DeepSpeed's ZeRO partitions (fp32), FSDP's sharded folder,
    else the Trainer's or the pipeline stages' safetensors (whole, sharded with an index, or a LoRA adapter)."""
    import torch
    from safetensors.torch import load_file

    if (folder / "latest").is_file():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder)))
    if (folder / "pytorch_model_fsdp_0").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(folder / "pytorch_model_fsdp_0", Path(scratch) / "model.pt")
            return torch.load(Path(scratch) / "model.pt", weights_only=True)["model"]
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("adapter_model.safetensors"))
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def check_reload(run: Path, checkpoint: Path) -> int:
    """The model `toolkit generate` loads from the run's export holds the checkpoint's every tensor (each compared at
    the lower precision of the two: fp32 master weights against bf16 ones); raises RowFailure naming the first that
    differs or is missing. Returns how many were compared."""
    import torch

    from toolkit.generate import load

    if not checkpoint.is_dir():
        raise RowFailure(f"no {checkpoint.name} to compare the export with")
    quiet = io.StringIO()  # the loaders' progress bars and notes; what fails is raised
    with STDOUT, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # one row's at a time
        model, _ = load(run)
        loaded = {plain_name(name): tensor.cpu() for name, tensor in model.state_dict().items()}  # load: on the GPU
        saved = {plain_name(name): tensor for name, tensor in checkpoint_weights(checkpoint).items()}
    if not saved:
        raise RowFailure(f"{checkpoint.name} holds no weights")
    for name, tensor in saved.items():
        if name not in loaded:
            raise RowFailure(f"the reloaded export has no {name}, which {checkpoint.name} holds")
        other = loaded[name]
        dtype = tensor.dtype if tensor.element_size() <= other.element_size() else other.dtype
        if tensor.shape != other.shape or not torch.equal(tensor.to(dtype), other.to(dtype)):
            raise RowFailure(f"the reloaded export's {name} differs from {checkpoint.name}'s")
    return len(saved)


def checked(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """The launch's result, or its failure; a launch that a Ctrl-C (or a device call's limit: `timeout -s INT`
    signals the whole group) ended is the sweep's interruption, not the row's failure."""
    if result.returncode in (130, -signal.SIGINT) or "\nKeyboardInterrupt" in f"\n{result.stderr}":
        raise KeyboardInterrupt
    if result.returncode:
        raise RowFailure(error_line(result.stderr))
    return result


def run_row(row: Row, output: Path) -> None:
    """Train, resume, reload and generate as the row says; whatever it raises is its failure, with that error (a
    Ctrl-C marks it interrupted and goes on up)."""
    start = time.perf_counter()
    out = output / row.config / row.recipe
    stage = "train"
    try:
        if "{two_kv_heads}" in row.recipe_flags:
            kv2 = str(two_kv_heads_llama(output))
            row.recipe_flags = [f.replace("{two_kv_heads}", kv2) for f in row.recipe_flags]
        shutil.rmtree(out, ignore_errors=True)
        checked(launch(row, out / "run", []))
        row.losses = losses(out / "run")
        if len(row.losses) != STEPS:
            raise RowFailure(f"{len(row.losses)} losses logged, not one for each of the {STEPS} steps")
        if row.resume:
            stage = "resume"
            (out / "resumed").mkdir(parents=True)
            shutil.copytree(out / "run" / f"checkpoint-{SAVE_AT}", out / "resumed" / f"checkpoint-{SAVE_AT}")
            checked(launch(row, out / "resumed", ["--resume", "auto"]))
            row.resumed_losses = losses(out / "resumed")[-(STEPS - SAVE_AT) :]
            expected = row.losses[-(STEPS - SAVE_AT) :]
            if len(row.resumed_losses) != len(expected) or any(
                abs(a - b) > 2e-3 * max(abs(b), 1) for a, b in zip(row.resumed_losses, expected, strict=True)
            ):
                raise RowFailure(f"resumed losses {row.resumed_losses} differ from {expected}")
        stage = "reload"
        row.reload = f"same weights ({check_reload(out / 'run', out / 'run' / f'checkpoint-{STEPS}')} tensors)"
        if row.resume:
            stage = "generate"
            command_line = [sys.executable, "-m", "toolkit", "generate", str(out / "run"), "--prompt", PROMPT,
                            "--max_new_tokens", "8"]  # fmt: skip
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            generated = checked(subprocess.run(command_line, capture_output=True, text=True, env=env, cwd=ROOT))
            row.answer = generated.stdout.strip().splitlines()[-1][:80] if generated.stdout.strip() else ""
        row.status = "ok"
    except KeyboardInterrupt:
        row.status = f"interrupted: {stage}"
        raise
    except Exception as failure:  # noqa: BLE001 (whatever a row raises is that row's failure, not the sweep's end)
        own = isinstance(failure, RowFailure)
        row.status, row.error = f"failed: {stage}", str(failure) if own else f"{type(failure).__name__}: {failure}"
    finally:
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
    lines = ["| config | recipe | processes | result | seconds | last loss | resumed | reload | answer |",
             "| --- | --- | ---: | --- | ---: | ---: | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        result = r.status if r.status != "pending" else "not run: the sweep was interrupted"
        if r.skip:
            result = f"not run: {r.skip}"
        elif r.error:
            result = f"{r.status}: {r.error}"
        resumed = "same losses" if r.resumed_losses else ("-" if not r.resume else "")
        last = f"{r.losses[-1]:.3f}" if r.losses else "-"
        answer = r.answer.replace("|", "/")
        lines.append(f"| {r.config} | {r.recipe} | {r.processes or '-'} | {result.replace('|', '/')} | "
                     f"{r.seconds or '-'} | {last} | {resumed} | {r.reload} | {answer} |")  # fmt: skip
    return "\n".join(lines)


def devices() -> tuple[int, str]:
    """The GPUs torch sees here, and the first one's name."""
    import torch

    if not torch.cuda.is_available():
        return 0, ""
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def check_names(given: str | None, known: list[str], what: str, where: str) -> list[str]:
    """The comma-separated names of --configs or --recipes, each one gpu-check knows, or one error line."""
    names = [name.strip() for name in (given or "").split(",") if name.strip()] or known
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"unknown {what} {', '.join(repr(n) for n in unknown)}: gpu-check knows {', '.join(known)} "
                          f"({where}); pass some of them, comma-separated.")  # fmt: skip
    return names


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, help="GPUs to plan for (default: those present)")
    parser.add_argument("--dry_run", action="store_true", help="list what would be launched, launch nothing")
    parser.add_argument("--configs", help="comma-separated config names (default: every shipped one)")
    parser.add_argument("--recipes", help=f"comma-separated recipes (default: {','.join(RECIPES)})")
    parser.add_argument("--no_bench", action="store_true", help="skip bench/mfu.py at the end")
    parser.add_argument("--jobs", type=int, help="rows at once, on one GPU only (default there: 3): a tiny row "
                        "leaves the GPU mostly idle (3 side by side on an H100 ran 11 rows in 285 s)")  # fmt: skip
    parser.add_argument("--output", default="runs/gpu_check")
    args = parser.parse_args(argv)
    from toolkit.project import strategy_files

    configs = check_names(args.configs, [p.stem for p in strategy_files()], "config", "accelerate_configs/*.yaml")
    recipes = check_names(args.recipes, [*RECIPES, *EXPERT_RECIPES, *TASK_RECIPES], "recipe",
                          "the decoder recipes in recipes/")  # fmt: skip
    present, device_name = devices()
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: pass 1 or more.")
    if not args.dry_run and not present:
        raise ConfigError("no GPU here (torch sees none): gpu-check launches on GPUs; `python bench/gpu_check.py "
                          "--dry_run --gpus N` lists what it would launch on N.")  # fmt: skip
    if not args.dry_run and args.gpus and args.gpus > present:
        raise ConfigError(f"--gpus {args.gpus}, and this machine has {present} GPU{'s' if present > 1 else ''}: pass "
                          f"--gpus {present} or fewer (or --dry_run --gpus N for the plan alone).")  # fmt: skip
    gpus = args.gpus or present
    if not gpus:
        raise ConfigError("no GPU here to plan for: pass --dry_run --gpus N to see what it would launch on N.")
    args.jobs = args.jobs or (3 if gpus == 1 else 1)
    if args.jobs < 1 or (args.jobs > 1 and gpus > 1):
        raise ConfigError(f"--jobs {args.jobs}: rows run side by side only on one GPU, whose rows are one process "
                          f"each; pass --jobs 1{' or --gpus 1' if gpus > 1 else ''}.")  # fmt: skip
    import torch

    fp8 = args.dry_run or (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))
    rows = [r for r in plan_rows(gpus, fp8, tuple(recipes) if args.recipes else ()) if r.config in configs
            and r.recipe in recipes]  # fmt: skip
    if not rows:
        raise ConfigError(f"--configs {','.join(configs)} x --recipes {','.join(recipes)}: no row to launch (the "
                          f"expert-parallel configs train {', '.join(EXPERT_RECIPES)} alone, and only under them); "
                          "--dry_run lists every row.")  # fmt: skip
    if args.dry_run:
        for r in rows:
            steps = "train, resume, reload, generate" if r.resume else "train, reload"
            what = f"not run: {r.skip}" if r.skip else steps
            flags = " ".join(r.launch_flags + [f.replace("{two_kv_heads}", "<a Llama with 2 kv heads>")
                                               for f in r.recipe_flags])  # fmt: skip
            print(f"{r.config:20s} {r.recipe:14s} {r.processes:>2} process(es) {flags:40s} {what}")
        run = [r for r in rows if not r.skip]
        print(f"{len(run)} rows planned for {gpus} GPU(s): {len(run) + sum(r.resume for r in run)} launches "
              f"({sum(r.resume for r in run)} resumed), then bench/mfu.py")  # fmt: skip
        return 0
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "rows.jsonl").write_text("")

    recorded: set[int] = set()

    def record(row: Row) -> None:
        recorded.add(id(row))
        with STDOUT:
            if not row.skip:
                print(f"{row.config:20s} {row.recipe:14s} {row.status} ({row.seconds} s) {row.error}", flush=True)
            with (output / "rows.jsonl").open("a") as f:
                f.write(json.dumps(asdict(row)) + "\n")

    pool = ThreadPoolExecutor(args.jobs)
    try:  # the table, whatever ends the sweep
        if args.jobs == 1:
            for row in rows:
                if not row.skip:
                    run_row(row, output)
                record(row)
        else:  # each row's launches are subprocesses: threads wait on them
            for row in [r for r in rows if r.skip]:
                record(row)
            running = {pool.submit(run_row, row, output): row for row in rows if not row.skip}
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()
                    record(running.pop(future))
    except KeyboardInterrupt:
        pool.shutdown(wait=True, cancel_futures=True)  # the running rows' launches had the Ctrl-C too
        for row in rows:  # the rows it stopped in
            if row.status != "pending" and id(row) not in recorded:
                record(row)
        return 130
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        print(f"\n{device_name} x {gpus}, {time.strftime('%Y-%m-%d')}\n\n{table(rows)}\n", flush=True)
    failed = [r for r in rows if r.status.startswith("failed")]
    if not args.no_bench:
        bench = subprocess.run([sys.executable, str(ROOT / "bench" / "mfu.py"), "--repeats", "1", "--output",
                                str(output / "mfu")], cwd=ROOT)  # fmt: skip
        failed += [Row("bench/mfu.py", "-", 0)] if bench.returncode else []
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
