"""`python -m toolkit plan|check|launch|report ...`: the toolkit's commands."""

import sys

COMMANDS = {
    "plan": "toolkit.planner.cli",
    "check": "toolkit.distributed.launch_check",
    "launch": "toolkit.distributed.launcher",
    "report": "toolkit.metrics.report",
}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m toolkit {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
