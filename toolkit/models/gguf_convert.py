"""llama.cpp's own tools, thinly wrapped: its converter (convert_hf_to_gguf.py, a Hugging Face folder -> a 16-bit
GGUF) and its quantizer (llama-cpp-python's binding of llama_model_quantize), each one call.

Both come from llama-cpp-python's source distribution on PyPI, one version: `make install` builds its bindings
(llama.cpp compiled for any x86-64 with AVX2, so that a wheel pip caches on one CPU runs on the other) and copies
the converter, with the gguf-py it is written against, into `.venv/share/llama.cpp/`. The converter runs in a
process of its own (its sys.path carries that gguf-py before the installed one); its log goes to a file beside the
export, and its failures that are a user's (a family it has no converter for, a tokenizer it does not know) come
back as one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

from ..errors import ConfigError

CONVERTER = Path(sys.prefix) / "share" / "llama.cpp" / "convert_hf_to_gguf.py"
CONVERTED = ("f16", "bf16", "f32")  # written by the converter itself; every other type by the quantizer from f16
INSTALL = "`make install` builds llama-cpp-python and copies its converter into .venv/share/llama.cpp"
# The converter's own words for what it cannot do, and what that means to the user
REFUSALS = [
    (re.compile(r"Model (\S+) is not supported"),
     "llama.cpp's converter has no converter for the {0} architecture: export the safetensors (`toolkit push`) and "
     "serve them with transformers (`toolkit serve`)"),
    (re.compile(r"BPE pre-tokenizer was not recognized"),
     "llama.cpp does not know this tokenizer's pre-tokenizer (a tokenizer trained here, as --tiny's is, or one "
     "newer than this llama.cpp): a GGUF needs a tokenizer llama.cpp implements, the base model's own"),
]  # fmt: skip


def quantizations() -> dict[str, int | None]:
    """Every type a GGUF can be written in, by its lower-case name (q4_k_m): the converter's 16/32-bit types (None),
    then llama.cpp's own list of file types (LLAMA_FTYPE_MOSTLY_*) with their numbers."""
    llama_cpp = bindings()
    types = {name.removeprefix("LLAMA_FTYPE_MOSTLY_").lower(): getattr(llama_cpp, name)
             for name in dir(llama_cpp) if name.startswith("LLAMA_FTYPE_MOSTLY_")}  # fmt: skip
    return {**dict.fromkeys(CONVERTED), **{k: v for k, v in types.items() if k not in CONVERTED}}


def bindings():
    """The llama_cpp module, or one line on how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(f"llama-cpp-python is not installed: {INSTALL}.") from None
    return llama_cpp


def check_converter() -> Path:
    if not CONVERTER.is_file():
        raise ConfigError(f"llama.cpp's converter is not at {CONVERTER}: {INSTALL}.")
    return CONVERTER


def convert(model: Path, out: Path, outtype: str, log: Path) -> None:
    """`model` (a Hugging Face folder) -> the GGUF `out` in `outtype` (f16, bf16, f32), by llama.cpp's converter;
    its output appended to `log`, its writing progress shown. Raises ConfigError for what it refuses."""
    command = [sys.executable, str(check_converter()), str(model), "--outfile", str(out), "--outtype", outtype]
    with open(log, "ab") as sink:
        sink.write(f"$ {' '.join(command)}\n".encode())
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.PIPE)
        tail, shown = b"", False
        for chunk in iter(lambda: process.stderr.read(256), b""):
            sink.write(chunk)
            tail = (tail + chunk)[-4096:]
            if b"Writing:" in chunk:  # tqdm's bar, redrawn with \r: the one line worth showing
                sys.stderr.write(chunk.decode(errors="replace").split("\n")[-1])
                sys.stderr.flush()
                shown = True
        code = process.wait()
    if shown:
        sys.stderr.write("\n")
    if code != 0:
        text = tail.decode(errors="replace")
        for pattern, meaning in REFUSALS:
            if found := pattern.search(text):
                raise ConfigError(meaning.format(*found.groups()) + ".")
        last = [line for line in text.splitlines() if line.strip()][-1:] or [f"exit {code}"]
        raise RuntimeError(f"llama.cpp's converter failed on {model} ({last[0].strip()}); its log: {log}")


def quantize(source: Path, out: Path, name: str, log: Path) -> None:
    """The f16 GGUF `source` -> `out` in the quantization `name` (q8_0, q4_k_m, ...), by llama.cpp's quantizer on
    every core; what it prints (a line a tensor) goes to `log`."""
    import ctypes

    llama_cpp = bindings()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = quantizations()[name]
    params.nthread = os.cpu_count() or 1
    with open(log, "ab") as sink, stderr_into(sink):
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({code}) writing {out} from {source}; its log: {log}")


@contextlib.contextmanager
def stderr_into(sink):
    """File descriptor 2 (where llama.cpp's C code writes) into `sink` for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
