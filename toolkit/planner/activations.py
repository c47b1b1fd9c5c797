"""Activations of any architecture, measured: the bytes autograd saves for backward in scaled-down instances of
the model itself, fitted and extrapolated to its real size. No per-family formula, no config attribute names
beyond transformers' standard ones: whatever a family's layers keep (norms, gates, routers, rotary tables,
attention scores) is counted because it is saved.

Why the fit is exact in form: every tensor a layer saves is tokens x a width (hidden, intermediate, query, key,
vocabulary: these scale with the instance), tokens x a count (heads, experts, per-token statistics: these do
not), or, for eager attention, heads x sequence² (does not scale); a classifier's pooled row is per sample. So
at width ratio r, L layers and sequence s, per sample: bytes = L x layer(r, s) + outside(r, s), each term
(a r + b) s + (c r + d) s², the outside one plus (e r + f), and per micro-batch what its samples share (masks,
rotary tables, relative-position projections). Four instances (r in two ratios, L in 1 and 2), each at two
batch sizes and four lengths, fit it by least squares; r = 1 is the model. A second on a CPU, cached.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import time
from dataclasses import asdict, dataclass

import torch

from ..models.meta import outside_zero3_init
from ..project import aside, cache_root
from ..settings.tasks import GENERATIVE, model_class

LAYERS = (1, 2)
SEQUENCES = (16, 32, 64, 128)
BATCHES = (2, 4)  # not 1: some models skip a copy at batch 1 (Falcon's multi-query keys) that any larger batch makes
# Widths scaled with the instance, under the names transformers' configs use (attribute_map gives GPT-2's n_embd
# and the like). A width missed here is not an error: it stays full size in every instance and the fit counts it
# with the terms that do not scale.
WIDTHS = ("hidden_size", "intermediate_size", "vocab_size", "ffn_dim", "n_inner", "hidden_dim", "ffn_hidden_size",
          "moe_intermediate_size", "shared_expert_intermediate_size", "embedding_size", "pooler_hidden_size",
          "word_embed_proj_dim")  # fmt: skip
VERSION = 4  # bump when the measurement changes: the cache key includes it
BUDGET_S = 10  # seconds a full-depth measurement may take (fit_by_layer); beyond it, the formula


@dataclass(frozen=True)
class ActivationFit:
    """Bytes saved for backward, as fitted (`coefficients` in the order of `features`): inside each layer, per
    sample (a r + b) s + (c r + d) s² and per micro-batch e r + f (DeBERTa's relative-position projections);
    outside the layers (embeddings, final norm, head, loss) per sample the same plus (g r + h), and per
    micro-batch, shared by its samples (masks, rotary tables), the same again."""

    coefficients: tuple[float, ...]
    ratios: tuple[float, float]  # the width ratios measured, for the record
    largest_layer: bool = False  # measured at full depth, every layer taken as the largest (layers that differ)
    compiled: bool = False  # as torch.compile saves them (compiled.py): its loss's backward, too, is fused

    @property
    def note(self) -> str:
        widths = " and ".join(f"1/{round(1 / r)}" if r < 1 else f"{r:g}x" for r in self.ratios)
        depth = ", each layer planned as the largest (its layers differ: an upper bound)" if self.largest_layer else ""
        return f"measured: the bytes autograd saves in instances at {widths} of the width{depth}, extrapolated"

    def saved(self, micro_batch: int, seq_length: int, layers: int, ratio: float = 1.0) -> int:
        """All layers and the rest, at `ratio` of the real width (1: the model itself)."""
        inside = self.layer_bytes(micro_batch, seq_length, ratio) * layers
        return inside + self.outside_bytes(micro_batch, seq_length, ratio)

    def layer_bytes(self, micro_batch: int, seq_length: int, ratio: float = 1.0) -> int:
        terms = features(ratio, 1, seq_length, micro_batch)[:LAYER_TERMS]
        return max(0, round(sum(c * t for c, t in zip(self.coefficients, terms, strict=False))))

    def outside_bytes(self, micro_batch: int, seq_length: int, ratio: float = 1.0) -> int:
        terms = features(ratio, 0, seq_length, micro_batch)[LAYER_TERMS:]
        return max(0, round(sum(c * t for c, t in zip(self.coefficients[LAYER_TERMS:], terms, strict=True))))


LAYER_TERMS = 6


def features(ratio: float, layers: int, s: int, b: int) -> list[float]:
    """The multipliers of ActivationFit's coefficients for one instance and input: per layer (per sample, then
    shared by the micro-batch), then outside the layers (per sample, then shared)."""
    r = ratio
    tokens = [r * s, s, r * s * s, s * s]
    whole = [*tokens, r, 1.0]
    return [layers * b * x for x in tokens] + [layers * r, layers] + [b * x for x in whole] + whole


def width_ratios(config) -> tuple[float, float]:
    """Two ratios 1/k, 2/k that keep every head whole with an even head_dim of at least 4 (rotary embeddings rotate
    pairs), as small as that allows: the instances take milliseconds."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if isinstance(heads, int) and heads else hidden)
    head_dim = head_dim if isinstance(head_dim, int) else hidden  # a head size per layer type: not a constraint
    for k in (64, 32, 16, 8, 4, 2):
        if hidden % k == 0 and head_dim % k == 0 and head_dim // k >= 4 and (head_dim // k) % 2 == 0:
            return 1 / k, 2 / k
    return 1.0, 2.0


