"""`make gpu-check` (bench/gpu_check.py) on a CPU: its dry mode lists, for any number of GPUs, the launches it would
make, each one the toolkit's own checks accept; and one of its rows runs for real (ddp over gloo: train,
checkpoint, resume, reload, generate), so the command a GPU session relies on cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from safetensors.torch import load_file, save_file

from toolkit.distributed.launch_check import check_mesh
from toolkit.project import load_recipe, recipe_names, strategy_files

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_dry_run_lists_every_shipped_config(gpus, capsys):
    assert gpu_check.main(["--dry_run", "--gpus", str(gpus)]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines()[:-1]}
    assert listed == {p.stem for p in strategy_files()}
    rows = gpu_check.plan_rows(gpus, fp8=True)
    launched = {r.config for r in rows if not r.skip}
    if gpus == 8:  # every config, mesh configs included, launches somewhere
        assert launched == {p.stem for p in strategy_files()}
    run = [r for r in rows if not r.skip]
    assert f"{len(run)} rows planned for {gpus} GPU(s): {len(run) + sum(r.resume for r in run)} launches" in out
    assert all(r.resume for r in rows if r.recipe == "llama3_fft" and not r.skip)  # tp's too: whole checkpoints


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_each_planned_launch_passes_the_toolkits_mesh_checks(gpus):
    """The mesh flags and process count of every planned row, applied to its config, pass `toolkit check`'s mesh
    checks with its recipe: gpu-check spends no GPU time on a launch the toolkit would refuse."""
    for row in gpu_check.plan_rows(gpus, fp8=True):
        if row.skip:
            continue
        path = ROOT / "accelerate_configs" / f"{row.config}.yaml"
        config = yaml.safe_load(path.read_text())
        config["num_processes"] = row.processes
        for flag in row.launch_flags:
            key, value = flag.removeprefix("--").split("=")
            config.setdefault("parallelism_config", {})[key] = int(value)
        # the recipe's own model where its real heads are the tiny one's concern too (Llama 3: 32 and 8 heads
        # split as its 4 and 1 do); SmolLM2's real 9 heads are not its tiny 4
        own_model = "--model_name_or_path" not in row.recipe_flags
        check_mesh(config, path, row.recipe if row.recipe.startswith("llama3") and own_model else None)


def test_qlora_and_fp8_rows_follow_the_toolkits_refusals():
    rows = {(r.config, r.recipe): r for r in gpu_check.plan_rows(1, fp8=False)}
    assert not rows[("single_gpu", "llama3_qlora")].skip
    assert "QLoRA trains under single_gpu.yaml or ddp.yaml" in rows[("fsdp2", "llama3_qlora")].skip
    assert "FP8 tensor cores" in rows[("fsdp2_fp8", "llama3_fft")].skip


def test_a_task_recipe_named_runs_under_each_config_named(capsys):
    """The GRPO, image-text and MoE LoRA recipes run under their own configs by default; named in --recipes they
    run under each config named (`--configs zero2 --recipes qwen3_grpo` planned nothing and launched nothing, with
    exit 0, on an H200). A pair that plans no row at all is one error line."""
    default = {(r.config, r.recipe) for r in gpu_check.plan_rows(1, fp8=False)}
    named = {(r.config, r.recipe) for r in gpu_check.plan_rows(1, fp8=False, named=("qwen3_grpo",))}
    assert ("fsdp2", "qwen3_grpo") in default and ("zero2", "qwen3_grpo") not in default
    assert named - default == {(c, "qwen3_grpo") for c, _ in default if c not in ("fsdp2", "fsdp2_ep")}
    assert gpu_check.main(["--dry_run", "--gpus", "1", "--configs", "zero2,zero3", "--recipes", "qwen3_grpo"]) == 0
    out = capsys.readouterr().out
    assert "zero2                qwen3_grpo" in out and "2 rows planned for 1 GPU(s)" in out
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry_run", "--gpus", "2", "--configs", "ddp", "--recipes", "qwen3_moe_fft"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --configs ddp x --recipes qwen3_moe_fft: no row"), err


def setting(args, key: str):
    return next(getattr(part, key) for part in (args.model, args.data, args.run, args.training) if hasattr(part, key))


def test_rows_train_at_the_recipes_own_flags(capsys):
    """Tiny mode shrinks the model and the run, and also sets training flags of its own (1 accumulation step, no
    activation checkpointing, no LoRA dropout, its attention choice); a row sets them back to the recipe's. With
    tiny mode's 1 accumulation step the pipeline configs ran 1 micro-batch on 2 stages, and gpu-check never met the
    recipes' 4. Each planned row's flags, over tiny mode's own layer, give the recipe's own values (its
    evaluation as it trains too), and the toolkit's parser accepts them."""
    from toolkit.models.tiny import TINY_TRAINING, tiny_layer
    from toolkit.settings.parser import parse

    own_keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "activation_checkpointing",
                "lora_dropout", "attn_implementation", "eval_fraction", "generation_samples")  # fmt: skip

    def tiny_training(values):  # the tiny layer's training settings, without building its model and data
        return dict(TINY_TRAINING)

    own = {
        name: parse(load_recipe(name), name, [])
        for name in (*gpu_check.RECIPES, *gpu_check.EXPERT_RECIPES, *gpu_check.TASK_RECIPES)
    }
    assert setting(parse(load_recipe("llama3_fft"), "llama3_fft", ["--tiny"], tiny_training),
                   "gradient_accumulation_steps") == 1  # fmt: skip
    rows = [r for r in gpu_check.plan_rows(8, fp8=True) if not r.skip]
    assert {r.config for r in rows} >= {"pp", "pp_ddp", "tp", "zero3", "fsdp2", "fsdp2_ep"}
    for row in rows:
        flags = [f for f in row.recipe_flags if f not in ("--model_name_or_path", "{two_kv_heads}")]
        tiny = parse(load_recipe(row.recipe), row.recipe, ["--tiny", *flags], tiny_layer)
        for key in own_keys:
            if key != "lora_dropout" or setting(own[row.recipe], "use_lora"):
                assert setting(tiny, key) == setting(own[row.recipe], key), (row.config, row.recipe, key)
        if row.recipe.startswith("llama3"):  # 4 micro-batches through 2 pipeline stages, recomputed activations
            assert setting(tiny, "gradient_accumulation_steps") == 4 and setting(tiny, "activation_checkpointing")
    capsys.readouterr()  # what building the tiny models printed
    assert gpu_check.main(["--dry_run", "--gpus", "2", "--configs", "pp", "--recipes", "llama3_lora"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert "--gradient_accumulation_steps 4" in line and "--lora_dropout 0.05" in line


def test_without_a_gpu_the_sweep_is_one_error_line(monkeypatch, capsys, tmp_path):
    """On a machine without GPUs `make gpu-check` is one `error:` line (before: argparse's usage and its error;
    with --gpus N, the rows launched and the table's device name ended in torch's AssertionError); so is asking
    for more GPUs than there are."""
    monkeypatch.setattr(gpu_check, "devices", lambda: (0, ""), raising=False)
    monkeypatch.setattr(gpu_check, "run_row", lambda row, output: None)  # launch nothing, whatever happens
    narrow = ["--configs", "ddp", "--recipes", "llama3_fft", "--no_bench", "--output", str(tmp_path)]
    for argv in ([], ["--gpus", "2", *narrow]):
        with pytest.raises(SystemExit) as stop:
            gpu_check.main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "--dry_run --gpus N" in err[0], err
    monkeypatch.setattr(gpu_check, "devices", lambda: (2, "Test GPU"))
    with pytest.raises(SystemExit):
        gpu_check.main(["--gpus", "4", *narrow])
    assert capsys.readouterr().err.startswith("error: --gpus 4, and this machine has 2 GPUs")


@pytest.mark.parametrize(
    ("flag", "names", "wrong"),
    [("--configs", "ddp,ddpp", "ddpp"), ("--recipes", "llama3_fft,llama3_fftt", "llama3_fftt"),
     ("--recipes", "bert", "bert")],
)  # fmt: skip
def test_unknown_names_are_one_error_line(flag, names, wrong, capsys):
    """A misspelt config or recipe name planned 0 launches and passed (exit 0): now one line with the names gpu-check
    knows (the files in accelerate_configs/, its decoder recipes in recipes/), exit 2."""
    assert set(gpu_check.RECIPES) <= set(recipe_names())
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry_run", "--gpus", "2", flag, names])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"'{wrong}'" in err[0], err
    known = [p.stem for p in strategy_files()] if flag == "--configs" else gpu_check.RECIPES
    assert all(name in err[0] for name in known)


def test_a_row_that_raises_is_a_failed_row_and_the_table_still_prints(monkeypatch, capsys, tmp_path):
    """Whatever a row raises is that row's failure with its error, and the sweep goes on; interrupted (Ctrl-C), it
    still prints its table and rows.jsonl holds every row that ran. Before, only a RuntimeError was a failed row:
    anything else ended the sweep without a table."""
    monkeypatch.setattr(gpu_check, "devices", lambda: (2, "Test GPU"), raising=False)

    def launch(row, out, extra):
        if row.config == "ddp":
            raise ValueError("injected")
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check, "launch", launch)
    code = gpu_check.main(["--gpus", "2", "--configs", "ddp,zero2,zero3", "--recipes", "llama3_fft", "--no_bench",
                           "--output", str(tmp_path)])  # fmt: skip
    assert code == 130
    out = capsys.readouterr().out
    assert "| ddp | llama3_fft | 2 | failed: train: ValueError: injected |" in out
    assert "| zero2 | llama3_fft | 2 | interrupted: train |" in out
    assert "| zero3 | llama3_fft | 2 | not run: the sweep was interrupted |" in out
    lines = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["config"], r["status"]) for r in lines] == [("ddp", "failed: train"), ("zero2", "interrupted: train")]


