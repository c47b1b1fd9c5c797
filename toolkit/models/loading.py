"""Model loading: Hub id or local folder (tiny mode is a local folder too), its config and tokenizer checked before
any weights, dtype, attention; the room's two entries, in the order a run takes them: `blueprint` (config,
tokenizer, packing, attention: seconds, no weights) and `load_for_training` (the weights, LoRA, placeholders)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, set_seed

from ..data.conversations import stop_token_ids
from ..data.packing import use_packing
from ..data.sources import check_hub_model, read_config, resolve
from ..errors import ConfigError, first_line
from ..metrics.memory import HostMemoryPeak
from ..settings import tasks
from ..settings.arguments import Arguments
from ..settings.mesh import launch_mesh
from ..settings.model_arguments import ModelArguments, torch_dtype
from ..settings.tasks import GENERATIVE, model_class
from .attention import choose_attention
from .counts import LoadRecord, ParameterCounts
from .dropout import dropout_names
from .lora import add_lora
from .pipeline import split_stage


def allocate_placeholders(model: torch.nn.Module, upcast: bool) -> None:
    """Give meta-device parameters uninitialised CPU storage: never read from disk, never written, so the
    operating system commits no RAM for them; FSDP moves them back to meta before it shards.

    Needed because accelerate's FSDP2 preparation re-points the optimizer at the sharded parameters by
    `data_ptr()`, which is 0 for every meta tensor: they all collide into one, and that rank silently updates
    almost none of its shard (its optimizer held 8 bytes of state instead of half the model's).
    Each placeholder takes the dtype rank 0's weight has when FSDP sends it (`upcast`: trainable floating ones in
    fp32, distributed/launch.py's `weights_arrive_upcast`): under FSDP2 mixed precision accelerate upcasts to fp32
    master weights first, and placeholders made in fp32 skip that copy, which would write (and commit) a whole fp32
    model on every receiving rank; FSDP1 broadcasts them as loaded, and its flat parameters must agree.
    """
    replaced: dict[int, torch.nn.Parameter] = {}  # a tied weight keeps one placeholder
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type == "meta":
                if id(param) not in replaced:
                    master = upcast and param.requires_grad and param.is_floating_point()
                    storage = torch.empty_like(param, device="cpu", dtype=torch.float32 if master else None)
                    replaced[id(param)] = torch.nn.Parameter(storage, requires_grad=param.requires_grad)
                module._parameters[name] = replaced[id(param)]


def checkpoint_dtype(dtype: str, config) -> torch.dtype:
    """The dtype from_pretrained would give the weights: the requested one, or for "auto" the checkpoint's."""
    if dtype != "auto":
        return torch_dtype(dtype)
    stored = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, stored) if isinstance(stored, str) else stored


# What a saved tokenizer leaves in a folder (fast, SentencePiece, WordPiece, BPE, or just its config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.txt",
                   "vocab.json", "sentencepiece.bpe.model")  # fmt: skip


def load_tokenizer(args: ModelArguments) -> PreTrainedTokenizerBase:
    name = resolve(args.model_name_or_path)
    check_hub_model(name)
    if Path(name).is_dir() and not any((Path(name) / file).is_file() for file in TOKENIZER_FILES):
        # transformers 5 then builds an empty-vocabulary tokenizer of the model's type: every word unknown.
        raise ConfigError(f"{args.model_name_or_path} has no tokenizer files: save it beside the model with "
                          "tokenizer.save_pretrained(folder).")  # fmt: skip
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:  # a local folder without tokenizer files, or unreadable ones
        if not Path(name).is_dir():
            raise
        raise ConfigError(f"{args.model_name_or_path} has no usable tokenizer ({first_line(error)}): save it beside "
                          "the model with tokenizer.save_pretrained(folder).") from None  # fmt: skip


def load_config(args: ModelArguments) -> PretrainedConfig:
    """The model's config alone (a few KB): checked before the tokenizer, the data and the weights load."""
    name = resolve(args.model_name_or_path)
    check_hub_model(name)
    return read_config(name, args.model_name_or_path, args.trust_remote_code)


ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "vocab_size")  # fmt: skip


def local_config(model: str) -> dict | None:
    """A model's config.json without a Hub call: a folder's own, or the Hub cache's copy; None where neither is
    there or readable."""
    from huggingface_hub import try_to_load_from_cache

    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a repository id
            return None
        path = Path(cached) if isinstance(cached, str) else None
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None


