"""A toolkit process's start: the Trainer stack's import, the second most of a tiny launch's CPU after training."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def heavy_imports() -> Iterator[None]:
    """Import the Trainer stack (torch, transformers, peft, datasets) with the cyclic garbage collector paused, then
    freeze what it built out of later collections: its millions of objects live as long as the process, and were
    walked by collection after collection, during the import and through the run. A tiny 8-step run took 8.8 s of
    CPU instead of 11.7 (2-core EPYC), and every rank of every launch starts that much sooner. Only where this
    import is the process's first (a recipe script, a command); a process that has the stack already keeps its
    own collector as it is (cycles it still holds would otherwise never be freed).

    bitsandbytes is left out of that import: peft imports it eagerly for a helper the toolkit never calls (its
    kappa targets), and bitsandbytes registers its kernels with torch.compile, which imports the compiler: ~1.1 s of
    CPU on every rank (2-core EPYC). A LoRA run imports it when peft adds the adapters (its dispatch looks for
    8-bit and 4-bit layers), a QLoRA run when the weights load in 4-bit; nothing asks whether it is installed during
    the import (tests/test_qlora.py proves both)."""
    if "transformers" in sys.modules:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    deferred = "bitsandbytes" not in sys.modules
    if deferred:
        sys.modules["bitsandbytes"] = None  # `import bitsandbytes` fails (ImportError) while this is set
    try:
        yield
    finally:
        if deferred and sys.modules.get("bitsandbytes", 0) is None:
            del sys.modules["bitsandbytes"]  # importable again, by the 4-bit loading and peft's LoRA layers for it
        gc.freeze()
        if enabled:
            gc.enable()