def test_a_launch_the_interrupt_ended_is_the_sweeps_interruption(monkeypatch, capsys, tmp_path):
    """A device call's `timeout -s INT` signals the sweep's launches too: one that ended in a KeyboardInterrupt is
    the sweep interrupted, not a failed row named after a warning printed at its exit (seen on an H200:
    "failed: generate", error "warnings.warn(")."""
    monkeypatch.setattr(gpu_check, "devices", lambda: (1, "Test GPU"), raising=False)
    stderr = "Traceback (most recent call last):\nKeyboardInterrupt\n/x/y.py:3: UserWarning: z\n  warnings.warn(\n"
    monkeypatch.setattr(gpu_check, "launch", lambda row, out, extra: subprocess.CompletedProcess([], 1, "", stderr))
    code = gpu_check.main(["--gpus", "1", "--configs", "ddp", "--recipes", "llama3_fft", "--no_bench", "--jobs",
                           "1", "--output", str(tmp_path)])  # fmt: skip
    assert code == 130
    assert "| ddp | llama3_fft | 1 | interrupted: train |" in capsys.readouterr().out
    with pytest.raises(gpu_check.RowFailure, match="^error: bad flag$"):  # any other exit: the row's own error line
        gpu_check.checked(subprocess.CompletedProcess([], 1, "", "warnings.warn(\nerror: bad flag\n"))


