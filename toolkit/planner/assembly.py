"""A plan's assembly (`python -m toolkit plan`): the recipe's settings, the model's shape and measured activations,
the workload and the data, then every strategy file's row: its fit, what the launch would refuse, its time and cost,
and the recommendation (the first that fits, in order of preference)."""

from __future__ import annotations

import math
from dataclasses import asdict, fields, replace

from ..data.sources import model_config, stored_split_size
from ..errors import ConfigError
from ..metrics.cost import device_spec
from ..metrics.memory import GIB
from ..models.attention import choose_attention
from ..models.meta import meta_model
from ..models.parallel import (
    check_expert_parallel,
    check_sequence_heads,
    check_split_task,
    check_tensor_parallel,
    recipe_lora_targets,
)
from ..models.pipeline import check_pipeline
from ..project import is_recipe, load_recipe, strategy_files
from ..settings.compile import AUTO, choose_compile
from ..settings.mesh import PIPELINE_SCHEDULES
from ..settings.model_arguments import ModelArguments
from ..settings.policy import PolicyArguments
from ..settings.tasks import infer_task
from ..settings.tasks import task as task_table
from .compiled import float8_share, float8_speedup, planned_activations
from .estimate import (
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
    teacher_flops_per_token,
    teacher_row,
    teacher_shape,
    training_flops_per_token,
    verdicts,
)
from .layout import Layout
from .sampling import grpo_step_time
from .shape import Shape
from .traffic import all_to_all_bytes, expert_gather_bytes
from .vision import measured_image_cost
from .workload import Workload


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


def plan_workload(args, values: dict, task: str, lora: dict | None) -> Workload:
    """The workload the plan sizes: the recipe's settings, overridden by the command line's."""
    low_precision = values.get("dtype") in ("bfloat16", "float16")
    mixed = values.get("bf16") or values.get("fp16")
    precision = args.precision or ("bf16" if low_precision else "bf16-mixed" if mixed else "fp32")
    fused = values.get("fused_loss") if args.fused_loss is None else args.fused_loss
    masters = precision == "bf16" and master_weights(lora is not None, bool(mixed), values.get("fp32_master_weights"))
    return Workload(
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
        teacher=teacher_shape(task, values.get("teacher_model_name_or_path")),
        **task_workload(task, lora is not None, fused, beta=values.get("beta") or 0.0),
    )


def plan_data(args, values: dict, task: str, work: Workload) -> dict:
    """The data the plan prices: samples (GRPO: steps), epochs and tokens a sample, measured where the recipe's
    data can be read here."""
    samples = args.samples or stored_split_size(values)
    epochs = args.epochs or values.get("num_train_epochs", 1)
    if task_table(task).samples_online:  # GRPO: each step samples, then trains (sampling.py)
        return online_data(values, work, args.gpus * args.nodes, samples, epochs)
    tokens_per_sample, tokens_source = args.tokens_per_sample, "as given"
    if tokens_per_sample is None:
        measured = measured_tokens(args.model, task, work.seq_length)
        if isinstance(measured, str):
            tokens_per_sample, tokens_source = work.seq_length, f"full rows: {measured}"
        else:
            examples, tokens, tokens_source = measured
            samples = args.samples or examples
            tokens_per_sample = tokens / examples
    return dict(samples=samples, epochs=epochs, tokens_per_sample=tokens_per_sample, tokens_source=tokens_source)


