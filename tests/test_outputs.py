"""Saved work is never touched by a run that was not asked to touch it (toolkit/outputs.py, training/checkpoints.py):
a run writes into its own folder only, refuses before it writes anything, and its export replaces an earlier one
whole. In-process tiny runs of llama3_fft (seconds each)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from llama3_fft import RECIPE as LLAMA3_FFT
from llama3_lora import RECIPE as LLAMA3_LORA

from toolkit import run, train

TINY = ["--tiny", "--report_to", "none", "--max_steps", "4"]


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def refused(argv: list[str], capsys, recipe: dict = LLAMA3_FFT, name: str = "llama3_fft") -> str:
    """The run's one error line (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as stop:
        run(recipe, argv, name)
    assert stop.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> dict[str, Path]:
    """Two finished runs: one that saved checkpoints (steps 2 and 4), one that saved only its model, summary and
    log (the default: no checkpoints), as a user re-running `runs/<recipe>` has."""
    root = tmp_path_factory.mktemp("finished")
    train(LLAMA3_FFT, [*TINY, "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(root / "ckpt")],
          "llama3_fft")  # fmt: skip
    train(LLAMA3_FFT, [*TINY, "--output_dir", str(root / "plain")], "llama3_fft")
    return {"ckpt": root / "ckpt", "plain": root / "plain"}


REFUSED = [  # (id, finished run copied in, flags, key words of the error line)
    ("inside-a-checkpoint", "ckpt", ["--output_dir", "{run}/checkpoint-4"], "is a checkpoint"),
    ("inside-a-checkpoint-subfolder", "ckpt", ["--output_dir", "{run}/checkpoint-4/again"], "is inside a checkpoint"),
    ("inside-another-run", "plain", ["--output_dir", "{run}/sub"], "is inside another run's folder"),
    ("resume-past-max-steps", "ckpt", ["--output_dir", "{run}", "--resume", "auto", "--max_steps", "2"],
     "is at step 4, and this run ends at step 2"),
    ("misspelt-split", "plain", ["--output_dir", "{run}", "--train_split", "trian"], "has no split 'trian'"),
    ("push-without-repo", "plain", ["--output_dir", "{run}", "--push_to_hub", "true"], "--hub_model_id"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "folder", "flags", "key"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_refused_run_leaves_saved_work_as_it_was(case, folder, flags, key, finished, tmp_path, capsys):
    """Each refusal is one line before the run writes anything: the finished run's checkpoints, model, summary,
    card and log come out as they were (the log of a re-run was deleted before a later check refused it)."""
    out = tmp_path / "run"
    shutil.copytree(finished[folder], out)
    before = listing(out)
    line = refused([*TINY, *(f.replace("{run}", str(out)) for f in flags)], capsys)
    assert key in line, line
    assert listing(out) == before


@contextlib.contextmanager
def read_only_folder(path: Path):
    """A read-only file system at `path` (tmpfs mounted ro, where this machine lets root mount), else os.access
    answering EROFS for it, as it does for a read-only mount."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                             capture_output=True).returncode == 0  # fmt: skip
    real_access = os.access
    try:
        if not mounted:
            os.access = lambda p, mode, **kw: False if Path(p) == path else real_access(p, mode, **kw)
        yield
    finally:
        os.access = real_access
        if mounted:
            subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_output_folder_is_one_line_before_training(tmp_path, capsys):
    with read_only_folder(tmp_path / "ro"):
        line = refused([*TINY, "--output_dir", str(tmp_path / "ro" / "run")], capsys)
    assert "cannot write the run's checkpoints and model" in line and "not writable" in line


def test_a_rerun_replaces_the_earlier_runs_export_and_log(finished, tmp_path, capsys):
    """A full fine-tune into the folder of a finished LoRA run (warned about first): the adapter, which
    from_pretrained would otherwise load over the new weights, and the earlier merged model are gone; the log is
    the new run's alone."""
    out = tmp_path / "run"
    train(LLAMA3_LORA, [*TINY, "--merge_lora", "true", "--output_dir", str(out)], "llama3_lora")
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged").is_dir()
    capsys.readouterr()
    train(LLAMA3_FFT, [*TINY, "--max_steps", "3", "--output_dir", str(out)], "llama3_fft")
    assert "holds an earlier run's results" in capsys.readouterr().err
    assert not any((out / name).exists() for name in ("adapter_model.safetensors", "adapter_config.json", "merged"))
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(out / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all((loaded[k] == v).all() for k, v in saved.items())
    steps = [line for line in (out / "run_log.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 3