@pytest.mark.launch
def test_a_row_runs_for_real(tmp_path):
    """One row as a GPU runs it (one process, as on a 1-GPU machine; the strategies' own tests launch 2): trained
    with a checkpoint, resumed from a copy of it to the same losses, and the export answering a prompt through
    `toolkit generate`."""
    row = gpu_check.Row("single_gpu", "llama3_fft", 1, resume=True)
    gpu_check.run_row(row, tmp_path)
    assert row.status == "ok", row.error
    assert len(row.losses) == gpu_check.STEPS and row.resumed_losses == row.losses[gpu_check.SAVE_AT :]
    assert row.answer
    table = gpu_check.table([row])
    assert "| single_gpu | llama3_fft | 1 | ok |" in table and "same losses" in table
    # the model `toolkit generate` loads from the export holds the weights of the run's last checkpoint, each tensor
    run = tmp_path / "single_gpu" / "llama3_fft" / "run"
    saved = load_file(run / f"checkpoint-{gpu_check.STEPS}" / "model.safetensors")
    assert row.reload == f"same weights ({len(saved)} tensors)" and f"same weights ({len(saved)} tensors)" in table
    exported = load_file(run / "model.safetensors")  # the comparison is not vacuous: a changed tensor is told
    name = sorted(exported)[-1]
    save_file({**exported, name: exported[name] + 1e-2}, run / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(gpu_check.RowFailure, match=name):
        gpu_check.check_reload(run, run / f"checkpoint-{gpu_check.STEPS}")


def test_jobs_run_rows_side_by_side_on_one_gpu(monkeypatch, capsys, tmp_path):
    """On one GPU three rows' launches run at once (the default --jobs), each row recorded once, the table printed;
    --jobs on more GPUs (multi-process rows) is one error line."""
    import threading
    import time

    monkeypatch.setattr(gpu_check, "devices", lambda: (1, "Test GPU"), raising=False)
    lock, now, most = threading.Lock(), [0], [0]

    def launch(row, out, extra):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.3)
        with lock:
            now[0] -= 1
        raise ValueError("injected")

    monkeypatch.setattr(gpu_check, "launch", launch)
    argv = ["--configs", "ddp,fsdp2,zero2,zero3", "--recipes", "llama3_fft", "--no_bench", "--output", str(tmp_path)]
    assert gpu_check.main(argv) == 1
    assert most[0] == 3
    lines = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert sorted(r["config"] for r in lines) == ["ddp", "fsdp2", "zero2", "zero3"]
    assert all(r["status"] == "failed: train" for r in lines)
    assert "| zero3 | llama3_fft | 1 | failed: train: ValueError: injected |" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "devices", lambda: (2, "Test GPU"), raising=False)
    with pytest.raises(SystemExit):
        gpu_check.main(["--jobs", "3", *argv])
    assert capsys.readouterr().err.startswith("error: --jobs 3: rows run side by side only on one GPU")
