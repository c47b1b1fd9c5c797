"""`python -m toolkit launch [accelerate launch options] recipes/X.py [recipe flags]`: accelerate's launcher, with
the strategy file checked first, the preemption signals passed on to the training processes, and a failed run
ending on its own message and exit code.

`accelerate launch` re-raises a failed rank as a traceback of its own (`CalledProcessError` with one process,
torch's `ChildFailedError` with several) below the toolkit's one-line error, and exits 1 whatever the rank's
exit code was, so 2 (bad input), 3 (diverged), 4 (budget spent) and 75 (preempted, try again) all look alike to
a scheduler. This calls the same launcher, accelerate's `launch_command`, with the same options and config
files, then ends with the first failed rank's exit code and nothing more (TOOLKIT_DEBUG=1: the traceback too).

Signals: torch's launcher (several processes) forwards only the signals of its `--signals_to_handle` option to
the training processes, SIGTERM but not SIGUSR1, SLURM's warning before the time limit, which then kills the
launcher instead; and it sets TORCHELASTIC_SIGNALS_TO_HANDLE from that option, so exporting that variable changes
nothing. The option's own environment variable, PET_SIGNALS_TO_HANDLE, is read when accelerate builds torch's
parser: it is set here (unless set already) to add SIGUSR1, with TORCH_ELASTIC_SHUTDOWN_TIMEOUT (how long the
processes get to finish a step and write a checkpoint before SIGKILL) at 300 s instead of torch's 30. accelerate's
one-process launcher passes no signal on at all: here its process gets them. A launcher stopped by SIGTERM or
SIGUSR1 exits 75, as its processes do: the run was preempted, `--resume auto` continues it.

Pipeline and expert parallelism: accelerate has neither axis, and its launcher drops the keys of
`parallelism_config` it does not know. The config's `parallelism_config_pp_size`, `_pp_schedule` and `_ep_size` (or
the same as flags, which accelerate's parser would refuse) are exported here as PARALLELISM_CONFIG_PP_*/_EP_SIZE,
as accelerate exports the others.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import PREEMPTED, PREEMPTED_DIR, PREEMPTION_SIGNALS, ConfigError, command, debugging, description
from ..project import is_recipe, recipe_names
from . import network

TORCH_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torch's --signals_to_handle default
SHUTDOWN_TIMEOUT_S = 300


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def handled_signals() -> str:
    """torch's default signals to forward, and every preemption signal the training processes checkpoint on."""
    names = TORCH_SIGNALS.split(",")
    return ",".join(names + [s.name for s in PREEMPTION_SIGNALS if s.name not in names])


@contextlib.contextmanager
def forwarding(signals) -> Iterator[None]:
    """These signals passed on to this process's children (accelerate's one-process launcher waits for its child
    and passes none on); torch's multi-process launcher installs its own handlers over these."""
    import psutil

    def forward(signum, frame):
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def checked_args(argv: list[str], here: bool = True):
    """The launch command line parsed by accelerate's own parser, with what every engine needs checked first: the
    strategy file, the recipe and, for a run on this machine (`here`), what the machine can run and the recipe's
    model. The toolkit's mesh flags are exported for the ranks."""
    from accelerate.commands.launch import launch_command_parser

    from .launch_check import check

    parser = launch_command_parser()
    parser.prog = "python -m toolkit launch"
    axes, argv = axis_flags(list(argv))
    args = parser.parse_args(argv)
    script = Path(args.training_script)
    recipe = script.stem if script.parent.name == "recipes" else None  # check() names the known recipes
    if recipe is None and not script.is_file():
        raise ConfigError(f"No script {script}: pass a recipe (recipes/<name>.py) or your own training script.")
    if args.config_file:
        check(args.config_file, recipe, here)  # a bad file is one line here, not a traceback from every rank
        export_axes(args.config_file, axes)
        os.environ["TOOLKIT_CONFIG_FILE"] = args.config_file  # the run's model card says how it was launched
    if here:
        check_this_machine(args)
    if recipe is not None and is_recipe(recipe) and here:
        check_recipe_model(recipe, args.training_script_args)
    elif recipe is not None and not is_recipe(recipe):
        raise ConfigError(f"No recipe '{recipe}' in recipes/. Known: {', '.join(recipe_names())}.")
    return args


