"""Tiny mode: a recipe's own architecture at toy size, random init, with a local tokenizer and local data.

Lets any recipe x any accelerate config launch on a CPU in seconds, offline. The architecture comes from the
recipe model's real `config.json`, stored in `toolkit/hub_configs/` (public hyper-parameters), with only the
sizes scaled down; the data is small, deterministic and learnable, so a test can see the loss go down
(tiny_data.py).

The tiny model is a checkpoint folder created once (seeded, content-addressed in the cache) and then loaded
like any local model, so every strategy goes through its real loading path (ZeRO-3 partitioned loading,
FSDP's RAM-efficient loading) and every run starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from ..data.sources import stored_config
from ..errors import ConfigError
from ..project import looks_like_path, recipe_writing
from ..settings import tasks as task_table
from ..settings.parser import has_accelerator
from ..settings.tasks import kind_of_model, model_class
from . import tiny_vision
from .dropout import dropout_names
from .parallel import EXPERT_COUNTS, routed_expert_count
from .tiny_data import cache_dir, classification_rows, save_atomically, texts_of, write_tiny_dataset

# Sizes of the tiny model; every other hyper-parameter (activation, norms, rope, GQA, tying, dropout) is the
# recipe's, and what makes the family differ is kept at toy size (`structure`, tested per family): a top-k below
# the experts, shared experts, dense layers beside expert layers, grouped routing, each kind of layer, a sliding
# window shorter than the tiny rows, latent attention.
TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY_EXPERTS = 4  # routed experts a layer, top-k at most half of them: a router that chooses
RANK_ZERO_WAIT_S = 300.0  # how long another rank waits for rank 0's tiny model (made_by_rank_zero)
TINY_WINDOW = 32  # a sliding window inside the tiny rows (64 tokens), so that it masks something

CPU_PRECISION = {"dtype": "float32", "bf16": False, "fp16": False}

# Training settings that make a tiny run take seconds; command-line flags still win.
TINY_TRAINING = {
    "max_steps": 20,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "learning_rate": 2e-3,  # a toy model with random weights learns at rates a pretrained one never would
    "gradient_accumulation_steps": 1,
    "warmup_steps": 0,
    "logging_steps": 1,
    "max_seq_length": 64,
    "eval_fraction": 0.0,  # nothing held out: so nothing of the recipe's that needs held-out rows either
    "eval_split": None,
    "eval_strategy": "no",
    "generation_samples": 0,
    "eval_after_training": False,  # flags bring them back (--eval_fraction 0.1 --eval_after_training true)
    "max_train_samples": None,
    "activation_checkpointing": False,
    # fp32 on a CPU: tiny runs are compared number for number in tests; on a GPU the recipe's own precision, so a
    # tiny run meets the kernels and dtypes a real one does (make gpu-check): CPU_PRECISION below
    "attn_implementation": "auto",  # the recipe's kernel may not exist in the tiny family (Gemma-2: no sdpa)
    "lora_dropout": 0.0,  # adapters compared number for number across process counts (--dropout: the model's own)
}

LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
]
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tiny_config(model_name: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The model's config at toy size (shrunk_config), with the tokenizer's vocabulary and special tokens."""
    config = shrunk_config(stored_config(model_name), len(tokenizer))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token_id = getattr(tokenizer, name)
        if hasattr(config, name) or token_id is not None:
            setattr(config, name, token_id)
    return config


