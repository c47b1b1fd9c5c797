"""Pipeline parallelism, the model's side: a decoder cut into stages by its own plan, each rank keeping its stage.

transformers describes a decoder as a sequence of modules (`config.base_model_pp_plan`: Llama's embed_tokens,
layers, norm; the head's `_pp_plan`: lm_head). A stage is the whole model with the modules it does not hold
replaced by pass-throughs (`Elsewhere`), as transformers' own pipeline loader does: the first stage keeps what
comes before the layer list, the last what comes after it and the head, each stage an equal run of layers. The
model's own forward then runs each stage: the first from token ids, the others from the previous stage's hidden
states (`inputs_embeds`), the last to the logits; parameter names stay the whole model's, so each stage's
weights are a part of the whole model's checkpoint. torch.distributed.pipelining's schedules drive the stages
(training/pipeline.py).

A family whose forward does more between its embeddings and its layers than its plan says (a scale of the
embeddings, position embeddings added in the forward) would compute something else in the later stages: every
family is checked before any weight loads by running its stages at toy size against the whole model.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError
from ..metrics.routing import real_tokens
from ..settings.mesh import PIPELINE_SCHEDULES, describe
from .balance import routing_sums
from .parallel import check_mesh_size


class Elsewhere(torch.nn.Module):
    """A module another stage holds: passes its first input through. Keeps the plain attributes the model's
    forward reads off its layers (Qwen2's and Mistral's `attention_type`, which picks the layer's mask)."""

    def __init__(self, replaced: torch.nn.Module | None = None):
        super().__init__()
        for name, value in vars(replaced or torch.nn.Module()).items():
            if not name.startswith("_") and isinstance(value, (str, int, float, bool)):
                setattr(self, name, value)

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The layers a stage holds: an equal run of them (check_pipeline refuses a count the stages do not divide)."""
    per = num_layers // stages
    return range(stage * per, (stage + 1) * per)


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's text model, whose config holds the pipeline plan (a multimodal checkpoint's language model;
    Llama's LlamaModel)."""
    return decoder_of(model).get_decoder()


def plan_of(model: torch.nn.Module) -> tuple[list[str], str, list[str], list[str]]:
    """The decoder's plan: the text model's modules before its layer list, the list's name, those after it, and
    the output head's name on the causal LM around it."""
    decoder, base = decoder_of(model), text_model(model)
    names = list(getattr(base.config, "base_model_pp_plan", None) or ())
    lists = [n for n in names if isinstance(getattr(base, n, None), torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError(f"{type(decoder).__name__}'s pipeline plan names no single list of layers to split: train "
                          "it with accelerate_configs/fsdp2.yaml.")  # fmt: skip
    at = names.index(lists[0])
    head = [name for name, child in decoder.named_children() if child is decoder.get_output_embeddings()]
    return names[:at], lists[0], names[at + 1 :], head


def layer_list(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The blocks the stages divide: the plan's layer list, as the model builds it (LongCat-Flash's config counts
    two attention sublayers a block in num_hidden_layers)."""
    return getattr(text_model(model), plan_of(model)[1])


def split_stage(model: torch.nn.Module, stage: int, stages: int) -> torch.nn.Module:
    """Keep this stage's modules of `model` (in place: the others' parameters are freed); returns `model`."""
    before, layers, after, head = plan_of(model)
    decoder, base = decoder_of(model), text_model(model)
    blocks = getattr(base, layers)
    kept = stage_layers(len(blocks), stage, stages)
    for index in range(len(blocks)):
        if index not in kept:
            blocks[index] = Elsewhere(blocks[index])
    for owner, names, keep in ((base, before, stage == 0), (base, after, stage == stages - 1),
                               (decoder, head, stage == stages - 1)):  # fmt: skip
        for name in names if not keep else ():
            setattr(owner, name, Elsewhere(getattr(owner, name)))
    return model


class StageModule(torch.nn.Module):
    """One stage's forward for torch's PipelineStage: token ids (first stage) or hidden states in, hidden states
    or (last stage) logits out; the keyword inputs (positions, the attention mask) reach every stage. A mixture of
    experts whose forward computes the load-balancing loss (`routing`: its experts and top-k) also passes on the
    routing sums of the layers so far (models/balance.py), this stage's added: the last stage's loss needs all."""

    def __init__(self, model: torch.nn.Module, stage: int, stages: int, routing: tuple[int, int] | None = None):
        super().__init__()
        self.model, self.first, self.last, self.routing = model, stage == 0, stage == stages - 1, routing

    def forward(self, x: torch.Tensor, sums: torch.Tensor | None = None, routing_mask=None, **kwargs):
        """`routing_mask`: a packed batch's real tokens, for the balance alone (training/load_balance.py)."""
        inputs = {"input_ids" if self.first else "inputs_embeds": x, **kwargs, "use_cache": False}
        if self.routing is not None:
            inputs["output_router_logits"] = True
        mask = routing_mask if routing_mask is not None else kwargs.get("attention_mask")
        with real_tokens(mask):  # the routers' statistics too (metrics/routing.py)
            outputs = self.model(**inputs) if self.last else text_model(self.model)(**inputs)
        result = outputs.logits if self.last else outputs.last_hidden_state
        if self.routing is None:
            return result
        mine = routing_sums(outputs.router_logits, *self.routing, mask)
        return result, mine if sums is None else sums + mine


def check_pipeline_task(mesh: dict[str, int], task: str, *, load_in_4bit: bool = False,
                        schedule: str = PIPELINE_SCHEDULES[0], fp16: bool = False) -> None:  # fmt: skip
    """What a pipeline launch needs of the recipe alone: SFT of a causal LM (the loss on the last stage), no QLoRA,
    no fp16, data-parallel replicas as the only other axis, a schedule torch has."""
    stages = mesh.get("pp", 1)
    if stages == 1:
        return
    other = [axis for axis in mesh if axis not in ("pp", "dp_replicate")]
    if other:
        raise ConfigError(f"the mesh {describe(mesh)}: pipeline stages combine with data-parallel replicas "
                          "(parallelism_config_dp_replicate_size) only: drop the other sizes.")  # fmt: skip
    check_schedule(schedule)
    if task != "sft":
        raise ConfigError(f"pipeline stages (parallelism_config_pp_size {stages}) run a causal language model's SFT "
                          f"loss on the last stage; a {task} recipe is not supported: use fsdp2.yaml or "
                          "zero3.yaml.")  # fmt: skip
    if load_in_4bit:
        raise ConfigError("QLoRA (--load_in_4bit) under pipeline stages: its 4-bit base is small enough to "
                          "replicate: train it with single_gpu.yaml or ddp.yaml.")  # fmt: skip
    if fp16:  # the schedule runs backward itself, past accelerate's GradScaler, whose step would then unscale
        raise ConfigError("fp16 under pipeline stages: the stages' backward does not go through fp16's loss scaling. "
                          "Pass --bf16 true --fp16 false.")  # fmt: skip


def check_pipeline(config: PretrainedConfig, mesh: dict[str, int], task: str, *, world_size: int = 1,
                   load_in_4bit: bool = False, schedule: str = PIPELINE_SCHEDULES[0], micro_batches: int | None = None,
                   fp16: bool = False) -> None:  # fmt: skip
    """What a pipeline launch must allow, from the config before any weight loads: the recipe's part
    (check_pipeline_task), a mesh that covers the processes, a family with a pipeline plan, blocks the stages
    divide, untied embeddings, and stages that compute what the whole model does (at toy size, checked_stages);
    a warning where the accumulation's `micro_batches` are fewer than the stages (GPipe, a bubble of 100% or more)."""
    stages = mesh.get("pp", 1)
    if stages == 1:
        return
    check_pipeline_task(mesh, task, load_in_4bit=load_in_4bit, schedule=schedule, fp16=fp16)
    check_mesh_size(mesh, world_size, f"set --num_processes {math.prod(mesh.values())}, or a "
                                      "parallelism_config_dp_replicate_size that fills the launch.")  # fmt: skip
    text = config.get_text_config()  # the plan is the text model's (a multimodal checkpoint's language model)
    if not getattr(text, "base_model_pp_plan", None):
        raise ConfigError(f"{config.model_type} has no pipeline plan in transformers (base_model_pp_plan) to cut it "
                          "into stages: train it with accelerate_configs/fsdp2.yaml (sharded data "
                          "parallelism).")  # fmt: skip
    from .meta import meta_model

    model = meta_model(config, task)  # the blocks and the head as built: seconds, no weights
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embeddings.weight:
        raise ConfigError(f"{config.model_type} ties its output head to its input embeddings, which would sit on the "
                          "first and the last stage with one gradient between them: train it with "
                          "accelerate_configs/fsdp2.yaml.")  # fmt: skip
    blocks = len(layer_list(model))
    if blocks % stages:
        fits = [n for n in range(2, blocks + 1) if blocks % n == 0]
        raise ConfigError(f"parallelism_config_pp_size {stages} does not divide the model's {blocks} layers into "
                          f"equal stages: use a pp_size of {', '.join(map(str, fits)) or '1'}.")  # fmt: skip
    checked_stages(config, stages, sublayers=text.num_hidden_layers // blocks)
    if micro_batches is not None and window_schedule(schedule, stages, micro_batches) != schedule:
        from ..errors import warn

        warn(f"{micro_batches} micro-batch(es) a step (--gradient_accumulation_steps) are fewer than the {stages} "
             f"pipeline stages {schedule} needs: each step runs as GPipe, idle {bubble(stages, micro_batches):.0%} "
             f"of its compute time on top (the bubble); --gradient_accumulation_steps {stages} or more runs "
             f"{schedule}.")  # fmt: skip


def check_schedule(schedule: str) -> None:
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"parallelism_config_pp_schedule {schedule}: the pipeline runs "
                          f"{' or '.join(PIPELINE_SCHEDULES)} (torch.distributed.pipelining's schedules of one stage "
                          "per rank).")  # fmt: skip


def checked_stages(config: PretrainedConfig, stages: int, sublayers: int = 1) -> None:
    """Run the model's family at toy size (one block a stage, random weights) whole and as `stages` stages in
    turn: the same logits, or a refusal naming the family (its forward does more than its plan says, or a stage
    needs what only the first has: a hash-routed MoE's token ids). `sublayers`: the config's layers a block."""
    from transformers import AutoModelForCausalLM

    from .tiny import shrunk_config

    tiny = copy.deepcopy(config)
    shrunk_config(tiny.get_text_config(), vocab_size=128, layers=stages * sublayers)  # in place, in `tiny`
    tiny.get_text_config().tie_word_embeddings = tiny.tie_word_embeddings = False
    with torch.random.fork_rng():
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(tiny, dtype=torch.float32, attn_implementation="eager").eval()
        ids = torch.randint(0, 128, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        expected = whole(input_ids=ids, position_ids=positions, use_cache=False).logits
        x = ids
        try:
            for stage in range(stages):
                part = StageModule(split_stage(copy.deepcopy(whole), stage, stages), stage, stages)
                x = part(x, position_ids=positions)
        except Exception as error:  # noqa: BLE001 - whatever the family's forward raises without its inputs
            raise ConfigError(f"{config.model_type}'s layers cannot run as pipeline stages (a stage's forward at toy "
                              f"size raised {type(error).__name__}: {str(error).strip().splitlines()[0][:160]}; its "
                              "later stages receive hidden states only): train it with "
                              "accelerate_configs/fsdp2.yaml.") from None  # fmt: skip
    if x.shape != expected.shape or not torch.allclose(x, expected, atol=1e-4, rtol=1e-4):
        raise ConfigError(f"{config.model_type}'s forward does more between its modules than its pipeline plan says "
                          "(its stages do not compute the whole model's logits): train it with "
                          "accelerate_configs/fsdp2.yaml.")  # fmt: skip


def bubble(stages: int, micro_batches: int) -> float:
    """The pipeline's idle share under GPipe and 1F1B: (stages - 1) / micro-batches of each step's time on top of
    the work (Huang et al. 2019, GPipe, section 2.2; Narayanan et al. 2021, PipeDream-Flush / 1F1B)."""
    return (stages - 1) / max(1, micro_batches)


def window_schedule(schedule: str, stages: int, micro_batches: int) -> str:
    """The schedule a window of `micro_batches` runs: the run's, or GPipe where 1F1B cannot run it (fewer
    micro-batches than stages: tiny mode's single one, an epoch's last window). Nothing is lost: with m < stages,
    1F1B's first stage would hold all m micro-batches' activations too, as GPipe's every stage does, and the
    bubble is (stages - 1) / m either way (bubble)."""
    return schedule if micro_batches >= stages else "GPipe"


def schedule_note(schedule: str, stages: int, micro_batches: int) -> str:
    """The run header's line on the pipeline's schedule: which runs a step, its bubble, and what an epoch's last,
    shorter window runs."""
    ran = window_schedule(schedule, stages, micro_batches)
    note = f"{ran}, {micro_batches} micro-batch(es) a step over {stages} stages: bubble "
    note += f"{bubble(stages, micro_batches):.0%}"
    if ran != schedule:
        return f"{note} ({schedule} needs {stages} micro-batches or more)"
    shorter = f"; a shorter window (an epoch's last) of fewer than {stages} runs as GPipe"
    return note + (shorter if ran != "GPipe" else "")


def micro_batches_in_flight(schedule: str, stages: int, micro_batches: int, stage: int = 0) -> int:
    """Micro-batches whose activations a stage holds at once: all of them under GPipe (every forward before any
    backward); under 1F1B at most the stages from this one to the last (the first stage: `stages`)."""
    if window_schedule(schedule, stages, micro_batches) == "GPipe":
        return micro_batches
    return min(micro_batches, stages - stage)
