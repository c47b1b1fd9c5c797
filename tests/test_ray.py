"""`python -m toolkit launch --on ray`: each rank a Ray Train worker, on a local Ray cluster of 2 CPU workers, for
real. A worker killed mid-run is restarted by Ray, and the run ends as `accelerate launch`'s uninterrupted run with
2 processes: the same losses and weights, bit for bit. (A running cluster joined with --address was checked the
same way by hand, `ray start --head` then RAY_AUTH_MODE=token; the launch costs 30-90 s on 2 cores.)"""

from __future__ import annotations

import sys

import pytest
from conftest import BIN, ROOT, check, launch, rank_reports, run_cmd

from toolkit.clusters.launch import main

FLAGS = ["--tiny", "--max_steps", "6", "--save_steps", "2", "--per_device_train_batch_size", "8",
         "--record_rank_reports", "true", "--report_to", "none"]  # fmt: skip
CONFIG = str(ROOT / "accelerate_configs" / "ddp.yaml")
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def on_ray(*words: str) -> list[str]:
    return [str(BIN / "python"), "-m", "toolkit", "launch", "--on", "ray", "--config_file", CONFIG, *words]


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    """The reference: the same flags under `accelerate launch --num_processes 2`."""
    out = tmp_path_factory.mktemp("accelerate") / "run"
    check(launch("ddp", "bert", *FLAGS, "--output_dir", str(out), cwd=out.parent))
    return rank_reports(out)


KILLER = """
import os, signal, sys
from pathlib import Path
from toolkit.training import stopping, trainer

class Killed(stopping.SafeStop):
    def on_step_end(self, args, state, control, **kwargs):
        marker = Path({marker!r})
        if state.global_step == 3 and os.environ["RANK"] == "1" and not marker.exists():
            marker.touch()  # the first attempt only
            os.kill(os.getpid(), signal.SIGKILL)
        return super().on_step_end(args, state, control, **kwargs)

trainer.SafeStop = Killed
sys.path.insert(0, {recipes!r})
from bert import RECIPE
from toolkit import run
run(RECIPE, sys.argv[1:], name="bert")
"""


@pytest.mark.launch
def test_killed_worker_is_restarted_and_resumes_as_accelerate_launch(accelerate_run, tmp_path):
    """Two workers on a local cluster started for the run (no --address), one gloo group, accelerate's DDP. Rank 1
    is killed (SIGKILL) after step 3 of 6, checkpoint-2 on disk: Ray's FailureConfig restarts the worker group,
    the recipe's `--resume auto` continues from checkpoint-2, and the run ends as the uninterrupted
    `accelerate launch --num_processes 2` run, bit for bit: the losses (history restored, then the same steps),
    learning rates, each rank's rows after the resume and the weights."""
    script = tmp_path / "killed.py"
    script.write_text(KILLER.format(marker=str(tmp_path / "killed"), recipes=str(ROOT / "recipes")))
    out = tmp_path / "run"
    cmd = on_ray("--num_workers", "2", "--max_failures", "1", str(script), *FLAGS, "--output_dir", str(out))
    result = check(run_cmd(cmd, cwd=tmp_path, env=RAY_ENV, timeout=400))
    assert "strategy      MULTI_CPU, 2 process(es) on 1 machine(s), cpu, backend gloo" in result.stdout
    assert "resume auto: no complete checkpoint" in result.stdout  # the first attempt: restartable from the start
    assert (tmp_path / "killed").exists()  # the kill happened
    assert f"resume auto: continuing from {out / 'checkpoint-2'}" in result.stdout
    reports = rank_reports(out)
    assert [r["process_index"] for r in reports] == [0, 1]
    for resumed, full in zip(reports, accelerate_run, strict=True):
        assert resumed["losses"] == full["losses"]
        assert resumed["learning_rates"] == full["learning_rates"]
        assert resumed["rows"] == full["rows"][-len(resumed["rows"]) :]
        assert resumed["weights_sha256"] == full["weights_sha256"]


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--num_workers", "0"], "--num_workers 0: pass 1 or more workers."),
        (["--num_workers", "2", "--num_processes", "2"], "--num_workers and --num_processes name the same count"),
        (["--address", "127.0.0.1:1"], "--address 127.0.0.1:1: no Ray cluster answers there"),
        (["--address", "nowhere"], "--address nowhere: pass HOST:PORT"),
        (["--image", "x"], "--image is not an option of --on ray (it is --on kubernetes's)"),
    ],
)
def test_bad_ray_launches_are_one_line(words, message, capsys, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CONFIG_FILE", "")  # launch sets it for the ranks
    with pytest.raises(SystemExit) as stop:
        main(["--on", "ray", "--config_file", CONFIG, *words, str(ROOT / "recipes" / "bert.py"), "--tiny"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err


def test_ray_missing_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CONFIG_FILE", "")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: `import ray` raises ImportError
    with pytest.raises(SystemExit):
        main(["--on", "ray", "--config_file", CONFIG, str(ROOT / "recipes" / "bert.py"), "--tiny"])
    assert capsys.readouterr().err.startswith("error: --on ray needs Ray Train: pip install 'ray[train]'")


@pytest.mark.parametrize(("code", "restarts"), [(0, False), (2, False), (3, False), (4, False), (75, True), (1, True)])
def test_a_worker_raises_only_for_what_a_restart_can_mend(code, restarts, tmp_path, monkeypatch):
    """A worker whose recipe ends on bad input (2), divergence (3) or a spent budget (4) returns, so Ray does not
    restart the group (any exception from a worker restarts it); a preempted (75) or crashed one raises. Either
    way the exit code reaches the board the launch ends on."""
    import types

    from toolkit.clusters import ray_train

    script = tmp_path / "ends.py"
    script.write_text(f"import sys\nsys.exit({code})\n")
    noted = {}
    board = types.SimpleNamespace(note=types.SimpleNamespace(remote=lambda rank, c: noted.update({rank: c})))
    context = types.SimpleNamespace(get_world_rank=lambda: 1)
    monkeypatch.setattr("ray.train.get_context", lambda: context)
    monkeypatch.setattr("ray.get", lambda value: value)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.chdir(tmp_path)  # the worker moves to the launch's directory: restored after
    config = {"env": {}, "cwd": str(tmp_path), "script": str(script), "argv": [], "board": board}
    if restarts:
        with pytest.raises(RuntimeError, match=f"rank 1 exited with code {code}"):
            ray_train.run_worker(config)
    else:
        ray_train.run_worker(config)
    assert noted == {1: code}
    codes = ray_train.ExitCodes()
    codes.note(1, code)
    codes.note(0, 0)
    assert codes.outcome() == code  # rank 0 ended well: the first failed rank's code
