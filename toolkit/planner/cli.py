"""`python -m toolkit plan MODEL`: memory, fit, time and cost of a fine-tune under every strategy file, before
anything is launched, offline for the recipes' models.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import asdict, fields, replace

from ..data.sources import model_config, stored_split_size
from ..errors import ConfigError, command
from ..metrics.cost import device_spec, price_table
from ..metrics.memory import GIB
from ..models.meta import meta_model
from ..models.parallel import (
    check_expert_parallel,
    check_sequence_heads,
    check_split_task,
    check_tensor_parallel,
    recipe_lora_targets,
)
from ..models.pipeline import check_pipeline
from ..project import is_recipe, load_recipe, recipe_name, strategy_files
from ..settings.mesh import PIPELINE_SCHEDULES
from ..settings.model_arguments import ModelArguments
from ..settings.policy import PolicyArguments
from ..settings.tasks import TASKS, infer_task
from ..settings.tasks import task as task_table
from .activations import measured_activations
from .estimate import (
    ASSUMED_MFU,
    FP8_SPEEDUP,
    PREFERENCE,
    assumed_mfu,
    bubble,
    cost_from_throughput,
    images_caveat,
    master_weights,
    reward_model_bytes,
    samples_per_second_at_mfu,
    task_workload,
    training_flops_per_token,
    verdicts,
)
from .layout import Layout
from .memory import OPTIMIZER_STATE_BYTES, PRECISIONS, Workload, all_to_all_bytes, expert_gather_bytes
from .sampling import grpo_step_time
from .shape import Shape
from .vision import measured_image_cost


def recipe_values(model: str) -> dict:
    """A recipe's RECIPE dict (recipes/<model>.py), or the bare minimum for a Hub id or a local folder."""
    return load_recipe(model) if is_recipe(model) else {"model_name_or_path": model}


def measured_tokens(model: str, task: str, seq_length: int) -> tuple[int, int, str] | str:
    """A recipe's training examples and their tokens, where its data and tokenizer can be read from here (the
    prepared data's count, else a sample tokenized as the run will: data/preparation.py's data_tokens); else why
    not. Packed or not, a run trains on these tokens: packing fills rows with them, it does not add any."""
    if not is_recipe(model):
        return "not a recipe: pass --samples and --tokens_per_sample"
    if task_table(task).pairs:
        return "preference pairs are tokenized by TRL: pass --tokens_per_sample"
    from ..data.preparation import data_tokens
    from ..errors import ToolkitError
    from ..models.loading import blueprint
    from ..settings.parser import parse

    try:
        arguments = parse(load_recipe(model), model, ["--max_seq_length", str(seq_length)])
        model_plan = blueprint(arguments)
        return data_tokens(arguments, model_plan.tokenizer, model_plan.packing)
    except ToolkitError as error:  # the Hub out of reach, a data set not here: the plan still stands
        return f"the data cannot be read here ({str(error).split(':')[0]}); pass --tokens_per_sample"


# A plan needs a device's memory and datasheet peak, which only the table has (a run takes --hourly_usd instead).
PLAN_ANY_GPU = "or add it, with its memory_gb, peak_tflops and price, to toolkit/metrics/hardware.yaml"