def shrunk_config(config: PretrainedConfig, vocab_size: int, layers: int | None = None) -> PretrainedConfig:
    """A config at toy size, in place, whatever its family: sizes through transformers' standard names (which each
    config maps to its own: GPT-2's n_embd, n_layer, n_head), and what must agree with them scaled too: per-layer
    type lists, head_dim where it is a setting, experts, OPT's embedding projection; `layers` of them."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)  # Falcon's
    for key, value in {**TINY_SIZES, **({"num_hidden_layers": layers} if layers else {})}.items():
        if hasattr(config, key):
            setattr(config, key, value)
    # other names of the MLP width (GPT-2's n_inner: None means 4 x hidden, left so; DistilBERT's hidden_dim)
    for key in ("ffn_dim", "n_inner", "hidden_dim", "ffn_hidden_size", "moe_intermediate_size",
                "shared_expert_intermediate_size"):  # fmt: skip
        if getattr(config, key, None):
            setattr(config, key, TINY_SIZES["intermediate_size"])
    for key in ("word_embed_proj_dim", "pooler_hidden_size"):  # OPT's embedding projection, DeBERTa's pooler
        if getattr(config, key, None):
            setattr(config, key, config.hidden_size)
    if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer: the first ones, each kind
        config.layer_types = kept_layer_types(config.layer_types, config.num_hidden_layers)
    if isinstance(getattr(config, "sliding_window", None), int):
        config.sliding_window = min(config.sliding_window, TINY_WINDOW)
    if kv_heads:  # keep grouped-query attention grouped: same heads per KV head, at least one KV head
        kv_name = "num_key_value_heads" if hasattr(config, "num_key_value_heads") else "num_kv_heads"
        setattr(config, kv_name, max(1, TINY_SIZES["num_attention_heads"] * kv_heads // heads))
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention: low ranks, small heads
        for key in ("q_lora_rank", "kv_lora_rank"):
            if getattr(config, key, None):
                setattr(config, key, config.hidden_size // 2)
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(config, key, None):
                setattr(config, key, 16)
        if hasattr(config, "qk_head_dim"):
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if getattr(config, "qk_rope_head_dim", None):  # multi-head latent attention: its rotary part is its head_dim
        config.head_dim = config.qk_rope_head_dim
    elif getattr(config, "head_dim", None) and not isinstance(getattr(type(config), "head_dim", None), property):
        config.head_dim = config.hidden_size // config.num_attention_heads
    shrink_experts(config)
    config.vocab_size = vocab_size
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids of the full vocabulary (Phi-3's pad 32000)
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= vocab_size:
            setattr(config, name, None)  # nn.Embedding refuses a padding index past the table
    return config


def kept_layer_types(types: list[str], layers: int) -> list[str]:
    """The first `layers` of a per-layer list, each kind of the whole list among them (Gemma-3's 5 sliding : 1
    full keeps a full layer), the last ones replaced."""
    kept, missing = types[:layers], [kind for kind in dict.fromkeys(types) if kind not in types[:layers]]
    if missing and len(missing) < layers:
        kept[-len(missing) :] = missing
    return kept


def shrink_experts(config: PretrainedConfig) -> None:
    """A mixture of experts at toy size, still routing: TINY_EXPERTS experts, the top-k at most half of them (all
    of them would route every token everywhere, and no router choice, statistic or balance would show), groups
    of experts still grouped, a dense layer still before the expert layers."""
    key = next((k for k in EXPERT_COUNTS if getattr(config, k, None)), None)
    if key is None:
        return
    experts, top_k = getattr(config, key), getattr(config, "num_experts_per_tok", 2) or 2
    setattr(config, key, min(experts, TINY_EXPERTS))
    tiny_experts = getattr(config, key)
    config.num_experts_per_tok = min(top_k, tiny_experts) if top_k >= experts else max(1, min(top_k, tiny_experts // 2))
    if (getattr(config, "n_group", None) or 1) > 1:  # DeepSeek's grouped routing: 2 groups, the top-k's in one
        config.n_group, config.topk_group = 2, 1
        config.num_experts_per_tok = min(config.num_experts_per_tok, tiny_experts // 2)
    if (getattr(config, "first_k_dense_replace", None) or 0) >= config.num_hidden_layers:
        config.first_k_dense_replace = config.num_hidden_layers - 1  # dense layers first, then experts


def structure(config: PretrainedConfig) -> dict[str, Any]:
    """What makes a family's architecture differ, in any size: the fields tiny mode must keep."""
    text = config.get_text_config()
    experts, top_k = routed_expert_count(text), getattr(text, "num_experts_per_tok", None)
    types = getattr(text, "layer_types", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    window = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return {
        "experts": experts is not None,
        "top-k below the experts": experts is not None and top_k < experts,
        "shared experts": bool(getattr(text, "n_shared_experts", None) or
                               getattr(text, "shared_expert_intermediate_size", None)),
        "dense layers beside expert layers": bool(getattr(text, "first_k_dense_replace", None) or
                                                  getattr(text, "mlp_only_layers", None)),
        "grouped routing": (getattr(text, "n_group", None) or 1) > 1,
        "dropout": dropout_names(text),
        "layer kinds": sorted(set(types)) if isinstance(types, list) else None,
        "sliding window": bool(window),
        "tied head": bool(getattr(text, "tie_word_embeddings", False)),
        "latent attention": bool(getattr(text, "kv_lora_rank", None)),
        "grouped-query attention": kv_heads is not None and heads is not None and kv_heads < heads,
    }  # fmt: skip


def is_encoder(model_name: str) -> bool:
    return kind_of_model(stored_config(model_name)) == "encoder"


def tiny_layer(values: dict[str, Any]) -> dict[str, Any]:
    """The parser's `--tiny` layer (settings/parser.py), from the values resolved below it."""
    task_table.task(values["task"])  # an unknown task is named as such, before tiny mode builds anything for it
    layer = tiny_training_defaults(values["task"], values["model_name_or_path"])
    teacher = values.get("teacher_model_name_or_path")  # distill's: a tiny one of the teacher's family, same tokenizer
    if teacher and task_table.task(values["task"]).teacher and not (looks_like_path(teacher) or Path(teacher).is_dir()):
        layer["teacher_model_name_or_path"] = str(tiny_checkpoint(teacher, values["task"]))
    if values.get("tools") or values.get("environment"):  # a template that shows tool calls and results: TRL's Qwen3
        layer["chat_template"] = "trl:qwen3"
    if values.get("environment"):  # the environment reads its own columns: the recipe's rows and rewards; the
        # tiny tokenizer's ids are near characters, so a few turns take hundreds
        layer.update({key: values.get(key) for key in ("dataset_name", "reward_funcs", "reward_weights",
                                                       "format_pattern")}, max_completion_length=768,
                     max_seq_length=2048)  # fmt: skip
    return layer


def tiny_training_defaults(task: str, model_name: str) -> dict[str, Any]:
    """The `--tiny` layer of a recipe's settings: a tiny local checkpoint of its model, local data, short run."""
    on_cpu = {} if has_accelerator() else CPU_PRECISION
    if looks_like_path(model_name) or Path(model_name).is_dir():  # a local folder: DPO from an SFT run's output
        if not (Path(model_name).expanduser() / "config.json").is_file():
            recipe = recipe_writing(model_name)
            made_by = f" (make finetune MODEL={recipe} ARGS=--tiny makes it)" if recipe else ""
            raise ConfigError(
                f"The recipe starts from {model_name}, which is not there yet: it is an earlier run's "
                f"output{made_by}; or pass --model_name_or_path with a model folder or Hub id."
            )
        values = dict(TINY_TRAINING, **on_cpu)  # that folder as it is: tiny mode shortens the run, brings the data
    else:
        checkpoint = tiny_image_checkpoint if task_table.task(task).images else tiny_checkpoint
        values = dict(TINY_TRAINING, **on_cpu, model_name_or_path=str(checkpoint(model_name, task)))
    values.update(dataset_name=str(write_tiny_dataset(task)), dataset_mixture=None, data_format=None,
                  dataset_config=None, train_split="train")  # fmt: skip
    if task == "classification":
        values.update(text_columns="text", label_column="label")
    elif task_table.task(task).pairs or task_table.task(task).labelled:  # a sequence is a whole conversation: up
        # to 3 turns, ~100 tokens
        values.update(chat_template="llama3", max_seq_length=128)
    elif task_table.task(task).samples_online:  # 2 prompts x 4 completions a step, short ones: the sum, and a
        # digit in the answer (a random model's completions differ in that from the first step, so its advantages
        # are not all 0)
        values.update(chat_template="llama3", prompt_column="prompt", max_completion_length=8,
                      per_device_train_batch_size=8)  # fmt: skip
        if not task_table.task(task).teacher:  # distillation's signal is its teacher's
            values.update(reward_funcs="accuracy,format", reward_weights=None, format_pattern=r".*\d.*",
                          num_generations=4)  # fmt: skip
    elif not task_table.task(task).images:  # an image-text model's chat template is its processor's
        values.update(messages_column="messages", chat_template="llama3")
    return values


# ------------------------------------------------------------------------------------------ tokenizer


def train_tokenizer(encoder: bool, texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A WordPiece (BERT-style) or byte-level BPE (Llama-3-style) tokenizer trained in a second on `texts`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if encoder:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(
            texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS)
        )
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]", model_max_length=512,
        )  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=LLAMA3_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return PreTrainedTokenizerFast(  # as Meta-Llama-3-8B's: its turns end with <|eot_id|>, a sequence with this
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        model_max_length=8192,
    )


