"""Parameter accounting of a model from its meta-device instance: exact shapes, no memory, no download."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..metrics.routing import expert_count, fused_experts

if TYPE_CHECKING:
    from .activations import ActivationFit
    from .vision import ImageCost


@dataclass(frozen=True)
class Shape:
    """Parameter accounting of a model, from its meta-device instance."""

    total: int  # tied weights once
    trainable: int
    largest_module: int  # the largest single module's own parameters: ZeRO-3 gathers per module
    largest_unit: int  # the largest FSDP unit: a transformer layer, or the embeddings / the output head
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    # What decides the activations kept for backward (activation_bytes):
    intermediate_size: int = 0
    q_size: int = 0  # queries' width: heads x head dim (the hidden size, unless head_dim says otherwise)
    kv_size: int = 0  # keys' (and values') width: heads x head dim, fewer heads under grouped-query attention
    gated_mlp: bool = False  # SwiGLU (gate_proj, up_proj): three intermediate-wide tensors instead of one
    rms_norm: bool = False  # RMSNorm keeps an fp32 copy of its input and the normalized tensor
    extra_norms: int = 0  # norms outside the layers: BERT's embedding LayerNorm, Llama's final norm
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    language_model: bool = True  # a vocabulary-wide output head (and cross-entropy over it)
    head_trainable: bool = True  # trained (full fine-tuning), or frozen (LoRA)
    quantizable: int = 0  # frozen linear weights but the output head's: what QLoRA stores in 4 bits
    # Embedding tables only looked up (all but a tied output head's): no FLOPs forward or backward
    lookups: int = 0
    lookups_trainable: int = 0
    # The activations measured on the architecture itself (activations.py); the formula fields above stand in
    # where it could not be measured.
    activations: ActivationFit | None = None
    # Layers with softmax attention (attention's FLOPs): all of them in a transformer, some in a hybrid (Jamba's,
    # Qwen3-Next's linear-attention layers), none in a state-space model (Mamba); None: num_layers.
    attention_layers: int | None = None
    # The input features of every LoRA-adapted module, all layers together (peft's lora_A in_features): per token,
    # the elements of what the adapters' dropout masks cover
    lora_inputs: int = 0
    # Why a figure is an upper bound rather than the model's own: per-layer sizes that differ, a family without
    # attention heads (a line of the plan says so)
    conservative: str = ""
    # Where the parameters sit, for pipeline stages (stage): in the layer list, all layers together, and in the input
    # embeddings (the first stage's); the rest (final norm, head) is the last stage's.
    layers_params: int = 0
    blocks: int = 0  # the layer list's length, which stages divide (LongCat-Flash: half its num_hidden_layers)
    layers_trainable: int = 0
    input_params: int = 0
    input_trainable: int = 0
    # A mixture of experts: the routed experts' parameters a token is not sent to, (E - k) / E of them (all held in
    # memory, none multiplied for that token), the trainable ones apart; and how it routes, for the plan's lines.
    inactive: int = 0
    inactive_trainable: int = 0
    routing: str = ""
    # For expert parallelism: the routed experts' parameters, all layers' and the largest layer's (not gathered to
    # compute them), the most experts one layer routes over (what ep_size divides), and the copies of a token's
    # hidden state sent to experts per token, all layers together (the sum of each MoE layer's top-k: what the
    # all-to-alls carry).
    routed_params: int = 0
    unit_experts: int = 0
    experts_per_layer: int = 0
    routed_copies: int = 0
    # LoRA on a parameter itself (peft's ParamWrapper: what "all-linear" does to fused experts): the frozen weight is
    # multiplied as W + B A, whose gradient is computed, so its active part costs 6 FLOPs a token, not 4; the adapter
    # factors multiply once per forward pass into B A (not per token): none per token.
    merged_frozen: int = 0
    merged_adapters: int = 0
    # An image-text model's image path (vision.py), measured per image: its tower and projector run on patches,
    # not on the text tokens FLOPs per token count.
    image: ImageCost | None = None

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    @property
    def active(self) -> int:
        """Parameters a token passes through: all but the routed experts it is not sent to."""
        return self.total - self.inactive

    def stage(self, stage: int, stages: int) -> Shape:
        """The part of the model pipeline stage `stage` of `stages` holds: an equal share of the layers, with the
        input embeddings on the first, the final norm and head on the last (models/pipeline.py's cut)."""
        first, last = stage == 0, stage == stages - 1
        rest, rest_trainable = (
            self.total - self.layers_params - self.input_params,
            (self.trainable - self.layers_trainable - self.input_trainable),
        )
        return replace(
            self,
            total=self.layers_params // stages + first * self.input_params + last * rest,
            trainable=self.layers_trainable // stages + first * self.input_trainable + last * rest_trainable,
            num_layers=self.num_layers // stages,
            blocks=self.blocks // stages,
            attention_layers=None if self.attention_layers is None else self.attention_layers // stages,
            inactive=self.inactive // stages,
            inactive_trainable=self.inactive_trainable // stages,
            merged_frozen=self.merged_frozen // stages,
            merged_adapters=self.merged_adapters // stages,
            lookups=self.lookups if first else 0,
            lookups_trainable=self.lookups_trainable if first else 0,
            quantizable=self.quantizable // stages,
            lora_inputs=self.lora_inputs // stages,
            language_model=self.language_model and last,
        )

    @classmethod
    def of(cls, model: torch.nn.Module, config) -> Shape:
        """The shape of a (meta-device) model and its config (fields_of)."""
        return cls(**fields_of(model, config))


def attention_fields(model: torch.nn.Module, text, notes: list[str]) -> tuple[int, int, int, list]:
    """The heads, the query and key/value widths (from the projections, else the config) and the attention
    modules; a note where they are guessed."""
    heads = largest(getattr(text, "num_attention_heads", None), "num_attention_heads", notes) or 0
    attention = attention_modules(model)
    q_size, kv_size = projection_widths(attention)
    if heads and not q_size:  # no q/k projections to read (fused qkv: GPT-2, Falcon): from the config
        head_dim = largest(getattr(text, "head_dim", None), "head_dim", notes) or text.hidden_size // heads
        kv_heads = largest(getattr(text, "num_key_value_heads", None), "num_key_value_heads", notes) or heads
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
    if not heads:
        notes.append("no attention heads (a state-space family): attention planned as none")
    return heads, q_size, kv_size, attention


def fields_of(model: torch.nn.Module, config) -> dict:
    """Shape's fields of a (meta-device) model and its config."""
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    block = max((b[0] for b in blocks), key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    layer = sum(p.numel() for p in block.parameters()) if block is not None else 0
    embeddings = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    head_params = head.weight.numel() if head is not None else 0
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    notes = []
    heads, q_size, kv_size, attention = attention_fields(model, text, notes)
    intermediate = largest(getattr(text, "intermediate_size", None), "intermediate_size", notes)
    names = [name for name, _ in model.named_modules()]
    tables = {id(p): p for m in model.modules() if isinstance(m, torch.nn.Embedding)
              for p in m.parameters(recurse=False) if head is None or p is not head.weight}.values()  # fmt: skip
    norms = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("Norm", "LayerNorm"))]
    layer_list = max(blocks, key=len, default=[])
    experts = routed_experts(model, text)
    if any(k is None for _, _, k in experts):
        notes.append("experts per token not found: FLOPs count every expert")
    idle = {id(p): p.numel() * max(0, n - k) // n for params, n, k in experts if k is not None for p in params}
    in_block = {id(p) for p in block.parameters()} if block is not None else set()
    merged = [m for m in model.modules() if hasattr(m, "get_param") and hasattr(m, "lora_A")]  # peft's ParamWrapper
    merged_frozen = {id(p): p for p in (m.get_param() for m in merged) if not p.requires_grad}.values()
    in_layers = {id(p): p for m in layer_list for p in m.parameters()}.values()
    inputs = model.get_input_embeddings().weight
    return dict(
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        largest_module=max(own),
        largest_unit=max(layer, embeddings, head_params),
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_heads=heads,  # 0: attention-free
        vocab_size=text.vocab_size,
        # GPT-2 (n_inner), OPT (ffn_dim), Falcon, DistilBERT name it otherwise: the layer's widest linear
        intermediate_size=intermediate or widest_linear(block),
        q_size=q_size,
        kv_size=kv_size,
        gated_mlp=any(name.endswith("gate_proj") for name in names),
        rms_norm=any("RMSNorm" in n for n in norms),
        extra_norms=max(0, len(norms) - 2 * text.num_hidden_layers),
        hidden_dropout=getattr(text, "hidden_dropout_prob", 0.0) or 0.0,
        attention_dropout=getattr(text, "attention_probs_dropout_prob", getattr(text, "attention_dropout", 0.0)) or 0.0,
        language_model=head is not None and head_params == embeddings,
        head_trainable=head is not None and head.weight.requires_grad,
        quantizable=sum(
            m.weight.numel()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m is not head and not m.weight.requires_grad
        ),  # fmt: skip
        lookups=sum(p.numel() for p in tables),
        lookups_trainable=sum(p.numel() for p in tables if p.requires_grad),
        attention_layers=len(attention) if attention else (text.num_hidden_layers if heads else 0),
        lora_inputs=sum(
            next(iter(m.lora_A.values())).in_features for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A)
        ),  # fmt: skip
        conservative="; ".join(notes),
        layers_params=sum(p.numel() for p in in_layers),
        blocks=len(layer_list),
        layers_trainable=sum(p.numel() for p in in_layers if p.requires_grad),
        input_params=inputs.numel(),
        input_trainable=inputs.numel() if inputs.requires_grad else 0,
        inactive=sum(idle.values()),
        inactive_trainable=sum(idle[id(p)] for p in params if id(p) in idle and p.requires_grad),
        merged_frozen=sum(p.numel() - idle.get(id(p), 0) for p in merged_frozen),
        merged_adapters=sum(
            p.numel() for m in merged for f in (m.lora_A, m.lora_B) for p in f.parameters() if p.requires_grad
        ),
        routing="; ".join(sorted({f"{k} of {n} routed experts" for _, n, k in experts if k and k < n})),
        routed_params=sum(p.numel() for params, _, _ in experts for p in params),
        unit_experts=sum(p.numel() for params, _, _ in experts for p in params if id(p) in in_block),
        experts_per_layer=max((n for _, n, _ in experts), default=0),
        routed_copies=sum(k or n for _, n, k in experts),
    )


