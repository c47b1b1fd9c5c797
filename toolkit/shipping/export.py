"""`python -m toolkit export RUN --to gguf [--quant f16,q8_0,q4_k_m]`: a run's model as GGUF files for llama.cpp and
Ollama, each checked against the trained model.

The model is the run's (a LoRA run's merged: its merged/ folder, or merged here in a scratch folder), converted to
f16 by llama.cpp's converter (the run's tokenizer and chat template go into the file's metadata) and quantized
from that by llama.cpp's quantizer. Each file then answers the run's held-out prompts greedily beside transformers
(agreement.py); the figures, the file sizes and the times go to RUN/gguf/exports.json, which the card's exports
section and `toolkit push` read. An Ollama Modelfile goes beside them. Files are written in a staging folder and
moved into RUN/gguf/ when all are done: an export that fails leaves the run's earlier files as they were.

Refused in one line before anything loads: a run that is not a text decoder (a classifier; an image-text model,
whose GGUF is two files llama.cpp converts apart), a quantization llama.cpp has no name for, llama.cpp not
installed, a folder that cannot be written. A family llama.cpp's converter does not know is its one line too.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..data.conversations import stop_token_ids
from ..errors import ConfigError, command, description
from ..metrics.samples import EXPORTS_FILE
from ..models import gguf_convert
from ..outputs import check_writable
from ..results.card import CARD, as_written, write_card
from ..results.record import RunRecord, check_export
from ..settings import tasks as task_table
from .agreement import compare, references

DEFAULT = "f16,q8_0,q4_k_m"


def check_run(record: RunRecord, quants: list[str]) -> None:
    """What the export cannot do, before anything loads."""
    kind = task_table.task(record.task)
    if kind.images:
        raise ConfigError(f"{record.folder} is an image-text model ({record.task}): llama.cpp runs one as two GGUF "
                          "files (the language model and its image projector) that this export does not write; "
                          "serve the safetensors with `toolkit serve` instead.")  # fmt: skip
    if kind.pipeline_tag != "text-generation":
        raise ConfigError(f"{record.folder} is a {record.task} model ({kind.pipeline_tag}): GGUF is for models that "
                          "write text, as llama.cpp and Ollama run them.")  # fmt: skip
    known = gguf_convert.quantizations()
    for name in quants:
        if name not in known:
            raise ConfigError(f"--quant {name}: not a type llama.cpp writes; one of {', '.join(known)}.")
    gguf_convert.check_converter()
    check_writable(record.folder / "gguf", "the GGUF files", "Copy the run to a folder you can write.")


def model_folder(record: RunRecord, scratch: Path) -> Path:
    """The full model to convert: the run's own, or for a LoRA run its merged/ folder, else the adapter merged on
    its base in `scratch` (the run's folder is not written)."""
    if not record.lora:
        check_export(record.folder)
        return record.folder
    if (record.folder / "merged" / "config.json").is_file():
        return record.folder / "merged"
    from ..models.lora import save_merged

    check_export(record.folder)
    print(f"export: merging the adapter into {record.base_model} (in a scratch folder)", file=sys.stderr, flush=True)
    return save_merged(record.folder, record.task, "float32", target=scratch / "merged")


def held_out_prompts(record: RunRecord, tokenizer, count: int) -> list[list[dict]]:
    """The first `count` of the run's held-out prompts as its evaluation prepares them (the first training rows'
    where it held none out): a conversation's turns before its first answer, or an online run's prompt."""
    from ..data.loading import load_data
    from ..models.loading import load_config
    from ..results.evaluation import held_out_data
    from ..settings.arguments import DataArguments
    from ..settings.model_arguments import ModelArguments

    try:
        prepared, conversations = held_out_data(record, tokenizer, load_config(record.arguments(ModelArguments)))
        rows = prepared.eval["prompt"] if "prompt" in prepared.eval.column_names else conversations
    except ConfigError:  # nothing held out
        data_args = record.arguments(DataArguments)
        train = load_data(data_args)[0]["train"]
        column = "prompt" if "prompt" in train.column_names else data_args.messages_column
        rows = train.select(range(min(len(train), 4 * count)))[column]
        print(f"export: {record.folder} held nothing out: its first training prompts are compared", file=sys.stderr)
    prompts: dict[str, list[dict]] = {}  # by content: a prompt held out twice is compared once
    for row in rows:
        if isinstance(row, str):
            row = [{"role": "user", "content": row}]
        first = next((i for i, m in enumerate(row) if m["role"] == "assistant"), len(row))
        if row[:first]:
            prompts.setdefault(json.dumps(row[:first], sort_keys=True), row[:first])
    return list(prompts.values())[:count]


def export(folder: str | Path, quants: list[str], prompts: int = 16, max_new_tokens: int = 32) -> list[dict]:
    """Write RUN/gguf/*.gguf, its Modelfile and exports.json; returns each file's record."""
    record = RunRecord.read(folder)
    check_run(record, quants)
    out = record.folder / "gguf"
    made = not out.exists()
    out.mkdir(exist_ok=True)
    log = Path(tempfile.gettempdir()) / f"toolkit-export-{record.folder.name}.log"  # named in a failure's line
    log.unlink(missing_ok=True)
    try:
        records = write_and_compare(record, out, quants, prompts, max_new_tokens, log)
    except BaseException:
        if made:  # a folder this export made, and nothing in it: not left behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    shutil.move(log, out / "export.log")
    unedited = as_written(record.folder)
    written = {r["quantization"]: r for r in earlier(out)} | {r["quantization"]: r for r in records}
    (out / Path(EXPORTS_FILE).name).write_text(json.dumps(list(written.values()), indent=1))
    if unedited:
        write_card(record.folder)
    else:
        print(f"{record.folder / CARD} was edited by hand: left as it is (the exports are in {EXPORTS_FILE})",
              file=sys.stderr)  # fmt: skip
    return records


def write_and_compare(record: RunRecord, out: Path, quants: list[str], prompts: int, max_new_tokens: int,
                      log: Path) -> list[dict]:  # fmt: skip
    """The files written in a staging folder, each compared with transformers, then moved into `out`."""
    from ..generate import load

    with tempfile.TemporaryDirectory(prefix="merge-") as scratch, \
            tempfile.TemporaryDirectory(prefix=".staging-", dir=out) as staging:  # fmt: skip
        source, staged = model_folder(record, Path(scratch)), Path(staging)
        files = write_files(record, source, staged, quants, log)  # the converter refuses a family in seconds
        model, tokenizer = load(source, "float32")
        asked = held_out_prompts(record, tokenizer, prompts)
        print(f"export: transformers answers {len(asked)} held-out prompts", file=sys.stderr, flush=True)
        refs = references(model, tokenizer, asked, max_new_tokens)
        del model
        stops, n_ctx = stop_token_ids(tokenizer), max(len(r.ids) + len(r.answer) for r in refs) + 8
        records = []
        for name, path, seconds in files:
            agreement = compare(path, refs, stops, n_ctx)
            records.append({"file": path.name, "quantization": name, "bytes": path.stat().st_size,
                            "seconds": round(seconds, 1), "agreement": agreement.as_dict(),
                            "agreement_line": agreement.line()})  # fmt: skip
            print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB; {agreement.line()}", flush=True)
        (staged / "Modelfile").write_text(modelfile(records, tokenizer))
        for item in staged.iterdir():
            item.replace(out / item.name)
    return records


def write_files(record: RunRecord, source: Path, staged: Path, quants: list[str], log: Path) -> list[tuple]:
    """Each asked-for GGUF in `staged`, as (quantization, path, seconds): f16 first (the quantizer's source)."""
    stem, files = record.folder.name, []
    f16 = staged / f"{stem}-f16.gguf"
    for name in ["f16", *[q for q in quants if q != "f16"]]:
        path, start = staged / f"{stem}-{name}.gguf", time.perf_counter()
        print(f"export: {path.name}", file=sys.stderr, flush=True)
        if name in gguf_convert.CONVERTED:
            gguf_convert.convert(source, path, name, log)
        else:
            gguf_convert.quantize(f16, path, name, log)
        files.append((name, path, time.perf_counter() - start))
    if "f16" not in quants:  # the quantizer's source only
        f16.unlink()
        files = files[1:]
    return files


def earlier(out: Path) -> list[dict]:
    path = out / Path(EXPORTS_FILE).name
    return json.loads(path.read_text()) if path.is_file() else []


def modelfile(records: list[dict], tokenizer) -> str:
    """Ollama's Modelfile for the smallest file: the run's stop tokens; Ollama reads the chat template from the
    file's metadata (tokenizer.chat_template), as llama.cpp does."""
    smallest = min(records, key=lambda r: r["bytes"])
    stops = [tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids(tokenizer)]
    lines = ["# ollama create NAME -f Modelfile, then ollama run NAME (any .gguf here can go after FROM)",
             f"FROM ./{smallest['file']}", *[f'PARAMETER stop "{s}"' for s in stops]]  # fmt: skip
    return "\n".join(lines) + "\n"


@command
def export_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit export RUN --to gguf [--quant f16,q8_0,q4_k_m]`: GGUF files of a run's model for
    llama.cpp and Ollama, each checked against the trained model on its held-out prompts."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit export", description=description(export_main.__doc__))
    parser.add_argument("run", help="a run's --output_dir")
    parser.add_argument("--to", required=True, choices=["gguf"], help="the format (gguf: llama.cpp, Ollama)")
    parser.add_argument("--quant", default=DEFAULT, help=f"comma-separated llama.cpp types (default {DEFAULT})")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts each file answers (default 16)")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="tokens of each answer compared")
    args = parser.parse_args(argv)
    if not Path(args.run).is_dir():
        raise ConfigError(f"{args.run}: no such folder: pass a run's --output_dir.")
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise ConfigError("--prompts and --max_new_tokens must be at least 1.")
    quants = [q.strip().lower() for q in args.quant.split(",") if q.strip()]
    records = export(args.run, quants, args.prompts, args.max_new_tokens)
    print(f"exported {len(records)} GGUF files to {Path(args.run) / 'gguf'} (and its Modelfile)")
    return 0