def scaled(config, ratio: float, layers: int | list | None, attention: str | None = None):
    """The config with its widths times `ratio` and `layers` layers (a list: those layer types, one layer each;
    None: the model's own depth and layer layout); heads, experts and everything else kept.
    Under fused attention (`attention` None) without attention dropout: on a CPU, sdpa with dropout takes its
    math path and keeps the scores, which a GPU's kernels do not."""
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in WIDTHS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            setattr(text, key, max(1, round(value * ratio)))
    head_dim = getattr(text, "head_dim", None)
    if head_dim and not isinstance(getattr(type(text), "head_dim", None), property):
        text.head_dim = max(2, round(head_dim * ratio))
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("mrope_section"):  # M-RoPE's sections cover half the (narrowed) head
        half = (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) // 2
        sections = [max(1, round(x * half / sum(rope["mrope_section"]))) for x in rope["mrope_section"]]
        sections[0] += half - sum(sections)
        text.rope_parameters = {**rope, "mrope_section": sections}
    if isinstance(layers, list):
        text.num_hidden_layers, text.layer_types = len(layers), layers
    elif layers is not None:
        text.num_hidden_layers = layers
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:layers]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids beyond the narrowed vocabulary
        value = getattr(text, key, None)
        if isinstance(value, int) and value >= text.vocab_size:
            setattr(text, key, 0)
    if getattr(text, "pad_token_id", None) is None:  # a classifier of several rows (a reward model) finds each
        text.pad_token_id = 0  # row's last token by it; the run takes the tokenizer's
    if hasattr(text, "use_cache"):
        text.use_cache = False
    if getattr(config, "vision_config", None) is not None:  # an image-text model's tower: the text-only forward
        vision = config.vision_config  # never runs it, so one layer, to build the instance in a moment
        for key in ("num_hidden_layers", "depth"):
            if isinstance(getattr(vision, key, None), int):
                setattr(vision, key, 1)
    if attention is None:  # fused kernels (flash, memory-efficient) drop out without keeping the scores
        for key in ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"):
            if isinstance(getattr(text, key, None), float):
                setattr(text, key, 0.0)
    return config