def config_row(args, verdict, layout: Layout, plan: dict) -> dict:
    """One strategy file's row: its fit verdict, what a launch would refuse, its time and cost, and under expert
    parallelism what its all-to-alls send. `plan`: the shape, workload, GPU, data and recipe it prices."""
    shape, work, gpu, values, task = plan["shape"], plan["work"], plan["gpu"], plan["values"], plan["task"]
    samples, online, devices = plan["samples"], plan["online"], args.gpus * args.nodes
    row = asdict(verdict)
    if verdict.expert_parallel > 1 and layout.expert_parallel > 1:  # sized for the job (estimate.sized_experts)
        layout = Layout.experts(verdict.config, verdict.expert_parallel, devices)
    row["refused"] = refusal(replace(layout, pipeline_stages=verdict.pipeline_stages), plan["config"], task, values)
    if verdict.pipeline_stages > 1:
        layout = Layout.pipeline(verdict.config, verdict.pipeline_stages, layout.pipeline_schedule,
                                 devices // verdict.pipeline_stages)  # fmt: skip
        row["bubble"] = bubble(verdict.pipeline_stages, work.micro_batches)
    mfu = args.mfu or assumed_mfu(layout, work.micro_batches)
    peak = gpu["peak_tflops"]["fp32" if work.precision == "fp32" else "bf16"]
    data = plan["data"]
    if samples and online and gpu.get("memory_tbs"):  # a step's two phases; `samples` are steps
        step = grpo_step_time(shape, work, data["prompt_tokens"], data["completion_tokens"],
                              gpu["memory_tbs"] * 1e12, peak * 1e12, mfu, bool(values.get("beta")))  # fmt: skip
        cost = cost_from_throughput(samples, 1, 1 / step.total, devices, gpu["on_demand"], args.overhead,
                                    gpu.get("spot"))  # fmt: skip
        row.update(mfu=mfu, step_seconds=asdict(step), device_hours=cost.device_hours, usd=cost.usd,
                   usd_spot=cost.usd_spot)  # fmt: skip
    elif samples:
        rate = samples_per_second_at_mfu(shape, data["tokens_per_sample"], mfu, devices, peak,
                                         work.sequences_per_sample, task_table(task).scoring_passes)  # fmt: skip
        rate *= plan["fp8_speedup"] if layout.fp8 else 1
        cost = cost_from_throughput(samples, data["epochs"], rate, devices, gpu["on_demand"], args.overhead,
                                    gpu.get("spot"))  # fmt: skip
        row.update(mfu=mfu, samples_per_second=rate, device_hours=cost.device_hours, usd=cost.usd,
                   usd_spot=cost.usd_spot)  # fmt: skip
    if layout.expert_parallel > 1:  # what its all-to-alls send a step, and the experts' gathers they replace
        exchanged = all_to_all_bytes(shape, work, layout.expert_parallel)
        row.update(all_to_all_gib=exchanged / GIB, expert_gathers_gib=expert_gather_bytes(shape, work, devices) / GIB)
        if gpu.get("link_gbs"):
            row["all_to_all_seconds"] = exchanged / (gpu["link_gbs"] * 1e9)
    return row


def compiled_configs(values: dict, config, task: str, lora: bool, layouts: list[Layout], devices: int) -> set[str]:
    """The configs whose launch on GPUs would compile the model: settings/compile.py's choice for each, with the
    attention a GPU run resolves (models/attention.py)."""
    setting = values.get("torch_compile", AUTO)
    setting = AUTO if isinstance(setting, str) and setting.strip().lower() == AUTO else setting
    packing = values.get("packing") is not False and task == "sft"
    attention, _ = choose_attention(config, values.get("attn_implementation", "auto"), task, packing, on_gpu=True)
    out = set()
    for layout in layouts:
        whole = layout.engine == "torch" and not layout.shard_params and layout.tensor_parallel == 1
        try:
            on, _ = choose_compile(setting, fp8=layout.fp8, on_gpu=True, processes=devices, lora=lora,
                                   replicated=whole and layout.pipeline_stages == 1, attention=attention,
                                   liger=bool(values.get("use_liger_kernel")))  # fmt: skip
        except ConfigError:  # FP8 with compile turned off: refused at launch, planned eager
            on = False
        if on:
            out.add(layout.name)
    return out


def compiled_shapes(shape: Shape, compiled: set[str], measure) -> tuple:
    """(shape_for(layout), what was measured): a config's shape, under compile (measured once, on first need by
    `measure()`) its activations as compile saves them. FP8's further saving (its float8 casts) is left to the run's
    own plan: tracing torchao's float8 tensors through the instances takes half a minute a model, too long for a
    table of every config."""
    measured: dict = {}

    def shape_for(layout: Layout) -> Shape:
        if layout.name not in compiled:
            return shape
        if not measured:
            kept, measured["note"] = measure()
            measured["shape"] = replace(shape, activations=kept)
        return measured["shape"]

    return shape_for, measured


def build_plan(args) -> dict:
    """The plan `python -m toolkit plan` prints (render.py) or gives as JSON."""
    values = recipe_values(args.model)
    config = model_config(values["model_name_or_path"])
    task = args.task or values.get("task") or infer_task(config)
    model_fields = {f.name for f in fields(ModelArguments)}
    lora = ModelArguments(**{k: v for k, v in values.items() if k in model_fields}).lora_settings()
    parts = values.get("train_parts", ModelArguments.train_parts)
    shape = Shape.of(meta_model(config, task, lora, parts), config)
    mixed = values.get("bf16") or values.get("fp16")
    work = plan_workload(args, values, task, lora)
    kernel = values.get("experts_implementation", "auto")  # auto: transformers' choice on a GPU, grouped_mm
    experts = ("grouped_mm" if kernel == "auto" else kernel) if shape.routing else None
    fit, activations_note = planned_activations(config, task, work.precision, work.flash_attention, work.fused_head,
                                                lora, bool(mixed), experts=experts)  # fmt: skip
    image, image_note = None, ""
    if task_table(task).images:
        image, image_note = measured_image_cost(config, task, lora, parts, work.precision, bool(mixed),
                                                args.images_per_sample)  # fmt: skip
    shape = replace(shape, activations=fit, image=image)
    layouts = {p.stem: Layout.from_file(p) for p in strategy_files()}
    compiled = compiled_configs(values, config, task, lora is not None, list(layouts.values()), args.gpus * args.nodes)
    shape_for, measured = compiled_shapes(shape, compiled, lambda: planned_activations(
        config, task, work.precision, work.flash_attention, work.fused_head, lora, bool(mixed), True,
        experts=experts))  # fmt: skip
    gpu = device_spec(args.gpu, PLAN_ANY_GPU)
    online = task_table(task).samples_online
    data = plan_data(args, values, task, work)
    samples = data["steps"] if online else data["samples"]
    fp8 = "fp8" in gpu["peak_tflops"]  # FP8 tensor cores (metrics/hardware.yaml)
    share = float8_share(config, task) if fp8 and any(v.fp8 for v in layouts.values()) else None
    gain = float8_speedup(share, FP8_SPEEDUP) if share is not None else 1.0  # torchao's figure, for this model
    priced = dict(shape=shape, work=work, gpu=gpu, values=values, task=task, config=config, data=data,
                  samples=samples, online=online, fp8_speedup=gain)  # fmt: skip
    results = [config_row(args, v, layouts[v.config], priced)
               for v in verdicts(shape, work, gpu["memory_gb"], args.gpus, args.nodes, args.headroom,
                                 list(layouts.values()), fp8, shape_for)]  # fmt: skip
    results.sort(key=lambda r: PREFERENCE.index(r["config"]) if r["config"] in PREFERENCE else len(PREFERENCE))
    if shown := sorted(compiled & {r["config"] for r in results}):
        float8 = " (fsdp2_fp8's float8 casts save more: its run's header measures them)" if "fsdp2_fp8" in shown else ""
        activations_note += f"; compiled ({', '.join(shown)}): {measured['note'].split('; ', 1)[-1]}{float8}"
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
        "workload": asdict(replace(work, teacher=None)),
        "teacher": teacher_row(work, values.get("teacher_model_name_or_path")),
        "activations": activations_note if fit else f"{activations_note}; from the Llama/BERT-style formula",
        "conservative": shape.conservative,
        "images": image_note if image else None,
        "left_out": images_caveat(task, image, image_note),
        "data": data if samples or online else None,
        "fp8_speedup": gain,
        "fp8_share": share,
        "flops_per_token": training_flops_per_token(shape, work.seq_length, task_table(task).scoring_passes)
        + teacher_flops_per_token(work, work.seq_length),
        "configs": results,
        "recommended": fitting[0]["config"] if fitting else None,
        "recommended_micro_batch": fitting[0]["micro_batch"] if fitting else None,
        "recommended_pipeline_stages": fitting[0]["pipeline_stages"] if fitting else 1,
        "recommended_expert_parallel": fitting[0]["expert_parallel"] if fitting else 1,
    }


def online_data(values: dict, work: Workload, devices: int, prompts: int | None, epochs: float) -> dict:
    """What times an online-RL run: its steps (--max_steps, else its prompts' completions over the global batch),
    each prompt's room (max_seq_length less the completion's), the completions' full length and, with tools or an
    environment, the assistant's turns an episode at most (--max_tool_calls + 1; None: no limit, or no tools)."""
    completion = values.get("max_completion_length", PolicyArguments.max_completion_length)
    generations = values.get("num_generations", PolicyArguments.num_generations)
    rows = work.micro_batch * work.micro_batches * devices
    steps = values.get("max_steps", -1)
    if steps <= 0:
        steps = math.ceil(prompts * generations * epochs / rows) if prompts else 0
    calls = values.get("max_tool_calls") if values.get("tools") or values.get("environment") else None
    return dict(steps=steps, prompts=prompts, epochs=epochs, generations=generations, rows_per_step=rows,
                prompt_tokens=work.seq_length - completion, completion_tokens=completion,
                turns=calls + 1 if calls else None)  # fmt: skip


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
