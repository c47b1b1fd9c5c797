"""The attention kernel a run uses, and the shapes each kernel can be given.

`choose_attention` resolves `--attn_implementation auto` from the config alone. Flex attention is compiled by
torch inductor, which cannot lower every shape: `flex_lowers` is its rule, and the run keeps to it by padding
every flex batch to a multiple of the mask's block (`pad_multiple`) and generating with sdpa (`for_generation`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from transformers import PretrainedConfig

from ..errors import ConfigError
from ..settings.tasks import architecture

ATTENTION_SUPPORT = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                     "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}  # fmt: skip

# How each FlashAttention's package is installed (transformers' availability check names its distribution).
FLASH_INSTALL = {2: "`pip install flash-attn`", 3: "flash-attn-3, built from flash-attention's hopper/ folder",
                 4: "`pip install flash-attn-4`"}  # fmt: skip

FLEX_ON_CPU = ("flex_attention trains on a GPU only (torch's CPU compiler has no backward for it, pytorch#169646): "
               "pass --attn_implementation sdpa, or auto.")  # fmt: skip

# The rows and columns of a flex BlockMask block: torch's default (_DEFAULT_SPARSE_BLOCK_SIZE), which transformers'
# masks use. Also the query length from which inductor lowers flex attention to its main kernel (below).
FLEX_BLOCK = 128


def support_flag(attention: str | None) -> str | None:
    """The class attribute by which a transformers model declares a kernel: every FlashAttention, a Hub kernel of one
    included, shares `_supports_flash_attn` (transformers' is_flash_attention_requested); None for eager or unknown."""
    from transformers.utils.generic import is_flash_attention_requested

    if attention and is_flash_attention_requested(requested_attention_implementation=attention):
        return "_supports_flash_attn"
    return ATTENTION_SUPPORT.get(attention)


def check_installed(attention: str | None, on_gpu: bool) -> None:
    """A kernel whose package is missing fails in from_pretrained, after the data is tokenized: refused first, by
    transformers' own availability checks. FlashAttention N needs its package and a GPU, or on a GPU the kernels
    package (transformers then loads the same kernel from the Hub: FLASH_ATTN_KERNEL_FALLBACK); a Hub kernel
    (org/name) needs the kernels package."""
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX as FLASH
    from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_FALLBACK
    from transformers.utils import is_kernels_available
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION

    kernels = f"`pip install kernels` ({KERNELS_MIN_VERSION} <= version < {KERNELS_MAX_VERSION})"
    version = re.fullmatch(r"flash_attention_(\d+)", attention or "")
    if version and int(version.group(1)) in FLASH:
        number = int(version.group(1))
        if FLASH[number]["general_availability_check"]() or (on_gpu and is_kernels_available()):
            return
        install = FLASH_INSTALL.get(number, f"FlashAttention {number}'s package")
        hub = FLASH_ATTN_KERNEL_FALLBACK.get(attention, "its kernel")
        raise ConfigError(f"attn_implementation {attention} needs FlashAttention {number} ({install}) and a GPU, or "
                          f"on a GPU {kernels}, for transformers to load {hub} from the Hub: install one, or pass "
                          "--attn_implementation sdpa.")  # fmt: skip
    if is_kernel(attention) and not is_kernels_available():
        raise ConfigError(f"attn_implementation {attention} is a kernel from the Hub, which transformers loads with "
                          f"the kernels package, not installed here (or not at a version it takes): {kernels}, or pass "
                          "--attn_implementation sdpa.")  # fmt: skip


def flex_lowers(query_length: int, heads: int, kv_heads: int, block: int = FLEX_BLOCK) -> bool:
    """Whether torch inductor can compile flex attention for a batch `query_length` tokens wide (torch 2.11-2.13,
    `_inductor/kernel/flex/flex_decoding.py`). Under `block` query tokens, with a power-of-two number of query
    heads per key/value head (GQA ratio g), it lowers to its short-query ("decoding") kernel, whose row tile is
    next_power_of_two(query_length x g), at least 16; a tile that does not divide the mask's block leaves no kernel
    configuration ("NoValidChoicesError ... target: flex_attention"). Measured on an H100 (../shared/gpu/README.md):
    64 tokens with 4/1 heads and 100 with Llama-3.2-1B's 32/8 fail; 32 with 4/1, 64 with 4/4, 128 with 4/1 lower."""
    ratio = heads // kv_heads
    if query_length >= block or query_length < 1 or ratio & (ratio - 1):  # the main kernel
        return True
    tile = max(1 << (query_length * ratio - 1).bit_length(), 16)
    return block % tile == 0


def pad_multiple(attention: str | None) -> int | None:
    """The multiple every batch's width is padded to under this kernel: flex attention's block, so that a batch
    never meets inductor's short-query kernel (flex_lowers); None for the others (no constraint)."""
    return FLEX_BLOCK if attention == "flex_attention" else None


@contextlib.contextmanager
def for_generation(model) -> Iterator[None]:
    """Generation under sdpa where the model trains with flex attention: prompts of any length and one-token
    decoding steps would each compile flex again, and a prompt under 128 tokens can meet the short-query kernel
    (a Llama 3 chat prompt of 33-127 tokens with 4 query heads per key/value head). transformers switches the
    kernel in place (set_attn_implementation); training resumes with flex."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    kernel = getattr(config, "_attn_implementation", None)
    if kernel != "flex_attention" or not hasattr(base, "set_attn_implementation"):
        yield
        return
    base.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        base.set_attn_implementation(kernel)


def choose_attention(config: PretrainedConfig, setting: str | None, task: str, packing: bool, *,
                     on_gpu: bool) -> tuple[str | None, str]:  # fmt: skip
    """The attention kernel and why, for the run's header. `auto` (the default): packed rows on a GPU get a kernel
    that skips the blocks packing masks out, flash-attention's varlen path where flash-attn is installed, else flex
    attention with a document mask (transformers builds one from the position ids' restarts, as for sdpa; batches
    padded to its block, pad_multiple); any other run gets sdpa, which computes the block-diagonal mask densely.
    None: the model's own default."""
    if setting != "auto":
        return setting, ""
    from transformers.utils import is_flash_attn_2_available

    cls = architecture(config, task)
    supports = lambda name: cls is not None and getattr(cls, ATTENTION_SUPPORT[name], False)  # noqa: E731
    if packing and on_gpu:
        if is_flash_attn_2_available() and supports("flash_attention_2"):
            return "flash_attention_2", "auto: packed rows on a GPU, flash-attn's varlen path"
        if supports("flex_attention"):
            return "flex_attention", (f"auto: packed rows on a GPU, a document mask that skips other rows' blocks; "
                                      f"batches padded to multiples of {FLEX_BLOCK}, generation with sdpa")  # fmt: skip
    if not packing:
        why = "auto"
    elif on_gpu:
        why = "auto: packed rows, but the model has no flex attention"
    else:
        why = "auto: packed rows on a CPU, where flex attention does not train"
    return ("sdpa", why) if supports("sdpa") else (None, "auto: the model's default, it has no sdpa")