def saved_bytes(model: torch.nn.Module, inputs: dict, owner=None, forward=None) -> int | dict:
    """Bytes of the tensors autograd keeps for backward in one training forward pass, once per storage (ops share
    them; told apart by their C++ storage, which fake tensors have too), the model's parameters excluded. `owner`:
    a callable naming the part running now (a layer's index); then {part: bytes}, each storage counted for the part
    that saved it first. `forward`: what runs (the model on `inputs` by default)."""
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    storages: dict[int, tuple[int, object]] = {}
    alive: list[torch.Tensor] = []  # held through the forward pass, as autograd would: no storage is reused

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters and storage._cdata not in storages:
            storages[storage._cdata] = (storage.nbytes(), owner() if owner else None)
        alive.append(tensor)
        # Not the tensor: no backward runs, and an op's output packed as itself is a reference cycle through
        # autograd's C++ graph that Python's collector cannot see (it leaked every instance measured).
        return None

    def unpack(_):
        raise RuntimeError("saved_bytes measures a forward pass only: no backward through it.")

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = forward() if forward is not None else model(**inputs)
    for tensor in outputs(out):  # the logits a compiled graph saves are the model's output, planned as logits
        storages.pop(tensor.untyped_storage()._cdata, None)
    alive.clear()
    if owner is None:
        return sum(size for size, _ in storages.values())
    parts: dict = {}
    for size, part in storages.values():
        parts[part] = parts.get(part, 0) + size
    return parts


def outputs(out) -> list[torch.Tensor]:
    """The tensors a forward returned (a ModelOutput's, a tuple's)."""
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else [out]
    return [v for v in values if isinstance(v, torch.Tensor)]


def instance(config, task: str, dtype: torch.dtype, attention: str | None, lora: dict | None):
    """A random-weight model of `config`, with the run's LoRA adapters where it trains them (peft's: its dropout
    masks and the adapters' fp32 copies of their inputs are saved for backward, and the frozen linears save none)."""
    model = model_class(task).from_config(config, dtype=dtype, attn_implementation=attention)
    if lora:
        from peft import LoraConfig, get_peft_model

        kind = "CAUSAL_LM" if task in GENERATIVE else "SEQ_CLS"
        model = get_peft_model(model, LoraConfig(**lora, task_type=kind))
    return model


def measure(config, task: str, dtype: torch.dtype, attention: str | None, ratio: float, layers: int,
            inputs: list[tuple[int, int]], fused_head: bool = False, lora: dict | None = None,
            autocast: bool = False, prepare=None) -> list[int]:  # fmt: skip
    """Bytes saved for backward by an instance of `config` at `ratio` width and `layers` layers (random weights),
    for each (micro-batch, sequence length) in `inputs`; `fused_head`: the loss through TRL's fused head; `lora`:
    peft's LoraConfig arguments, dropout included, where the run trains an adapter; `prepare(model) -> model`: as
    the run changes it (compiled.py: torch.compile, torchao's float8)."""
    small = scaled(config, ratio, layers, attention)
    text = small.get_text_config() if hasattr(small, "get_text_config") else small
    with torch.random.fork_rng(devices=[]), outside_zero3_init():  # the run's random state is left as it was
        torch.manual_seed(0)
        model = instance(small, task, dtype, attention, lora)
        fused = {}
        if fused_head:  # the loss as the run computes it: TRL's head saves its input, not log-probabilities
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
            fused = {"fused_lm_head": True}
        if prepare is not None:
            model = prepare(model)
        out = []
        for b, s in inputs:
            ids = torch.randint(1, text.vocab_size, (b, s))
            labels = ids if task in GENERATIVE else torch.zeros(b, dtype=torch.long)
            with mixed(dtype, autocast):
                out.append(saved_bytes(model, {"input_ids": ids, "labels": labels, **fused}))
        return out


def mixed(dtype: torch.dtype, autocast: bool):
    """The run's autocast (its --bf16 or --fp16), under which LoRA adapters (fp32) save 16-bit copies of their
    inputs: a measurement without it would count fp32 ones."""
    return torch.autocast("cpu", dtype=dtype) if autocast and dtype != torch.float32 else contextlib.nullcontext()