def build_plan(args) -> dict:
    values = recipe_values(args.model)
    config = model_config(values["model_name_or_path"])
    task = args.task or values.get("task") or infer_task(config)
    model_fields = {f.name for f in fields(ModelArguments)}
    lora = ModelArguments(**{k: v for k, v in values.items() if k in model_fields}).lora_settings()
    parts = values.get("train_parts", ModelArguments.train_parts)
    shape = Shape.of(meta_model(config, task, lora, parts), config)
    low_precision = values.get("dtype") in ("bfloat16", "float16")
    mixed = values.get("bf16") or values.get("fp16")
    precision = args.precision or ("bf16" if low_precision else "bf16-mixed" if mixed else "fp32")
    fused = values.get("fused_loss") if args.fused_loss is None else args.fused_loss
    masters = precision == "bf16" and master_weights(lora is not None, bool(mixed), values.get("fp32_master_weights"))
    work = Workload(
        precision=precision,
        optimizer=args.optimizer,
        micro_batch=args.micro_batch or values.get("per_device_train_batch_size", 8),
        micro_batches=values.get("gradient_accumulation_steps", 1),
        seq_length=args.seq_length or values.get("max_seq_length", 512),
        activation_checkpointing=values.get("activation_checkpointing", False)
        if args.activation_checkpointing is None
        else args.activation_checkpointing,
        flash_attention=values.get("attn_implementation") != "eager",
        cuda_context_gib=args.cuda_context_gib,
        weights_4bit=bool(values.get("load_in_4bit")),
        master_weights=masters,
        trainable_fp32=lora is not None or bool(values.get("fp16")),
        lora_dropout=values.get("lora_dropout", ModelArguments.lora_dropout) if lora is not None else 0.0,
        reward_model_bytes=reward_model_bytes(task, PolicyArguments(reward_funcs=values.get("reward_funcs"))),
        **task_workload(task, lora is not None, fused, beta=values.get("beta") or 0.0),
    )
    fit, activations_note = measured_activations(config, task, work.precision, work.flash_attention, work.fused_head,
                                                 lora, bool(mixed))  # fmt: skip
    image, image_note = None, ""
    if task_table(task).images:
        image, image_note = measured_image_cost(config, task, lora, parts, work.precision, bool(mixed),
                                                args.images_per_sample)  # fmt: skip
    shape = replace(shape, activations=fit, image=image)
    gpu = device_spec(args.gpu, PLAN_ANY_GPU)
    online = task_table(task).samples_online  # GRPO: each step samples, then trains (sampling.py)
    samples = args.samples or stored_split_size(values)
    epochs = args.epochs or values.get("num_train_epochs", 1)
    tokens_per_sample, tokens_source = args.tokens_per_sample, "as given"
    if tokens_per_sample is None and not online:
        measured = measured_tokens(args.model, task, work.seq_length)
        if isinstance(measured, str):
            tokens_per_sample, tokens_source = work.seq_length, f"full rows: {measured}"
        else:
            examples, tokens, tokens_source = measured
            samples = args.samples or examples
            tokens_per_sample = tokens / examples
    data = dict(samples=samples, epochs=epochs, tokens_per_sample=tokens_per_sample, tokens_source=tokens_source)
    if online:
        data = online_data(values, work, args.gpus * args.nodes, samples, epochs)
        samples = data["steps"]
    results = []
    layouts = {p.stem: Layout.from_file(p) for p in strategy_files()}
    fp8 = "fp8" in gpu["peak_tflops"]  # FP8 tensor cores (metrics/hardware.yaml)
    for v in verdicts(shape, work, gpu["memory_gb"], args.gpus, args.nodes, args.headroom, list(layouts.values()),
                      fp8):  # fmt: skip
        row = asdict(v)
        layout = layouts[v.config]
        if v.expert_parallel > 1 and layout.expert_parallel > 1:  # sized for the job (estimate.sized_experts)
            layout = Layout.experts(v.config, v.expert_parallel, args.gpus * args.nodes)
        row["refused"] = refusal(replace(layout, pipeline_stages=v.pipeline_stages), config, task, values)
        if v.pipeline_stages > 1:
            layout = Layout.pipeline(v.config, v.pipeline_stages, layout.pipeline_schedule,
                                     args.gpus * args.nodes // v.pipeline_stages)  # fmt: skip
            row["bubble"] = bubble(v.pipeline_stages, work.micro_batches)
        mfu = args.mfu or assumed_mfu(layout, work.micro_batches)
        peak = gpu["peak_tflops"]["fp32" if precision == "fp32" else "bf16"]
        if samples and online and gpu.get("memory_tbs"):  # a step's two phases; `samples` are steps
            step = grpo_step_time(shape, work, data["prompt_tokens"], data["completion_tokens"],
                                  gpu["memory_tbs"] * 1e12, peak * 1e12, mfu, bool(values.get("beta")))  # fmt: skip
            cost = cost_from_throughput(samples, 1, 1 / step.total, args.gpus * args.nodes, gpu["on_demand"],
                                        args.overhead, gpu.get("spot"))  # fmt: skip
            row.update(mfu=mfu, step_seconds=asdict(step), device_hours=cost.device_hours, usd=cost.usd,
                       usd_spot=cost.usd_spot)  # fmt: skip
        elif samples:
            rate = samples_per_second_at_mfu(shape, tokens_per_sample, mfu, args.gpus * args.nodes, peak,
                                             work.sequences_per_sample, task_table(task).reference)  # fmt: skip
            rate *= FP8_SPEEDUP if layout.fp8 else 1
            cost = cost_from_throughput(samples, epochs, rate, args.gpus * args.nodes, gpu["on_demand"],
                                        args.overhead, gpu.get("spot"))  # fmt: skip
            row.update(mfu=mfu, samples_per_second=rate, device_hours=cost.device_hours, usd=cost.usd,
                       usd_spot=cost.usd_spot)  # fmt: skip
        if layout.expert_parallel > 1:  # what its all-to-alls send a step, and the experts' gathers they replace
            exchanged = all_to_all_bytes(shape, work, layout.expert_parallel)
            row.update(all_to_all_gib=exchanged / GIB,
                       expert_gathers_gib=expert_gather_bytes(shape, work, args.gpus * args.nodes) / GIB)  # fmt: skip
            if gpu.get("link_gbs"):
                row["all_to_all_seconds"] = exchanged / (gpu["link_gbs"] * 1e9)
        results.append(row)
    results.sort(key=lambda r: PREFERENCE.index(r["config"]) if r["config"] in PREFERENCE else len(PREFERENCE))
    fitting = [r for r in results if r["micro_batch"] and not r["refused"]]  # in order of preference
    return {
        "model": values["model_name_or_path"],
        "recipe": args.model if is_recipe(args.model) else None,
        "task": task,
        "parameters": {
            "total": shape.total,
            "trainable": shape.trainable,
            "frozen": shape.frozen,
            "active_per_token": shape.active,  # a mixture of experts: less the routed experts a token skips
            "routing": shape.routing,
            "largest_module": shape.largest_module,
            "largest_fsdp_unit": shape.largest_unit,
        },  # fmt: skip
        "hardware": {
            "gpu": args.gpu,
            "memory_gib": gpu["memory_gb"],
            "gpus_per_node": args.gpus,
            "nodes": args.nodes,
            "headroom": args.headroom,
        },  # fmt: skip
        "workload": asdict(work),
        "activations": activations_note if fit else f"{activations_note}; from the Llama/BERT-style formula",
        "conservative": shape.conservative,
        "images": image_note if image else None,
        "left_out": images_caveat(task, image, image_note),
        "data": data if samples or online else None,
        "flops_per_token": training_flops_per_token(shape, work.seq_length, task_table(task).reference),
        "configs": results,
        "recommended": fitting[0]["config"] if fitting else None,
        "recommended_micro_batch": fitting[0]["micro_batch"] if fitting else None,
        "recommended_pipeline_stages": fitting[0]["pipeline_stages"] if fitting else 1,
        "recommended_expert_parallel": fitting[0]["expert_parallel"] if fitting else 1,
    }


def online_data(values: dict, work: Workload, devices: int, prompts: int | None, epochs: float) -> dict:
    """What times an online-RL run: its steps (--max_steps, else its prompts' completions over the global batch),
    each prompt's room (max_seq_length less the completion's) and the completions' full length."""
    completion = values.get("max_completion_length", PolicyArguments.max_completion_length)
    generations = values.get("num_generations", PolicyArguments.num_generations)
    rows = work.micro_batch * work.micro_batches * devices
    steps = values.get("max_steps", -1)
    if steps <= 0:
        steps = math.ceil(prompts * generations * epochs / rows) if prompts else 0
    return dict(steps=steps, prompts=prompts, epochs=epochs, generations=generations, rows_per_step=rows,
                prompt_tokens=work.seq_length - completion, completion_tokens=completion)  # fmt: skip


def online_lines(plan: dict) -> list[str]:
    """How an online-RL plan reads: which phase the memory is, what a step costs in each phase and why the
    sampling figure is a floor."""
    d, w, task = plan["data"], plan["workload"], plan["task"]
    rows = w["micro_batch"] * w["micro_batches"]
    lines = [f"{task:<12}memory of the larger phase: sampling {rows} rows a device at once (their KV cache at "
             f"{w['seq_length']} tokens, the sampling buffers) or the training step"]  # fmt: skip
    timed = next((r for r in plan["configs"] if "step_seconds" in r), None)
    if not timed:
        lines.append(
            f"{'':<12}time and dollars need the steps (--samples, the prompts, or the recipe's max_steps) "
            "and the device's memory_tbs (toolkit/metrics/hardware.yaml)"
        )
        return lines
    step = timed["step_seconds"]
    lines += [
        f"{'':<12}{d['steps']:,} steps of {d['rows_per_step']} completions (prompts up to {d['prompt_tokens']} tokens, "
        f"completions up to {d['completion_tokens']}); a step on {timed['config']}: sampling at least "
        f"{step['sampling']:.3g} s, training {step['training']:.3g} s at the MFU below",
        f"{'':<12}sampling is the decode roofline (each new token reads the weights and the KV cache once, at the "
        "datasheet bandwidth; every completion full length): no engine beats it and transformers' generate stays "
        "well above it, so GPU-hours and dollars are floors; the run measures the real split (sampling_share)",
    ]  # fmt: skip
    return lines


def refusal(layout: Layout, config, task: str, values: dict) -> str | None:
    """Why a launch of this layout would refuse this model and recipe (the checks `toolkit check` and the run make
    before weights load: tensor-parallel heads, a pipeline's tied embeddings, a split of a classifier's rows), or
    None: a plan recommends only what runs."""
    sequence_axis = "sp" if layout.engine == "deepspeed" else "cp"
    mesh = {axis: size for axis, size in (("tp", layout.tensor_parallel), ("pp", layout.pipeline_stages),
                                          (sequence_axis, layout.sequence_split)) if size > 1}  # fmt: skip
    if layout.expert_parallel > 1:
        try:
            check_expert_parallel(config, {"dp_shard": layout.expert_parallel, "ep": layout.expert_parallel},
                                  layout.expert_parallel, bool(values.get("use_lora")))  # fmt: skip
        except ConfigError as error:
            return str(error)
    if not mesh:
        return None
    world = math.prod(mesh.values())
    try:
        check_split_task(mesh, task)
        check_tensor_parallel(config, mesh, world, lora_targets=recipe_lora_targets(values), task=task)
        check_sequence_heads(config, mesh.get("sp", 1))
        check_pipeline(config, mesh, task, world_size=world, load_in_4bit=bool(values.get("load_in_4bit")),
                       schedule=layout.pipeline_schedule or PIPELINE_SCHEDULES[0],
                       fp16=bool(values.get("fp16")))  # fmt: skip
    except ConfigError as error:
        return str(error)
    return None


def render(plan: dict) -> str:
    p, h, w = plan["parameters"], plan["hardware"], plan["workload"]
    lines = [
        f"model       {plan['model']}"
        + (f"  (recipe {plan['recipe']})" if plan["recipe"] else f"  (task {plan['task']})"),
        f"parameters  {p['total']:,} total, {p['trainable']:,} trainable, {p['frozen']:,} frozen; "
        + (f"{p['active_per_token'] / 1e9:.3g}B active per token ({p['routing']}); " if p.get("routing") else "")
        + f"largest module {p['largest_module']:,}",
        f"hardware    {h['nodes']} node(s) x {h['gpus_per_node']} x {h['gpu']} ({h['memory_gib']} GB), "
        f"{int(h['headroom'] * 100)}% headroom",
        f"workload    {w['precision']}{', fp32 master weights' if w['master_weights'] else ''}, {w['optimizer']}, "
        f"micro-batch {w['micro_batch']}"
        + (f" pairs ({w['micro_batch'] * 2} sequences)" if task_table(plan["task"]).pairs else "")
        + f" x {w['seq_length']} tokens, "
        f"activation checkpointing {'on' if w['activation_checkpointing'] else 'off'}, "
        f"CUDA context {w['cuda_context_gib']} GiB",
        f"activations {plan['activations']}",
        *([f"images      {plan['images']}"] if plan.get("images") else []),
        *([f"upper bound {plan['conservative']}"] if plan.get("conservative") else []),
        *([f"left out    {plan['left_out']}"] if plan.get("left_out") else []),
    ]
    if plan["data"] and not task_table(plan["task"]).samples_online:
        d = plan["data"]
        lines.append(f"data        {d['samples']:,} samples x {d['epochs']:g} epoch(s) x "
                     f"{d['tokens_per_sample']:,.0f} tokens ({d['tokens_source']}); {plan['flops_per_token']:.3g} "
                     "training FLOPs per token"
                     + (f", of the {p['active_per_token'] / 1e9:.3g}B parameters active per token" if p.get("routing")
                        else ""))  # fmt: skip
    if task_table(plan["task"]).samples_online:
        lines.extend(online_lines(plan))
    lines.append("")
    costed = "usd" in plan["configs"][0] if plan["configs"] else False
    fits = f"fits@{w['micro_batch']}"
    header = f"{'config':<20}{'GiB/GPU':>9}{'host GiB/node':>15}{'at load':>9}  {fits:<8}{'max micro-batch':>16}"
    if costed:  # cents and hundredths of an hour only where the amounts are small
        cents = 2 if max(r["usd"] for r in plan["configs"]) < 100 else 0
        hour_digits = 2 if max(r["device_hours"] for r in plan["configs"]) < 10 else 1
        header += f"{'MFU':>6}{'GPU-hours':>11}{'$ on-demand':>13}{'$ spot':>10}"
    lines.append(header)
    for r in plan["configs"]:
        line = (f"{r['config']:<20}{r['device_gib']:>9.1f}{r['host_gib_per_node']:>15.1f}"
                f"{r['host_load_gib_per_node']:>9.1f}  {'refused' if r['refused'] else 'yes' if r['fits'] else 'no':<8}"
                f"{(not r['refused'] and r['micro_batch']) or '-':>16}")  # fmt: skip
        if costed:
            spot = f"{r['usd_spot']:>10,.{cents}f}" if r["usd_spot"] is not None else f"{'-':>10}"
            line += f"{r['mfu']:>6.2f}{r['device_hours']:>11,.{hour_digits}f}{r['usd']:>13,.{cents}f}{spot}"
        lines.append(line)
    lines.append("")
    for r in plan["configs"]:
        if r["refused"]:
            lines.append(f"{r['config']}: refused for this model and recipe: {r['refused']}")
    for r in plan["configs"]:
        if r.get("pipeline_stages", 1) > 1 and not r["refused"]:
            lines.append(f"{r['config']}: {r['pipeline_stages']} stages (--parallelism_config_pp_size "
                         f"{r['pipeline_stages']}), {w['micro_batches']} micro-batch(es) a step: bubble "
                         f"(stages - 1) / micro-batches = {r['bubble']:.0%} idle time on top of the step's compute, "
                         "in the MFU; raise --gradient_accumulation_steps to shrink it")  # fmt: skip
    for r in plan["configs"]:
        if r.get("expert_parallel", 1) > 1 and not r["refused"]:
            seconds = (f" ({r['all_to_all_seconds']:.3g} s at the link's datasheet bandwidth)"
                       if "all_to_all_seconds" in r else "")  # fmt: skip
            lines.append(f"{r['config']}: experts split over {r['expert_parallel']} GPUs (--parallelism_config_"
                         f"ep_size {r['expert_parallel']}): each GPU sends {r['all_to_all_gib']:,.3g} GiB a step in "
                         f"all-to-alls{seconds}, and gathers none of the {r['expert_gathers_gib']:,.4g} GiB of "
                         "experts it would under FSDP; both in the assumed MFU")  # fmt: skip
    if costed and any(r["config"] == "fsdp2_fp8" for r in plan["configs"]):
        lines.append(f"fsdp2_fp8: {FP8_SPEEDUP:g}x bf16's speed assumed, with torch.compile (on by default under FP8); "
                     "one H100 measured 1.26x with it, 0.46x without, one H200 1.10x over compiled bf16 at 1B "
                     "(docs/benchmarks.md)")  # fmt: skip
    if plan["recommended"]:
        stages, ep = plan.get("recommended_pipeline_stages", 1), plan.get("recommended_expert_parallel", 1)
        flags = f" --parallelism_config_pp_size {stages} (python -m toolkit launch)" if stages > 1 else ""
        if ep > 1:
            world = plan["hardware"]["gpus_per_node"] * plan["hardware"]["nodes"]
            flags = (f" --parallelism_config_dp_shard_size {world} --parallelism_config_ep_size {ep} (python -m "
                     "toolkit launch)")  # fmt: skip
        lines.append(f"recommended: accelerate_configs/{plan['recommended']}.yaml{flags} with "
                     f"--per_device_train_batch_size {plan['recommended_micro_batch']}")  # fmt: skip
    else:
        least = min([r for r in plan["configs"] if not r["refused"]] or plan["configs"], key=lambda r: r["device_gib"])
        fixes = ["add GPUs or nodes", "shorten the sequence",
                 *([] if w["activation_checkpointing"] else ["turn on activation checkpointing"]),
                 *([] if p["frozen"] else ["train LoRA adapters"])]  # fmt: skip  # frozen weights: LoRA already
        lines.append(f"recommended: nothing fits; the least memory, {least['config']}, needs {least['device_gib']:.1f} "
                     f"GiB per GPU at micro-batch {w['micro_batch']}: {', '.join(fixes[:-1])} or "
                     f"{fixes[-1]}.")  # fmt: skip
    return "\n".join(lines)


def check_flags(args) -> None:
    """Values that would plan nonsense rather than fail: each refused with its domain, before anything is read."""
    for flag in ("gpus", "nodes", "micro_batch", "seq_length", "samples", "tokens_per_sample"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} must be at least 1, got {value}.")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu is a share of the GPU's peak, above 0 and at most 1, got {args.mfu:g}: 0.4, say.")
    if args.epochs is not None and args.epochs <= 0:
        raise ConfigError(f"--epochs must be positive, got {args.epochs:g}.")
    if args.overhead < 1:
        raise ConfigError(f"--overhead multiplies the cost and is at least 1, got {args.overhead:g}: 1.3, say.")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom is the share of device memory kept free, from 0 to below 1, got "
                          f"{args.headroom:g}: 0.1, say.")  # fmt: skip
    if args.cuda_context_gib < 0:
        raise ConfigError(f"--cuda_context_gib cannot be negative, got {args.cuda_context_gib:g}.")
    spec = device_spec(args.gpu, PLAN_ANY_GPU)
    if not spec.get("memory_gb") or not spec.get("peak_tflops"):
        gpus = [name for name, d in price_table()["devices"].items() if d.get("memory_gb") and d.get("peak_tflops")]
        raise ConfigError(f"--gpu {args.gpu} has no device memory or datasheet peak to plan with (it is priced for "
                          f"runs only): pass one of {', '.join(gpus)}.")  # fmt: skip