def routed_experts(model: torch.nn.Module, config) -> list[tuple[list[torch.nn.Parameter], int, int | None]]:
    """Each set of routed experts on the model: (its parameters, experts, experts each token is routed to; None
    where not found). Two layouts: transformers 5's fused experts, one module whose 3-D parameters stack the
    experts (`num_experts` of them along the first axis, the attribute transformers' experts kernels read), and the
    per-expert layout, a ModuleList (ModuleDict) named `experts`, one MLP each (LoRA adapters inside included).
    Experts per token: the `top_k` its MoE block or that block's router routes with, else the config's
    `num_experts_per_tok`. Shared experts and the router are no part of these: every token passes through them."""
    found, seen, names = [], set(), dict(model.named_modules())
    for name, module in names.items():
        count, fused = expert_count(module), fused_experts(module)
        listed = isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) and name.rsplit(".", 1)[-1] == "experts"
        if not (fused or listed and len(module) > 1):
            continue
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            outer = name.removesuffix(".base_layer.base_layer").removesuffix(".base_layer")  # past peft's wrappers
            block = names[outer.rsplit(".", 1)[0]] if "." in outer else model
            found.append((params, count if fused else len(module), experts_per_token(block, config)))
    return found


def experts_per_token(block: torch.nn.Module, config) -> int | None:
    """The k of an MoE block's top-k routing: its own or its router's (a child's) `top_k`, else the config's."""
    for module in (block, *block.children()):
        for attribute in ("top_k", "num_experts_per_tok"):
            if isinstance(value := getattr(module, attribute, None), int) and value > 0:
                return value
    value = getattr(config, "num_experts_per_tok", None)
    return value if isinstance(value, int) and value > 0 else None


