"""`python -m toolkit generate RUN --prompt ...` and `python -m toolkit chat RUN`: talk to what a run trained.

RUN is a run's output folder, its `merged/` folder (`--merge_lora true`), or one of its checkpoints: a full model
(config.json and weights), or a LoRA adapter (adapter_config.json) loaded on the base model its config names.
The chat template is the one saved with the run's tokenizer, the one the run trained with. Answers stream as
they are generated; `--temperature 0` (the default) is greedy, so the same prompt gives the same answer. An
image-text run (task vlm_sft) answers with its processor, `--image PATH` in the first user turn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import ConfigError, command


def refuse_classifier(folder: Path, architectures: list[str] | None) -> None:
    """A model that labels text (a classification head) cannot answer: one line, before it loads."""
    heads = " ".join(architectures or [])
    if "ForSequenceClassification" in heads or "ForTokenClassification" in heads:
        raise ConfigError(f"{folder} is a classification model ({heads}): it labels text, it does not write it.")


def load(folder: str | Path, dtype: str = "auto"):
    """(model, tokenizer) of a run's output: a full causal LM, or a LoRA adapter on its base. A folder that is not
    whole (no weights, a config that is not JSON, no tokenizer) is one error line naming what is missing."""
    folder = Path(folder)
    try:
        return load_model_and_tokenizer(folder, dtype)
    except (OSError, ValueError, KeyError) as error:  # transformers' and peft's own errors for a damaged folder
        if isinstance(error, ConfigError):
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{folder} cannot be loaded ({reason}): pass a run's --output_dir, its merged/ folder or "
                          "a complete checkpoint-N folder (weights, config.json and the tokenizer's files, as the "
                          "run saved them).") from None  # fmt: skip


def load_model_and_tokenizer(folder: Path, dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    adapter = folder / "adapter_config.json"
    if not adapter.is_file() and not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} holds no model (no config.json, no adapter_config.json): pass a run's "
                          "--output_dir, its merged/ folder, or a checkpoint-N folder.")  # fmt: skip
    from .settings.parser import computes_bf16

    # auto: the checkpoint's own dtype, or fp32 on a CPU that would emulate its bf16 (settings/parser.py)
    torch_dtype = ("auto" if computes_bf16() else torch.float32) if dtype == "auto" else getattr(torch, dtype)
    if adapter.is_file():
        base = json.loads(adapter.read_text())["base_model_name_or_path"]
        if base.startswith(("/", ".")) and not Path(base).is_dir():
            raise ConfigError(f"The adapter in {folder} was trained on {base}, which is no longer there: restore "
                              "that folder, or use the merged model (--merge_lora true writes "
                              "OUTPUT/merged).")  # fmt: skip
        config = AutoConfig.from_pretrained(base)
    else:
        config = AutoConfig.from_pretrained(folder)
    refuse_classifier(folder, config.architectures)
    from .models.lora import adapted_model
    from .settings.tasks import architecture

    processed = any((folder / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))
    if processed and architecture(config, "vlm_sft") is not None:  # an image-text run: its model and processor
        from .models.processors import load_processor

        model = adapted_model(folder, "vlm_sft", dtype=torch_dtype) if adapter.is_file() else \
            architecture(config, "vlm_sft").from_pretrained(folder, dtype=torch_dtype)  # fmt: skip
        return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), load_processor(str(folder))
    if adapter.is_file():
        model = adapted_model(folder, "sft", dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    from .models.loading import TOKENIZER_FILES

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):  # transformers would build an empty one
        raise ConfigError(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): pass a run's "
                          "--output_dir or a checkpoint-N folder, which the run saves with its tokenizer.")  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        raise ConfigError(f"The tokenizer in {folder} has no chat template: this run was not a chat fine-tune.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval(), tokenizer


def answer(model, tokenizer, messages: list[dict[str, str]], args: argparse.Namespace, stream: bool = True) -> str:
    """The model's next assistant message after `messages`, printed token by token as it comes when `stream`.
    `tokenizer` is an image-text run's processor where it has one: --image then goes in the first user turn."""
    import torch
    from transformers import TextStreamer

    from .data.conversations import stop_token_ids

    if getattr(tokenizer, "image_processor", None) is not None:
        from .data.vision import prompt_batch

        batch, stops = prompt_batch(tokenizer, messages, getattr(args, "image", None),
                                    getattr(args, "image_max_pixels", None))  # fmt: skip
        inputs, tokenizer = batch.to(model.device), tokenizer.tokenizer
    else:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True).to(model.device)  # fmt: skip
        stops = stop_token_ids(tokenizer)
    sampling = {"do_sample": False}
    if args.temperature > 0:
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, repetition_penalty=args.repetition_penalty,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, streamer=streamer,
                             eos_token_id=stops, **sampling)  # fmt: skip
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("run", help="a run's output folder, its merged/ folder, or a checkpoint")
    p.add_argument("--system", help="a system message before the conversation")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the same answer every time)")
    p.add_argument("--top_p", type=float, default=0.9)
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="for sampling (--temperature > 0)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--image", help="an image-text run: a picture (a path) for the first user turn to ask about")
    return p


def start(args: argparse.Namespace):
    from transformers import set_seed

    for name in ("max_new_tokens", "top_k"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("--temperature must be 0 (greedy) or more, and --top_p in (0, 1].")
    if args.image is not None and not Path(args.image).is_file():
        raise ConfigError(f"--image {args.image} is not a file: pass a picture's path.")
    set_seed(args.seed)
    model, tokenizer = load(args.run, args.dtype)
    if args.image is not None and getattr(tokenizer, "image_processor", None) is None:
        raise ConfigError(f"--image: {args.run} is a text model; a picture needs an image-text run (task vlm_sft).")
    args.image_max_pixels = trained_max_pixels(args.run)
    return model, tokenizer


def trained_max_pixels(run: str | Path) -> int | None:
    """The --image_max_pixels a run trained with (its run_summary.json, beside the model or a folder up: a
    checkpoint, merged/), so that a picture is scaled as its training pictures were; None where it set none."""
    from .outputs import SUMMARY
    from .results.record import RunRecord

    for folder in (Path(run), Path(run).parent):
        if (folder / SUMMARY).is_file():
            try:
                return RunRecord.read(folder).settings.get("image_max_pixels")
            except (ConfigError, KeyError, AttributeError):
                return None  # a summary cut short: the picture as it is
    return None


def opening(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"role": "system", "content": args.system}] if args.system else []


@command
def generate_main(argv: list[str] | None = None) -> int:
    p = parser("python -m toolkit generate", "Answer prompts with a trained model.")
    p.add_argument("--prompt", action="append", required=True, help="a user message; repeat for several")
    args = p.parse_args(argv)
    model, tokenizer = start(args)
    for prompt in args.prompt:
        print(f"> {prompt}", flush=True)
        answer(model, tokenizer, [*opening(args), {"role": "user", "content": prompt}], args)
        print(flush=True)
    return 0


@command
def chat_main(argv: list[str] | None = None) -> int:
    args = parser("python -m toolkit chat", "Talk with a trained model (/reset starts over, /exit or Ctrl-D ends)."
                  ).parse_args(argv)  # fmt: skip
    model, tokenizer = start(args)
    messages = opening(args)
    print(f"chatting with {args.run} (/reset starts over, /exit or Ctrl-D ends)", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            break
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = opening(args)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        print("model> ", end="", flush=True)
        messages.append({"role": "assistant", "content": answer(model, tokenizer, messages, args)})
    print(file=sys.stderr)
    return 0
