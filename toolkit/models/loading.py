"""Model loading: Hub id or local folder (tiny mode is a local folder too), its config and tokenizer checked before
any weights, dtype, attention; the room's two entries, in the order a run takes them: `blueprint` (config,
tokenizer, packing, attention: seconds, no weights) and `load_for_training` (the weights, LoRA, placeholders)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, set_seed

from ..data.conversations import stop_token_ids
from ..data.packing import use_packing
from ..data.sources import check_hub_model, read_config, resolve
from ..errors import ConfigError, first_line
from ..metrics.memory import HostMemoryPeak, human_bytes
from ..metrics.routing import expert_count, fused_experts
from ..settings import tasks
from ..settings.arguments import Arguments
from ..settings.mesh import launch_mesh
from ..settings.model_arguments import ModelArguments, torch_dtype
from ..settings.tasks import GENERATIVE, architecture, check_task, config_has_code, model_class
from .attention import ATTENTION_SUPPORT, check_installed, choose_attention, support_flag
from .counts import LoadRecord, ParameterCounts
from .dropout import dropout_names
from .lora import add_lora
from .meta import meta_model
from .parallel import lora_on_experts
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


def check_teacher(config: PretrainedConfig, args: ModelArguments, task: str) -> None:
    """distill's teacher from its config and tokenizer, before any weights load: named, readable, and of the
    student's vocabulary (TRL compares their whole next-token distributions, row by row); a teacher named for another
    task, refused."""
    name = args.teacher_model_name_or_path
    if not tasks.task(task).teacher:
        if name:
            raise ConfigError(f"teacher_model_name_or_path is distillation's: drop it, or train with --task distill "
                              f"(task {task} has no teacher).")  # fmt: skip
        return
    if not name:
        raise ConfigError("a distill recipe needs a teacher: set teacher_model_name_or_path, a Hub id or a model "
                          "folder of the student's family (the same tokenizer).")  # fmt: skip
    teacher = load_config(ModelArguments(model_name_or_path=name, trust_remote_code=args.trust_remote_code))
    check_language_model(teacher, f"the teacher {name}")
    vocabularies = [c.get_text_config().vocab_size for c in (config, teacher)]
    if vocabularies[0] != vocabularies[1]:
        raise ConfigError(f"the teacher {name} has a vocabulary of {vocabularies[1]:,} and the student "
                          f"{args.model_name_or_path} one of {vocabularies[0]:,}: distillation compares their whole "
                          "next-token distributions, so pick a teacher of the student's family (its "
                          "tokenizer).")  # fmt: skip
    # As many rows is not one vocabulary (Mistral-7B and Llama-2 have 32,000 each): the tokenizers' own, token by
    # token (a dict of each token's id, compared in milliseconds for 150k tokens).
    ours, theirs = (load_tokenizer(replace(args, model_name_or_path=model)).get_vocab()
                    for model in (args.model_name_or_path, name))  # fmt: skip
    if ours != theirs:
        moved = sorted(token for token in ours.keys() | theirs.keys() if ours.get(token) != theirs.get(token))
        raise ConfigError(f"the teacher {name}'s vocabulary is not the student's ({args.model_name_or_path}), though "
                          f"both have {vocabularies[0]:,} rows: {len(moved):,} of their tokens have another id in one "
                          f"of them, or none ({moved[0]!r}, ...), and distillation compares their next-token "
                          "distributions row by row: pick a teacher of the student's family (its "
                          "tokenizer).")  # fmt: skip


def check_language_model(config: PretrainedConfig, who: str) -> None:
    """A model loaded as a causal language model (AutoModelForCausalLM) that was saved as another head (a
    classifier's, a reward model's, or none): transformers drops that head and builds a new next-token head, untrained
    (or tied to the embeddings, silently), so it is refused by the architectures its config.json names. A config
    that names none, or a model of its own code, is taken as it is."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    saved = getattr(config, "architectures", None) or []
    if not saved or config_has_code(config) or set(saved) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return
    wanted = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "a ...ForCausalLM")
    raise ConfigError(f"{who} was saved as {', '.join(saved)}, not a causal language model: loaded as one, its head "
                      f"would be dropped and its next-token head new, untrained weights. Pass a model saved as "
                      f"{wanted} (a chat or base model of the student's family).")  # fmt: skip