def largest(value, name: str, notes: list[str]) -> int | None:
    """A config size as one number: itself, or where it differs per layer (a list, a dict per layer type: Gemma-3n's
    intermediate_size) the largest, noted, so that a plan is an upper bound rather than a crash."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        sizes = [v for v in value if isinstance(v, int)]
        if len(set(sizes)) > 1:
            notes.append(f"{name} differs per layer: planned at the largest, {max(sizes):,}")
        return max(sizes, default=None)
    return value if isinstance(value, int) else None


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The softmax-attention modules of a model (one per attention layer): those with separate q and k projections,
    or named *Attention with a fused one (GPT-2's c_attn, Falcon's query_key_value); not linear-attention or
    state-space mixers (Qwen3-Next's GatedDeltaNet, Mamba)."""
    found = []
    for module in model.modules():
        children = dict(module.named_children())
        separate = {"q_proj", "k_proj"} <= set(children) or {"query", "key"} <= set(children)
        fused = type(module).__name__.endswith("Attention") and any(
            n in children for n in ("c_attn", "query_key_value", "qkv_proj", "Wqkv", "in_proj"))  # fmt: skip
        if separate or fused:
            found.append(module)
    return [m for m in found if not any(m is not o and m in list(o.modules()) for o in found)]


def projection_widths(attention: list[torch.nn.Module]) -> tuple[int, int]:
    """(query width, key width) read off the attention modules' projections, the largest over layers (head sizes
    that differ per layer type plan as the largest); (0, 0) where there are no separate q/k projections."""
    q = k = 0
    for module in attention:
        children = dict(module.named_children())
        query, key = children.get("q_proj") or children.get("query"), children.get("k_proj") or children.get("key")
        if isinstance(query, torch.nn.Linear) and isinstance(key, torch.nn.Linear):
            q, k = max(q, query.out_features), max(k, key.out_features)
    return q, k


def widest_linear(block: torch.nn.Module | None) -> int:
    """The widest input or output of a layer's linear maps (nn.Linear, GPT-2's Conv1D): its MLP's width."""
    if block is None:
        return 0
    shapes = [m.weight.shape for m in block.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    return max((max(shape) for shape in shapes), default=0)
