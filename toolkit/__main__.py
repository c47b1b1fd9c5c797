"""`python -m toolkit <command> ...`: the commands around a run."""

import importlib
import sys

from toolkit.startup import heavy_imports

COMMANDS = {  # name -> "module:function", imported only when run (`plan` needs no Trainer stack)
    "plan": "toolkit.planner.cli:main",  # memory, fit, time and cost, before launching
    "check": "toolkit.distributed.launch_check:main",  # a strategy file's mistakes, in a second
    "prepare": "toolkit.runner:prepare_main",  # tokenize (and pack) a recipe's data ahead of a launch
    "launch": "toolkit.clusters.launch:main",  # accelerate launch (or Ray, Kubernetes, SkyPilot), ending on its code
    "mesh": "toolkit.distributed.launcher:mesh_main",  # a config's mesh sized for a multi-node job (slurm/)
    "report": "toolkit.metrics.report:main",  # runs side by side: charts, pages, samples
    "generate": "toolkit.generate:generate_main",  # answers from a trained model
    "chat": "toolkit.generate:chat_main",  # a conversation with a trained model
    "eval": "toolkit.results.evaluation:eval_main",  # the fine-tuned model against the one it started from
    "export": "toolkit.shipping.export:export_main",  # GGUF files for llama.cpp and Ollama, checked against the run
    "serve": "toolkit.shipping.serve:serve_main",  # an OpenAI-compatible endpoint for a run's model (or its GGUF)
    "push": "toolkit.results.push:push_main",  # the export and its card to the Hugging Face Hub
    "build-ops": "toolkit.distributed.op_builds:build_main",  # DeepSpeed's CPU ops, ahead of the first launch
}


def entry(name: str):
    module, _, function = COMMANDS[name].partition(":")
    with heavy_imports():
        return getattr(importlib.import_module(module), function)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m toolkit {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return entry(sys.argv[1])(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