def measure_by_layer(config, task: str, dtype: torch.dtype, attention: str | None, ratio: float,
                     inputs: list[tuple[int, int]], layers: list | None, fused_head: bool = False,
                     lora: dict | None = None, autocast: bool = False) -> list[tuple[int, int]]:  # fmt: skip
    """(the largest layer's bytes, the bytes outside the layers) saved for backward by an instance of `config` at
    `ratio` width with `layers` (scaled's: a layer of each type, or None, its own depth and layout), for each
    (micro-batch, sequence length) in `inputs`."""
    small = scaled(config, ratio, layers, attention)
    text = small.get_text_config() if hasattr(small, "get_text_config") else small
    with torch.random.fork_rng(devices=[]), outside_zero3_init():
        torch.manual_seed(0)
        model = instance(small, task, dtype, attention, lora)
        fused = {}
        if fused_head:
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
            fused = {"fused_lm_head": True}
        blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
        layers = max(blocks, key=len)
        running: list = [None]
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda module, args, i=index: running.__setitem__(0, i))
            layer.register_forward_hook(lambda module, args, out: running.__setitem__(0, None))
        out, start = [], time.perf_counter()
        for b, s in inputs:
            if time.perf_counter() - start > BUDGET_S:  # a full-depth state-space stack on a CPU: minutes
                raise TimeoutError(f"an instance at full depth takes over {BUDGET_S} s on this CPU")
            ids = torch.randint(1, text.vocab_size, (b, s))
            labels = ids if task in GENERATIVE else torch.zeros(b, dtype=torch.long)
            with mixed(dtype, autocast):
                parts = saved_bytes(model, {"input_ids": ids, "labels": labels, **fused}, owner=lambda: running[0])
            out.append((max((v for k, v in parts.items() if k is not None), default=0), parts.get(None, 0)))
        return out


def settable(config, name: str) -> bool:
    """Whether a config attribute can be set: not a read-only property, under its own name or the one its
    attribute_map gives it (Falcon-H1's layer_types is its derived layers_block_type)."""
    target = getattr(type(config), "attribute_map", {}).get(name, name)
    return not isinstance(getattr(type(config), target, None), property)


SOFTMAX_ATTENTION = ("full_attention", "sliding_attention", "chunked_attention", "attention")


def uniform_layers(config) -> bool:
    """Whether every layer is built alike and the depth can be set: a config whose `layer_types` name more than
    one kind of mixer (Qwen3-Next's linear and full attention) or whose layout is derived, read-only (Jamba's
    and Falcon-H1's layers_block_type), cannot be measured from 1- and 2-layer instances."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    derived = not all(settable(text, name) for name in ("layer_types", "layers_block_type", "num_hidden_layers"))
    # softmax attention over a window or the whole row saves the same tensors: one kind
    mixers = {"attention" if t in SOFTMAX_ATTENTION else t for t in getattr(text, "layer_types", None) or []}
    return not derived and len(mixers) <= 1


def fit_by_layer(config, task: str, dtype: torch.dtype, attention: str | None, fused_head: bool,
                 lora: dict | None = None, autocast: bool = False) -> ActivationFit:  # fmt: skip
    """For layers that differ: instances with one layer of each type (or, where the layout is derived and cannot
    be set, at full depth), the largest layer fitted as every layer's (an upper bound) and what is outside the
    layers fitted apart, each by least squares over two widths x eight inputs."""
    ratios = width_ratios(config)
    inputs = [(b, s) for b in BATCHES for s in SEQUENCES]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = list(dict.fromkeys(getattr(text, "layer_types", None) or [])) if settable(text, "layer_types") else []
    layer_rows, layer_bytes, outside_rows, outside_bytes = [], [], [], []
    for r in ratios:
        measured = measure_by_layer(config, task, dtype, attention, r, inputs, kinds or None, fused_head, lora,
                                    autocast)  # fmt: skip
        for (b, s), (largest, outside) in zip(inputs, measured, strict=True):
            layer_rows.append(features(r, 1, s, b)[:LAYER_TERMS])
            layer_bytes.append(largest)
            outside_rows.append(features(r, 0, s, b)[LAYER_TERMS:])
            outside_bytes.append(outside)
    solve = lambda rows, y: torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),  # noqa: E731
                                               torch.tensor(y, dtype=torch.float64).unsqueeze(1),
                                               driver="gelsd").solution.squeeze(1).tolist()  # fmt: skip
    return ActivationFit(tuple(solve(layer_rows, layer_bytes) + solve(outside_rows, outside_bytes)), ratios, True)


def fit(config, task: str, dtype: torch.dtype, attention: str | None, fused_head: bool = False,
        lora: dict | None = None, autocast: bool = False) -> ActivationFit:  # fmt: skip
    """Least squares over four instances at eight inputs each (module docstring); the model's own size is r = 1.
    Layers that differ are measured at full depth instead (fit_by_layer)."""
    if not uniform_layers(config):
        return fit_by_layer(config, task, dtype, attention, fused_head, lora, autocast)
    ratios = width_ratios(config)
    inputs = [(b, s) for b in BATCHES for s in SEQUENCES]
    rows, measured = [], []
    for r in ratios:
        for layers in LAYERS:
            measured += measure(config, task, dtype, attention, r, layers, inputs, fused_head, lora, autocast)
            rows += [features(r, layers, s, b) for b, s in inputs]
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(measured, dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1)
    return ActivationFit(tuple(solution.tolist()), ratios)


def fit_key(config, task: str, precision: str, flash_attention: bool, fused_head: bool, lora: dict | None,
            autocast: bool) -> tuple[list, torch.dtype, str | None, dict | None]:  # fmt: skip
    """The cache key of a fit, and the dtype, attention and adapter its instances are built with."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    attention = None if flash_attention else "eager"  # None: the model's default, sdpa where it has it
    lora = {**lora, "lora_dropout": 0.0} if lora else None
    key = [config.to_dict(), task, str(dtype), attention, fused_head, lora, autocast, VERSION]
    if experts := getattr(config, "_experts_implementation", None):  # set by with_experts_kernel: not in to_dict
        key.append(experts)
    return key, dtype, attention, lora