@command
def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = checked_args(sys.argv[1:] if argv is None else argv)
    shape = launch_shape(args)
    network.prepare(shape["head"], shape["port"], shape["nodes"], shape["machine_rank"])
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", handled_signals())
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    saved = Path(tempfile.mkdtemp(prefix="toolkit-preempted-"))
    os.environ[PREEMPTED_DIR] = str(saved)
    try:
        try:
            with forwarding(PREEMPTION_SIGNALS):
                launch_command(args)
        finally:
            settled()
    except subprocess.CalledProcessError as failed:  # one process: the script's own exit code
        if debugging():
            raise
        return exit_code(failed.returncode)
    except ChildFailedError as failed:  # several: the first rank that failed, the others were stopped for it
        if debugging():
            raise
        return exit_code(failed.get_first_failure()[1].exitcode) or 1
    except SignalException as signalled:  # the launcher itself was signalled; the ranks got it too
        return signalled_exit(int(signalled.sigval), saved, shape["per_node"])
    finally:
        shutil.rmtree(saved, ignore_errors=True)
    return 0


def settled() -> None:
    """The processes have ended: a stop signal now changes nothing, and must not kill the launcher before it exits
    with their code. SLURM stops a failed job's other nodes with SIGTERM: with the default handler back (or torch's,
    which raises wherever the code is being reported), they ended with 143, not the crash's code."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def signalled_exit(signum: int, saved: Path, processes: int) -> int:
    """The exit code of a launcher stopped by a signal, once torch's launcher has stopped its processes: 75
    (preempted, resume) only where each of them wrote its checkpoint and said so in `saved`. Otherwise the run did
    not stop as a preemption does: on SLURM, a job step whose other node crashed is ended by SIGTERM, and 75 here
    would have the batch script requeue the crash to fail again; 1 then, so that the job ends with the crash's own
    code (srun's is its tasks' highest), or 128 + N for a signal that is no preemption."""
    if signum not in PREEMPTION_SIGNALS:
        return 128 + signum
    written = len(list(saved.glob("rank-*")))
    if written >= processes:
        return PREEMPTED
    # a note, not an error: the cause (a peer's crash, its bad input) is reported where it happened
    print(f"stopped by {signal.Signals(signum).name} before this node's processes wrote a checkpoint ({written} of "
          f"{processes}): a peer failed, or the save outlasted TORCH_ELASTIC_SHUTDOWN_TIMEOUT; exit 1, not 75",
          file=sys.stderr, flush=True)  # fmt: skip
    return 1


def launch_shape(args) -> dict:
    """The launch's machines, this one's rank, its processes, the head and its port: the command line's values
    over the config file's, as accelerate takes them (read before accelerate's launcher rewrites `args`)."""
    from .launch_check import read_yaml

    config = read_yaml(Path(args.config_file)) if args.config_file else {}

    def value(name: str, default):
        given = getattr(args, name)
        return given if given is not None else config.get(name, default)

    nodes, processes = max(1, int(value("num_machines", 1) or 1)), int(value("num_processes", 1) or 1)
    return {"nodes": nodes, "processes": processes, "per_node": max(1, processes // nodes),
            "machine_rank": int(value("machine_rank", 0) or 0), "head": value("main_process_ip", None),
            "port": int(value("main_process_port", 29500) or 29500)}  # fmt: skip


def check_this_machine(args) -> None:
    """What this machine cannot run, refused before N processes start only for each to refuse it (the ranks'
    own check stays, for `accelerate launch`): context parallelism without CUDA (models/parallel.py)."""
    import torch

    from ..models.parallel import CP_ON_CPU
    from ..settings.mesh import config_mesh
    from .launch_check import read_yaml

    section = read_yaml(Path(args.config_file)).get("parallelism_config") if args.config_file else None
    cp = max(int(args.parallelism_config_cp_size or 1), config_mesh(section).get("cp", 1))
    if cp > 1 and not torch.cuda.is_available():
        raise ConfigError(CP_ON_CPU)


def check_recipe_model(recipe: str, script_args: list[str]) -> None:
    """The recipe's own model, where the run would load it from the Hub, reachable (or cached) before N processes
    start only for each to say it is not: the check each rank makes first, made once, in seconds."""
    from ..data.sources import check_hub_model, resolve
    from ..project import load_recipe

    if any(a == "--tiny" or a.startswith(("--tiny=", "--model_name_or_path")) for a in script_args):
        return  # tiny mode or another model: the ranks check what they load
    name = load_recipe(recipe).get("model_name_or_path")
    if name:
        check_hub_model(resolve(name))


def axis_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The toolkit's mesh flags (`--parallelism_config_pp_size=N`, `--parallelism_config_pp_schedule NAME`,
    `--parallelism_config_ep_size=N`), taken out of a launch command line before accelerate's parser sees them; the
    rest of it."""
    from ..settings.mesh import LAUNCHER_KEYS

    found, rest, words = {}, [], iter(argv)
    for word in words:
        key, equals, value = word.removeprefix("--").partition("=")
        if word.startswith("--") and key in LAUNCHER_KEYS:
            found[key] = value if equals else next(words, "")
        elif not word.startswith("-") and word.endswith(".py"):  # the script: the rest are its own flags
            rest += [word, *words]
        else:
            rest.append(word)
    return found, rest