@command
def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit plan", description="Memory, fit, time and cost of a "
                                     "fine-tune, before launching it.")  # fmt: skip
    parser.add_argument("model", help="a recipe (llama3_fft, or its file recipes/llama3_fft.py), a Hub id with a "
                        "stored config, or a local folder")  # fmt: skip
    parser.add_argument("--gpu", default="A100-80GB", help="GPU type from toolkit/metrics/hardware.yaml")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--task", choices=sorted(TASKS), help="default: the recipe's, or inferred from the config")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the recipe's")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="adamw")
    parser.add_argument("--micro_batch", type=int, help="per-device batch; default: the recipe's")
    parser.add_argument("--seq_length", type=int, help="default: the recipe's max_seq_length")
    parser.add_argument("--activation_checkpointing", type=lambda v: v.lower() in ("1", "true", "yes"))
    parser.add_argument(
        "--fused_loss",
        type=lambda v: v.lower() in ("1", "true", "yes"),
        help="sft: score the loss with TRL's fused head, no full logits (default on GPUs)",
    )
    parser.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free")
    parser.add_argument("--cuda_context_gib", type=float, default=Workload.cuda_context_gib)
    parser.add_argument("--samples", type=int, help="training samples (default: the recipe's split, when known)")
    parser.add_argument("--epochs", type=float, help="default: the recipe's num_train_epochs")
    parser.add_argument("--tokens_per_sample", type=int, help="default: measured on the recipe's data where it "
                        "can be read (toolkit prepare makes it exact), else the sequence length")  # fmt: skip
    parser.add_argument(
        "--images_per_sample", type=float, default=1.0, help="an image-text run's images per training row (default 1)"
    )
    parser.add_argument("--mfu", type=float, help=f"override the assumed MFU {ASSUMED_MFU}")
    parser.add_argument("--overhead", type=float, default=1.3, help="cost factor for failed runs, tuning, debugging")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.model = recipe_name(args.model)  # recipes/llama3_fft.py, as a launch names it
    check_flags(args)
    with stdout_to_stderr():  # what the libraries print on the way (DeepSpeed's logger among them) is not the plan
        plan = build_plan(args)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0


@contextlib.contextmanager
def stdout_to_stderr():
    """Standard output goes to standard error for the block, at the descriptor: a logging handler that holds
    sys.stdout from before (DeepSpeed's, made at import) writes there too, so `plan --json` prints JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
