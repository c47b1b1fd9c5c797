"""`python -m toolkit plan MODEL`: memory, fit, time and cost of a fine-tune under every strategy file, before
anything is launched, offline for the recipes' models.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from ..errors import ConfigError, command
from ..metrics.cost import device_spec, price_table
from ..project import recipe_name
from ..settings.tasks import TASKS
from .assembly import PLAN_ANY_GPU, build_plan
from .estimate import (
    ASSUMED_MFU,
)
from .render import render
from .workload import OPTIMIZER_STATE_BYTES, PRECISIONS, Workload


def check_flags(args) -> None:
    """Values that would plan nonsense rather than fail: each refused with its domain, before anything is read."""
    for flag in ("gpus", "nodes", "micro_batch", "seq_length", "samples", "tokens_per_sample"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} must be at least 1, got {value}.")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu is a share of the GPU's peak, above 0 and at most 1, got {args.mfu:g}: 0.4, say.")
    if args.epochs is not None and args.epochs <= 0:
        raise ConfigError(f"--epochs must be positive, got {args.epochs:g}.")
    if args.overhead < 1:
        raise ConfigError(f"--overhead multiplies the cost and is at least 1, got {args.overhead:g}: 1.3, say.")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom is the share of device memory kept free, from 0 to below 1, got "
                          f"{args.headroom:g}: 0.1, say.")  # fmt: skip
    if args.cuda_context_gib < 0:
        raise ConfigError(f"--cuda_context_gib cannot be negative, got {args.cuda_context_gib:g}.")
    spec = device_spec(args.gpu, PLAN_ANY_GPU)
    if not spec.get("memory_gb") or not spec.get("peak_tflops"):
        gpus = [name for name, d in price_table()["devices"].items() if d.get("memory_gb") and d.get("peak_tflops")]
        raise ConfigError(f"--gpu {args.gpu} has no device memory or datasheet peak to plan with (it is priced for "
                          f"runs only): pass one of {', '.join(gpus)}.")  # fmt: skip


def plan_parser():
    """`toolkit plan`'s options (also read by `toolkit launch --on skypilot`, which plans before it writes)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit plan", description="Memory, fit, time and cost of a "
                                     "fine-tune, before launching it.")  # fmt: skip
    parser.add_argument("model", help="a recipe (llama3_fft, or its file recipes/llama3_fft.py), a Hub id with a "
                        "stored config, or a local folder")  # fmt: skip
    parser.add_argument("--gpu", default="A100-80GB", help="GPU type from toolkit/metrics/hardware.yaml")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--task", choices=sorted(TASKS), help="default: the recipe's, or inferred from the config")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the recipe's")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="adamw")
    parser.add_argument("--micro_batch", type=int, help="per-device batch; default: the recipe's")
    parser.add_argument("--seq_length", type=int, help="default: the recipe's max_seq_length")
    parser.add_argument("--activation_checkpointing", type=lambda v: v.lower() in ("1", "true", "yes"))
    parser.add_argument(
        "--fused_loss",
        type=lambda v: v.lower() in ("1", "true", "yes"),
        help="sft: score the loss with TRL's fused head, no full logits (default on GPUs)",
    )
    parser.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free")
    parser.add_argument("--cuda_context_gib", type=float, default=Workload.cuda_context_gib)
    parser.add_argument("--samples", type=int, help="training samples (default: the recipe's split, when known)")
    parser.add_argument("--epochs", type=float, help="default: the recipe's num_train_epochs")
    parser.add_argument("--tokens_per_sample", type=int, help="default: measured on the recipe's data where it "
                        "can be read (toolkit prepare makes it exact), else the sequence length")  # fmt: skip
    parser.add_argument(
        "--images_per_sample", type=float, default=1.0, help="an image-text run's images per training row (default 1)"
    )
    parser.add_argument("--mfu", type=float, help=f"override the assumed MFU {ASSUMED_MFU}")
    parser.add_argument("--overhead", type=float, default=1.3, help="cost factor for failed runs, tuning, debugging")
    parser.add_argument("--choose", action="store_true", help="pick the cheapest fitting GPU type, count and config "
                        "(planner/choose.py), within --budget_usd and --deadline_hours")  # fmt: skip
    parser.add_argument("--budget_usd", type=float, help="--choose: the most the run may cost on-demand")
    parser.add_argument("--deadline_hours", type=float, help="--choose: the longest the run may take, wall clock")
    parser.add_argument("--gpu_types", help="--choose: comma-separated types to try (default: every priced one)")
    parser.add_argument("--json", action="store_true")
    return parser


@command
def main(argv: list[str] | None = None) -> int:
    args = plan_parser().parse_args(argv)
    args.model = recipe_name(args.model)  # recipes/llama3_fft.py, as a launch names it
    check_flags(args)
    if args.choose:
        from .choose import choose, render_choice

        with stdout_to_stderr():
            choice = choose(args)
        print(json.dumps(choice, indent=2) if args.json else render_choice(choice, args.model))
        return 0
    with stdout_to_stderr():  # what the libraries print on the way (DeepSpeed's logger among them) is not the plan
        plan = build_plan(args)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0


@contextlib.contextmanager
def stdout_to_stderr():
    """Standard output goes to standard error for the block, at the descriptor: a logging handler that holds
    sys.stdout from before (DeepSpeed's, made at import) writes there too, so `plan --json` prints JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