def check_model_settings(config: PretrainedConfig, args: ModelArguments, task: str) -> None:
    """What the model cannot honour fails in transformers or peft only after the data is tokenized or the weights
    load: the attention implementation and LoRA's target modules, checked against the config and a meta-device
    instance first (seconds, no weights)."""
    check_task(config, task)
    cls, attention, flag = architecture(config, task), args.attn_implementation, support_flag(args.attn_implementation)
    if cls is not None and flag is not None and not getattr(cls, flag, True):
        has = ["eager"] + [name for name, declared in ATTENTION_SUPPORT.items() if getattr(cls, declared, False)]
        raise ConfigError(f"{cls.__name__} has no {attention} attention: pass --attn_implementation {has[0]} (it "
                          f"supports {', '.join(has)}).")  # fmt: skip
    check_installed(attention, on_gpu=torch.cuda.is_available())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if args.router_aux_loss_coef is not None and not hasattr(text, "router_aux_loss_coef"):
        raise ConfigError(f"{config.model_type} has no load-balancing loss (its config has no router_aux_loss_coef: "
                          "not a mixture of experts, or one without it): drop --router_aux_loss_coef.")  # fmt: skip
    if args.dropout and not dropout_names(config):  # load_model sets the config's dropouts above 0 (dropout.py)
        zero = sorted(k for k, v in config.to_dict().items()
                      if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float))  # fmt: skip
        has = f"its dropouts are all 0 ({', '.join(zero)})" if zero else "its config has no dropout probability"
        raise ConfigError(f"--dropout {args.dropout:g} sets the dropouts a model trains with, and {config.model_type} "
                          f"trains with none ({has}): it would set nothing. Drop --dropout (the model trains without "
                          "dropout, as it was trained).")  # fmt: skip
    lora = args.lora_settings()
    if cls is None or lora is None:
        return
    model = meta_model(config, task)
    if args.lora_dropout and lora_on_experts(model, lora["target_modules"]):  # peft's ParamWrapper on 3-D weights
        raise ConfigError(f"lora_dropout {args.lora_dropout:g} with LoRA on {cls.__name__}'s fused experts (which "
                          f"{lora['target_modules'] if isinstance(lora['target_modules'], str) else 'the targets'} "
                          "adapts): peft's adapters on parameters take no dropout: pass --lora_dropout 0, or "
                          "--lora_target_modules q_proj,k_proj,v_proj,o_proj to leave the experts out.")  # fmt: skip
    if lora["target_modules"] == "all-linear":
        return
    modules = dict(model.named_modules())
    matches = {t: [m for n, m in modules.items() if n == t or n.endswith("." + t)] for t in lora["target_modules"]}
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items()
                     if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})  # fmt: skip
    missing = [t for t, found in matches.items() if not found]
    if missing:
        raise ConfigError(f"lora_target_modules {', '.join(missing)}: {cls.__name__} has no such module. Its linear "
                          f"layers are {', '.join(linear)}: pass some of them, or all-linear.")  # fmt: skip
    # peft wraps these layer types only (peft/tuners/lora/model.py); a norm or an activation fails in peft later
    wrappable = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                 torch.nn.MultiheadAttention)  # fmt: skip
    unwrappable = {t: type(found[0]).__name__ for t, found in matches.items()
                   if not all(isinstance(m, wrappable) or type(m).__name__ == "Conv1D" for m in found)}  # fmt: skip
    if unwrappable:
        named = ", ".join(f"{t} ({kind})" for t, kind in unwrappable.items())
        raise ConfigError(f"lora_target_modules {named}: LoRA adapts linear, embedding and convolution layers only. "
                          f"{cls.__name__}'s linear layers are {', '.join(linear)}: pass some of them, or "
                          "all-linear.")  # fmt: skip


def gathered_expert_bytes(config: PretrainedConfig, task: str, tokens: int, weight_bytes: int) -> int:
    """Bytes of expert weights transformers' batched_mm gathers in one layer's forward for `tokens` tokens:
    `gate_up_proj[expert_ids]` and `down_proj[expert_ids]`, a copy of each of a token's k experts (0 when dense)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = next((m for m in meta_model(config, task).modules() if fused_experts(m)), None)
    if experts is None:
        return 0
    per_expert = sum(p.numel() for p in experts.parameters()) // expert_count(experts)
    return tokens * getattr(text, "num_experts_per_tok", 1) * per_expert * weight_bytes


def check_experts_kernel(config: PretrainedConfig, args: Arguments, device_bytes: int) -> None:
    """batched_mm is sized for decoding: at a training micro-batch its gathered weights outgrow any device (a
    Qwen3-30B-A3B layer at 2 x 4,096 tokens asked an H200 for 384 GiB), so it is refused before any weight loads."""
    if args.model.experts_implementation != "batched_mm" or not device_bytes:
        return
    tokens = args.training.per_device_train_batch_size * args.data.max_seq_length
    weight_bytes = torch.finfo(torch_dtype(args.model.dtype)).bits // 8 if args.model.dtype != "auto" else 2
    gathered = gathered_expert_bytes(config, args.data.task, tokens, weight_bytes)
    if gathered > device_bytes:
        most = tokens * device_bytes // gathered
        raise ConfigError(f"--experts_implementation batched_mm copies each token's experts' weights: "
                          f"{human_bytes(gathered)} a layer at {tokens:,} tokens a micro-batch, more than this "
                          f"device's {human_bytes(device_bytes)}: use grouped_mm (auto's choice on a GPU) or "
                          f"eager, or micro-batches of well under {most:,} tokens.")  # fmt: skip


def check_sequence_length(config: PretrainedConfig, max_seq_length: int) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if limit and max_seq_length > limit:
        raise ConfigError(
            f"max_seq_length {max_seq_length} is above the model's {limit} positions (max_position_embeddings): "
            f"pass --max_seq_length {limit} or less."
        )


# What a checkpoint's config.json and the model's agree on where its weights and optimizer states fit the model.
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
    if (stages := launch_mesh().get("pp", 1)) > 1:  # this rank's stage: ranks are (stage, replica), stages outermost;
        # cut once LoRA's adapters are made (each then has the values it has in one process): what the rank keeps
        split_stage(model, int(os.environ.get("RANK", 0)) * stages // args.training.world_size, stages)
        load.param_bytes = ParameterCounts.of(model).held_bytes
    # no-op unless this rank loaded on the meta device (RAM-efficient FSDP loading)
    allocate_placeholders(model, upcast=upcast_placeholders)
    return LoadedModel(model, blueprint.tokenizer, ParameterCounts.of(model), load, blueprint.processor)
