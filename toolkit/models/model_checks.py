"""What a model's config must allow, checked before any weights load: the run's model settings against the family
(dropout, the balance term, 4-bit, the task's head), a distillation teacher against the student (the same
vocabulary, a language model), the sequence length and the experts kernel's gathered bytes against the device."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError
from ..metrics.memory import human_bytes
from ..metrics.routing import expert_count, fused_experts
from ..settings import tasks
from ..settings.arguments import Arguments
from ..settings.model_arguments import ModelArguments, torch_dtype
from ..settings.tasks import architecture, check_task, config_has_code
from .attention import ATTENTION_SUPPORT, check_installed, support_flag
from .dropout import dropout_names
from .loading import load_config, load_tokenizer
from .meta import meta_model
from .parallel import lora_on_experts


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