def export_axes(config_file: str, flags: dict[str, str]) -> None:
    """PARALLELISM_CONFIG_PP_SIZE, _PP_SCHEDULE and _EP_SIZE for the processes: the config's keys, `flags` over
    them."""
    import yaml

    from ..settings.mesh import LAUNCHER_KEYS

    section = (yaml.safe_load(Path(config_file).read_text()) or {}).get("parallelism_config") or {}
    for key in LAUNCHER_KEYS:
        value = flags.get(key, section.get(key))
        if value is not None:
            os.environ[key.upper()] = str(value)


@command
def mesh_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit mesh CONFIG --nodes N --gpus_per_node P [--parallelism_config_<axis>_size K ...]`: the
    accelerate launch flags that size a config's mesh for a job of N nodes x P processes (settings/mesh.py's
    job_mesh), printed on one line; slurm/launch_node.sh passes them on. A model-parallel size given here replaces
    the file's (a node with fewer GPUs than the file's sp or cp)."""
    import argparse

    import yaml

    from ..settings.mesh import job_mesh, launch_flags

    parser = argparse.ArgumentParser(prog="python -m toolkit mesh", description=description(mesh_main.__doc__))
    parser.add_argument("config_file")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus_per_node", type=int, required=True)
    args, overrides = parser.parse_known_args(argv)
    path = Path(args.config_file)  # read alone: `toolkit check` (which launch runs) says what else is wrong
    try:
        section = dict((yaml.safe_load(path.read_text()) or {}).get("parallelism_config") or {})
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(f"{path}: not a readable accelerate config ({str(error).splitlines()[0]}).") from None
    for flag in overrides:
        key, _, value = flag.removeprefix("--").partition("=")
        if not (key.startswith("parallelism_config_") and key.endswith("_size") and value.isdigit()):
            raise ConfigError(f"{flag}: pass mesh sizes as --parallelism_config_<axis>_size=N.")
        if key not in section:
            raise ConfigError(f"{flag}: {args.config_file} has no {key}: only the config's own sizes can change.")
        section[key] = int(value)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus_per_node must be at least 1.")
    print(" ".join(launch_flags(job_mesh(section, args.nodes, args.gpus_per_node))))
    return 0
