"""`python -m toolkit serve RUN [--gguf q4_k_m] [--port 8000]`: an OpenAI-compatible endpoint for a run's model, on
loopback.

RUN's model is served by transformers' own server (`transformers serve`: /v1/chat/completions with streaming,
/v1/models): the run's tokenizer and chat template, and the stop tokens the run saved in its generation_config
(the template's end of turn as well as the end of sequence). transformers' server loads full models only, so a LoRA
run's adapter is put on its base here as `toolkit generate` does, with the same stops. `--gguf TYPE` serves the
run's GGUF file of that type (`toolkit export`) with llama.cpp's server (llama-cpp-python's), the chat template
and stops read from the file. The model's name in requests is what the first line printed says.

Refused in one line before a model loads: a folder with no model, a classifier, a GGUF not exported, a port in use.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from ..errors import ConfigError, command, description
from ..generate import refuse_classifier
from ..models.gguf_model import exported_files
from ..results.record import check_export


def check_port(host: str, port: int) -> None:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            raise ConfigError(f"{host}:{port} cannot be served on ({error.strerror}): pass another --port.") from None


def serve_gguf(path: Path, name: str, host: str, port: int, n_ctx: int) -> None:
    """llama.cpp's server in this process's place (its signals, its exit code)."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"llama.cpp's server cannot start ({error}): `make install` installs llama-cpp-python "
                          "with its server.") from None  # fmt: skip
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--model_alias", name, "--host", host,
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(os.cpu_count() or 1)]  # fmt: skip
    os.execv(sys.executable, argv)


def serve_transformers(run: Path, host: str, port: int, dtype: str, ready=None) -> object:
    """transformers' server for the run's model; an adapter is loaded on its base (toolkit generate's load).
    `ready`: run it in a thread and return the server (tests), else block until it is stopped."""
    from transformers.cli.serve import Serve
    from transformers.cli.serving.model_manager import ModelManager

    from ..generate import load

    if (run / "adapter_config.json").is_file():  # transformers' server reads a config.json it does not have
        model, _ = load(run, dtype)
        original = ModelManager._load_model
        ModelManager._load_model = lambda self, name, *args, **kwargs: \
            model if name == str(run) else original(self, name, *args, **kwargs)  # fmt: skip
    return Serve(force_model=str(run), host=host, port=port, dtype=dtype, device="auto", log_level="warning",
                 non_blocking=ready is not None)  # fmt: skip


@command
def serve_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit serve RUN [--gguf TYPE] [--port 8000] [--host 127.0.0.1]`: an OpenAI-compatible endpoint
    for a run's model (transformers' server, or llama.cpp's for its GGUF)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit serve", description=description(serve_main.__doc__))
    parser.add_argument("run", help="a run's --output_dir, its merged/ folder, or a checkpoint")
    parser.add_argument("--gguf", help="serve the run's GGUF file of this type (q4_k_m, ...) with llama.cpp")
    parser.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default): this machine only")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--n_ctx", type=int, default=4096, help="--gguf: llama.cpp's context length")
    args = parser.parse_args(argv)
    run = Path(args.run).absolute()
    if not run.is_dir():
        raise ConfigError(f"{args.run}: no such folder: pass a run's --output_dir.")
    gguf = exported_files(run, [args.gguf])[args.gguf] if args.gguf else None
    if gguf is None:
        check_export(run)
        check_text_model(run)
    check_port(args.host, args.port)
    name = run.name if gguf else str(run)
    print(f"serving {gguf or run} at http://{args.host}:{args.port}/v1 as model {name!r} (Ctrl-C stops it); "
          f"OpenAI(base_url='http://{args.host}:{args.port}/v1', api_key='none')", flush=True)  # fmt: skip
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: --host {args.host}: anyone who can reach this machine can use the model", file=sys.stderr)
    if gguf is not None:
        serve_gguf(gguf, name, args.host, args.port, args.n_ctx)
    serve_transformers(run, args.host, args.port, args.dtype)
    return 0


def check_text_model(run: Path) -> None:
    """A model that writes text: not a classifier (whose head labels it)."""
    import json

    adapter = run / "adapter_config.json"
    config = run / "config.json"
    if adapter.is_file() and not config.is_file():
        return  # the base's config is read when the adapter loads (generate.load's own errors)
    refuse_classifier(run, json.loads(config.read_text()).get("architectures"))