def tiny_checkpoint(model_name: str, task: str) -> Path:
    """A save_pretrained folder (config, random weights, tokenizer) of the recipe's architecture at toy size."""
    tokenizer = tiny_tokenizer(model_name, task)
    data = write_tiny_dataset(task)
    config = tiny_config(model_name, tokenizer)
    if task == "classification":
        labels = sorted({str(r["label"]) for r in classification_rows()})
        config.num_labels, config.id2label = len(labels), dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
    elif task_table.task(task).num_labels is not None:
        config.num_labels = task_table.task(task).num_labels
    # content-addressed: data.stem is task-hash; a change in how a config is scaled down makes a new folder
    digest = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:8]
    path = cache_dir() / f"{re.sub(r'[^A-Za-z0-9_.-]+', '--', model_name)}-{data.stem}-{digest}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = model_class(task).from_config(config)
    if not model.should_save_on_this_rank(True):
        return made_by_rank_zero(path)
    save_atomically(path, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    return path


def made_by_rank_zero(path: Path) -> Path:
    """`path` once rank 0 has written it. Where a process group exists before the run (a Ray worker's),
    transformers' save_pretrained writes on rank 0 only: a scratch folder of another rank's held no weights, and
    renamed into place first it stood for the model (a worker then found no config.json)."""
    end = time.monotonic() + RANK_ZERO_WAIT_S
    while not (path / "config.json").is_file():
        if time.monotonic() > end:
            raise ConfigError(f"rank 0 did not write the tiny model {path} within {RANK_ZERO_WAIT_S:.0f} s: a run "
                              "of several nodes needs TOOLKIT_CACHE on storage every node shares.")  # fmt: skip
        time.sleep(0.5)
    return path


def tiny_image_checkpoint(model_name: str, task: str) -> Path:
    """An image-text recipe's family at toy size (tiny_vision.py): its stored config with the text side shrunk as
    any model's and the tower as tiny_vision's, a tokenizer trained on the tiny data with the family's special
    tokens, and the family's processor; saved as a model folder with its processor."""
    config = stored_config(model_name)
    spec = tiny_vision.family(config)
    tokenizer = tiny_vision.with_special_tokens(
        train_tokenizer(False, tiny_vision.image_texts()), spec.named, spec.more
    )
    text = shrunk_config(config.text_config, len(tokenizer))
    tiny_vision.shrink_vision(config)
    spec.adapt(config, tokenizer)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        for part in (config, text):
            if hasattr(part, name) or part is text:
                setattr(part, name, getattr(tokenizer, name))
    digest = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:8]
    path = cache_dir() / f"{re.sub(r'[^A-Za-z0-9_.-]+', '--', model_name)}-{task}-{digest}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model, processor = model_class(task).from_config(config), spec.processor(tokenizer)
    if not model.should_save_on_this_rank(True):
        return made_by_rank_zero(path)
    save_atomically(path, lambda tmp: (model.save_pretrained(tmp), processor.save_pretrained(tmp)))
    return path


def tiny_tokenizer(model_name: str, task: str) -> PreTrainedTokenizerFast:
    """Trained once on the tiny data and cached; every rank then loads the same files."""
    encoder = is_encoder(model_name)
    kind = "wordpiece" if encoder else "bpe"
    data = write_tiny_dataset(task)  # content-addressed: new data, new tokenizer
    path = cache_dir() / f"tokenizer-{kind}-{data.stem}"
    if not (path / "tokenizer.json").exists():
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        save_atomically(path, train_tokenizer(encoder, texts_of(task, rows)).save_pretrained)
    return PreTrainedTokenizerFast.from_pretrained(path)