def architecture_difference(checkpoint: str | Path, model: str) -> str | None:
    """How the model a checkpoint's config.json describes differs from `model` (type and sizes), in words; None
    where they agree, or where either config is not at hand (a LoRA adapter's checkpoint has none)."""
    theirs, mine = local_config(str(checkpoint)), local_config(model)
    if theirs is None or mine is None:
        return None
    keys = [k for k in ARCHITECTURE_KEYS if k in theirs and k in mine and theirs[k] != mine[k]]
    if not keys:
        return None
    said = lambda values: ", ".join(f"{k} {values[k]}" for k in keys)  # noqa: E731
    return f"a model of {said(theirs)}, where {model} has {said(mine)}"


def load_model(
    args: ModelArguments,
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    label_names: list[str] | None,
    on_meta: bool = False,
) -> PreTrainedModel:
    """The model with its pretrained weights; `on_meta`: the architecture alone, its parameters on the meta
    device, for a rank that receives its shard of rank 0's weights (RAM-efficient FSDP loading; the runner
    decides, distributed/launch.py's `receives_weights_from_rank0`)."""
    kwargs = {}
    if label_names is not None:
        kwargs = dict(
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id={n: i for i, n in enumerate(label_names)},
        )
    elif (outputs := tasks.task(task).num_labels) is not None:  # a reward model's one score
        kwargs = dict(num_labels=outputs)
    name = resolve(args.model_name_or_path)
    check_hub_model(name)
    # auto not yet resolved (a caller without the runner, so no packing): the model's default, as for unpacked rows
    attention = None if args.attn_implementation == "auto" else args.attn_implementation
    common = dict(attn_implementation=attention, trust_remote_code=args.trust_remote_code)
    if args.experts_implementation != "auto":  # else transformers' choice (grouped_mm where it can run)
        common["experts_implementation"] = args.experts_implementation
    if args.dropout is not None:
        config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        kwargs.update(dict.fromkeys(dropout_names(config), args.dropout))
    if args.router_aux_loss_coef is not None:  # the family's load-balancing loss: its router logits requested,
        # on the text config, which an image-text MoE's forward reads (from_pretrained's keywords set the outer one)
        config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code, **kwargs)
        text = config.get_text_config()
        text.output_router_logits, text.router_aux_loss_coef = args.router_aux_loss_coef > 0, args.router_aux_loss_coef
        kwargs = {"config": config}
    if on_meta:
        # transformers 5 materialises the whole checkpoint on every rank even under RAM-efficient loading
        # (huggingface/transformers#43749, #45649): N copies in host RAM. Build the architecture with its parameters
        # on the meta device instead (buffers stay real: FSDP does not broadcast non-persistent ones); when FSDP
        # shards the model, accelerate hands each rank its part of rank 0's weights. The runner gives the
        # parameters placeholders (allocate_placeholders) once LoRA, if any, is added.
        if "config" not in kwargs:
            config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code, **kwargs)
        with init_empty_weights(include_buffers=False):
            model = model_class(task).from_config(config, dtype=checkpoint_dtype(args.dtype, config), **common)
        # Tied embeddings come out untied from there (init_empty_weights re-creates each parameter it sees
        # assigned, so the tie made inside it is lost): this rank would hold an lm_head.weight that rank 0's model,
        # loaded by from_pretrained, does not, and accelerate's FSDP2 parameter mapping fails on it.
        model.tie_weights()
    else:
        quantization = args.quantization()
        if quantization is not None:  # bitsandbytes quantizes as the weights load onto this rank's device
            device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
            kwargs.update(quantization_config=quantization, device_map={"": device})
        mesh = launch_mesh()
        if {"tp", "ep"} & set(mesh):  # transformers shards it by the model's own plans as it loads (models/parallel)
            from transformers.distributed import DistributedConfig

            # DTensor's advice to flatten the mesh transformers lays out (one line a rank, and nothing a user sets)
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

            kwargs["distributed_config"] = DistributedConfig(tp_size=mesh.get("tp", 1), ep_size=mesh.get("ep", 1),
                                                             fsdp_size=mesh.get("dp_shard", 1),
                                                             dp_replicate_size=mesh.get("dp_replicate", 1))  # fmt: skip
        try:
            model = model_class(task).from_pretrained(name, dtype=torch_dtype(args.dtype), **common, **kwargs)
        except OSError as error:  # a local folder without weights, or with unreadable ones
            if not Path(name).is_dir():
                raise
            raise ConfigError(f"{args.model_name_or_path} has no loadable weights ({first_line(error)}): pass a "
                              "folder written by model.save_pretrained.") from None  # fmt: skip
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        # transformers' ZeRO-3 loader keeps every weight renaming it tried as the model's, where its other loaders
        # keep those that matched; save_pretrained reverts them all, so a BERT-family export under ZeRO-3 named its
        # LayerNorm weights by the legacy gamma/beta. Keep the ones that matched a checkpoint key.
        model._weight_conversions = [c for c in conversions if c.was_used()]
    if getattr(model.config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id  # sequence classification finds the last real token
    return model


@dataclass
class Blueprint:
    """What a run knows of its model before any weight loads: its config (checked against the settings), its
    tokenizer, and whether its rows are packed; the attention kernel is resolved into the settings here."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    packing: bool
    processor: Any = None  # an image-text model's (AutoProcessor): its image processor, tokenizer, chat template


def blueprint(args: Arguments, config: PretrainedConfig | None = None) -> Blueprint:
    """The model room's first entry: the config alone (a few KB; `config`: read and checked already, checks.py's
    MODEL), packing decided, `--attn_implementation auto` resolved where packing is known, and the tokenizer (an
    image-text model's processor): seconds, before any data is read or weight loaded."""
    config = load_config(args.model) if config is None else config
    packing = use_packing(args.data.task, args.data.packing, config)
    m = args.model
    m.attn_implementation, m.attention_note = choose_attention(config, m.attn_implementation, args.data.task,
                                                               packing, on_gpu=torch.cuda.is_available())  # fmt: skip
    if not tasks.task(args.data.task).images:
        return Blueprint(config, load_tokenizer(args.model), packing)
    from .processors import load_processor

    processor = load_processor(resolve(args.model.model_name_or_path), args.model.trust_remote_code)
    return Blueprint(config, processor.tokenizer, packing, processor)


@dataclass
class LoadedModel:
    model: torch.nn.Module  # with its LoRA adapter, if any
    tokenizer: PreTrainedTokenizerBase
    counts: ParameterCounts
    load: LoadRecord
    processor: Any = None  # an image-text model's, saved beside it (the Trainer's processing_class)


def load_for_training(args: Arguments, blueprint: Blueprint, label_names: list[str] | None, on_meta: bool = False,
                      upcast_placeholders: bool = False) -> LoadedModel:  # fmt: skip
    """The model room's second entry: the weights (`on_meta`: a rank that receives its shard, see load_model),
    what loading took on this rank (with --record_rank_reports), the LoRA adapter, and storage for placeholders
    (`upcast_placeholders`: see allocate_placeholders)."""
    load = LoadRecord(memory=HostMemoryPeak() if args.run.record_rank_reports else None)  # until the first step
    model = load_model(args.model, args.data.task, blueprint.tokenizer, label_names, on_meta=on_meta)
    load.param_bytes = ParameterCounts.of(model).held_bytes  # 0 on ranks > 0 under RAM-efficient FSDP loading
    load.host = load.memory.current() if load.memory else None  # what from_pretrained alone took
    if args.data.task in GENERATIVE and blueprint.tokenizer.chat_template:  # saved with it: generation stops there
        model.generation_config.eos_token_id = stop_token_ids(blueprint.tokenizer)
    targets = None
    if tasks.task(args.data.task).images:  # which of the image encoder, projector and language model train
        from .vision import choose_trained

        targets = choose_trained(model, args.model)
    if args.model.use_lora:
        set_seed(args.training.seed)  # LoRA's A matrices are random: same start for any process count
        model = add_lora(model, args.model, args.data.task, targets)
    if args.model.qat:  # fake quantizers on the linear layers, before any wrapper or shard sees them
        from .qat import prepare

        prepare(model, args.model.qat)
    if (stages := launch_mesh().get("pp", 1)) > 1:  # this rank's stage: ranks are (stage, replica), stages outermost;
        # cut once LoRA's adapters are made (each then has the values it has in one process): what the rank keeps
        split_stage(model, int(os.environ.get("RANK", 0)) * stages // args.training.world_size, stages)
        load.param_bytes = ParameterCounts.of(model).held_bytes
    # no-op unless this rank loaded on the meta device (RAM-efficient FSDP loading)
    allocate_placeholders(model, upcast=upcast_placeholders)
    return LoadedModel(model, blueprint.tokenizer, ParameterCounts.of(model), load, blueprint.processor)