def with_experts_kernel(config, experts: str | None):
    """A mixture of experts' config whose instances run the run's expert kernel: what each saves differs (batched_mm,
    transformers' default on a CPU, keeps every token's copy of its experts' weights; grouped_mm, its choice on a
    GPU, does not: 7.7x fewer bytes in a 1/32-width Qwen3-MoE). None, or a dense model: the config as it is."""
    if not experts:
        return config
    config = copy.deepcopy(config)
    config._experts_implementation = experts
    return config


def measured_activations(config, task: str, precision: str, flash_attention: bool, fused_head: bool = False,
                         lora: dict | None = None, autocast: bool = False,
                         experts: str | None = None) -> tuple[ActivationFit | None, str]:  # fmt: skip
    """The fit for a model under a workload, from the cache or measured now; (None, why) when the architecture
    cannot run on this CPU (the planner then falls back to its formula and says so). `lora`: the adapter the run
    trains (peft's LoraConfig arguments), measured without its dropout, whose masks the planner adds at the
    device's size (memory.lora_dropout_bytes: a CPU's masks are 4 bytes an element, CUDA's 1); `autocast`: the run
    computes under autocast (--bf16 with 16-bit weights); `experts`: a mixture of experts' kernel, as the run
    runs it. A compiled run's: compiled.py's planned_activations."""
    config = with_experts_kernel(config, experts)
    key, dtype, attention, lora = fit_key(config, task, precision, flash_attention, fused_head, lora, autocast)
    try:
        stored = cached(key, "", lambda: asdict(fit(config, task, dtype, attention, fused_head, lora, autocast)))
    except Exception as error:  # noqa: BLE001 - any architecture's failure means: use the formula, say why
        return None, f"not measured ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    result = ActivationFit(tuple(stored["coefficients"]), tuple(stored["ratios"]), stored.get("largest_layer"))
    return result, result.note


def cached(key: list, prefix: str, measure) -> dict:
    """`measure()`'s result (a JSON-able dict) for `key`, from the cache's activations folder or measured now and
    written there: each rank measuring at once writes its own file, then renames it over the others'."""
    text = json.dumps(key, sort_keys=True, default=str)
    path = cache_root() / "activations" / f"{prefix}{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if path.is_file() and path.stat().st_size:
        return json.loads(path.read_text())
    result = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = aside(path)
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result
