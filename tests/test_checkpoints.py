"""Checkpoints are complete or absent, `--resume auto` takes the newest complete one, and a run never trains into
a folder holding checkpoints it would mix with or rotate away."""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys

import pytest
import torch
from bert import RECIPE as BERT
from conftest import ROOT, preempt_at, run_cmd
from llama3_fft import RECIPE as LLAMA

from toolkit import run, train
from toolkit.outputs import OWNER, STAGING
from toolkit.training.trainer import RecipeTrainer

EVERY_2 = ["--tiny", "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none"]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def listing(folder) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")}


def test_checkpoints_are_published_whole_and_rotated_by_step(tmp_path):
    out = tmp_path / "run"
    train(BERT, [*EVERY_2, "--save_total_limit", "2", "--output_dir", str(out)], "bert")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert not any((out / STAGING).iterdir())  # nothing left half-written
    for checkpoint in out.glob("checkpoint-*"):
        assert json.loads((checkpoint / OWNER).read_text())["recipe"] == "bert"
        assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "optimizer.pt").is_file()


def test_a_save_interval_alone_saves(tmp_path, capsys):
    """--save_steps without --save_strategy (whose toolkit default is no) saves every N steps, and says so: it had
    saved nothing."""
    out = tmp_path / "run"
    train(BERT, ["--tiny", "--max_steps", "4", "--save_steps", "2", "--report_to", "none", "--output_dir", str(out)],
          "bert")  # fmt: skip
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert "the run saves a checkpoint every 2 steps (save_strategy steps" in capsys.readouterr().err


def test_killed_mid_save_resumes_from_the_last_complete_checkpoint(tmp_path, capsys):
    """kill -9 while checkpoint-4 is being written (weights on disk, optimizer not): --resume auto ignores the
    half-written folder, continues from checkpoint-2, and ends with the uninterrupted run's weights."""
    reference = train(BERT, [*EVERY_2, "--output_dir", str(tmp_path / "reference")], "bert").trainer

    out = tmp_path / "run"
    script = tmp_path / "killed_mid_save.py"  # the recipe, with a SIGKILL of itself in the middle of the save
    script.write_text(f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT / "recipes")!r})
from toolkit.training.trainer import RecipeTrainer
save = RecipeTrainer._save_optimizer_and_scheduler
def killed(self, output_dir):
    if self.state.global_step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    save(self, output_dir)
RecipeTrainer._save_optimizer_and_scheduler = killed
from bert import RECIPE
from toolkit import run
run(RECIPE, sys.argv[1:], name="bert")
""")
    result = run_cmd([sys.executable, str(script), *EVERY_2, "--output_dir", str(out)], cwd=tmp_path)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    assert (out / STAGING / "checkpoint-4" / "model.safetensors").is_file()  # the partial one, set aside

    resumed = train(BERT, [*EVERY_2, "--resume", "auto", "--output_dir", str(out)], "bert").trainer
    assert f"resume auto: continuing from {out / 'checkpoint-2'}" in capsys.readouterr().out
    assert resumed.state.global_step == 6
    expected = weights(reference)
    assert all(torch.equal(expected[k], v) for k, v in weights(resumed).items())  # bit-identical on CPU


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path, capsys):
    train(BERT, ["--tiny", "--max_steps", "2", "--report_to", "none", "--resume", "auto", "--output_dir",
                 str(tmp_path / "run")], "bert")  # fmt: skip
    assert "resume auto: no complete checkpoint in" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        (LLAMA, [], "holds checkpoints of another run (recipe bert"),  # another recipe's folder
        (BERT, [], "already holds checkpoints of this recipe (newest: checkpoint-6)"),  # not resuming
        (BERT, ["--resume", "nowhere"], "Cannot resume from 'nowhere': no such folder"),
        (BERT, ["--resume", "auto", "--resume_from_checkpoint", "x"], "Both resume and resume_from_checkpoint"),
        # a job file resubmitted with another experiment (the cluster writers all add --resume auto)
        (
            BERT,
            ["--resume", "auto", "--learning_rate", "1e-3", "--seed", "7"],
            "-> 0.001, seed 42 -> 7): continuing it would mix two experiments",
        ),
    ],
    ids=["other-recipe", "not-resuming", "bad-path", "both", "other-experiment"],
)
def test_an_output_folder_with_checkpoints_is_never_overwritten(tmp_path, capsys, recipe, flags, message):
    out = tmp_path / "run"
    train(BERT, [*EVERY_2, "--output_dir", str(out)], "bert")
    before = listing(out)
    name = "bert" if recipe is BERT else "llama3_fft"
    with pytest.raises(SystemExit) as exit_info:
        run(recipe, [*EVERY_2, *flags, "--output_dir", str(out)], name)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert listing(out) == before  # nothing trained, written or rotated


def test_a_checkpoint_named_continues_with_new_settings_on_purpose(tmp_path, capsys):
    """--resume PATH is a choice (a lower learning rate after a spike, say): it continues where `auto` refuses, and
    the new checkpoints record the new settings, which a later `auto` with them continues."""
    out = tmp_path / "run"
    train(BERT, [*EVERY_2, "--max_steps", "2", "--output_dir", str(out)], "bert")
    lower = [*EVERY_2, "--learning_rate", "1e-6", "--output_dir", str(out)]
    resumed = train(BERT, [*lower, "--max_steps", "4", "--resume", str(out / "checkpoint-2")], "bert").trainer
    assert resumed.state.global_step == 4 and resumed.args.learning_rate == 1e-6
    assert json.loads((out / "checkpoint-4" / OWNER).read_text())["settings"]["learning_rate"] == 1e-6
    assert train(BERT, [*lower, "--resume", "auto"], "bert").trainer.state.global_step == 6


def test_the_best_model_survives_staging_rotation_and_a_resume(tmp_path, capsys):
    """load_best_model_at_end with one checkpoint kept: the Trainer recorded the best checkpoint under the staging
    folder (then "Could not locate the best model" and a FileNotFoundError after training), and the rotation
    deleted it. With the metric's "best" the first evaluation's (the highest loss, greater_is_better), a run of 4
    steps and its resume to 8 keep checkpoint-2, and the final model is its weights."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    flags = ["--tiny", "--report_to", "none", "--eval_fraction", "0.1", "--eval_strategy", "steps", "--eval_steps",
             "2", "--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "1",
             "--load_best_model_at_end", "true", "--metric_for_best_model", "loss", "--greater_is_better", "true",
             "--output_dir", str(out)]  # fmt: skip
    first = train(BERT, [*flags, "--max_steps", "4"], "bert").trainer
    assert first.state.best_global_step == 2 and first.state.best_model_checkpoint == str(out / "checkpoint-2")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # the best; the last rotated away
    resumed = train(BERT, [*flags, "--max_steps", "8", "--resume", "auto"], "bert").trainer
    assert resumed.state.best_model_checkpoint == str(out / "checkpoint-2")
    assert "Could not locate the best model" not in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    best = load_file(out / "checkpoint-2" / "model.safetensors")
    final = load_file(out / "model.safetensors")
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in best)
    for state in out.rglob("trainer_state.json"):
        assert STAGING not in state.read_text()


def test_sigterm_finishes_the_step_saves_and_exits_75(tmp_path, monkeypatch, capsys):
    """SIGTERM at step 3 (sent by the process to itself, as `kill` would) and again in the middle of the save:
    the step finishes, checkpoint-3 is written whole, the process exits 75, no final model is written; resumed,
    the run ends with the uninterrupted run's weights."""
    import os
    import signal

    from toolkit.training.stopping import PREEMPTED

    flags = ["--tiny", "--max_steps", "8", "--report_to", "none"]
    reference = train(BERT, [*flags, "--output_dir", str(tmp_path / "reference")], "bert").trainer

    save_optimizer = RecipeTrainer._save_optimizer_and_scheduler

    def signalled_again(self, output_dir):
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal while the checkpoint is being written
        save_optimizer(self, output_dir)

    preempt_at(monkeypatch, 3)
    monkeypatch.setattr(RecipeTrainer, "_save_optimizer_and_scheduler", signalled_again)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(BERT, [*flags, "--output_dir", str(out)], "bert")
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED == 75
    assert "received SIGTERM: step 3 finished, saving a checkpoint" in capsys.readouterr().err
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-3"]
    assert (out / "checkpoint-3" / "optimizer.pt").is_file() and not (out / "model.safetensors").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers handed back

    resumed = train(BERT, [*flags, "--resume", "auto", "--output_dir", str(out)], "bert").trainer
    assert resumed.state.global_step == 8
    expected = weights(reference)
    assert all(torch.equal(expected[k], v) for k, v in weights(resumed).items())


def test_nan_loss_stops_without_saving_over_good_checkpoints(tmp_path, monkeypatch, capsys):
    """The loss turns NaN at step 5: the run stops there with exit code 3 and a message naming the step, the
    newest good checkpoint and the likely causes; checkpoint-2 and -4 stay, nothing of step 5 or later is saved."""
    from toolkit.training.stopping import DIVERGED

    compute_loss = RecipeTrainer.compute_loss

    def nan_from_step_5(self, model, inputs, *args, **kwargs):
        loss = compute_loss(self, model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step >= 4 else loss  # the 5th step's loss

    monkeypatch.setattr(RecipeTrainer, "compute_loss", nan_from_step_5)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(BERT, [*EVERY_2, "--output_dir", str(out)], "bert")
    assert exit_info.value.code == DIVERGED == 3
    err = capsys.readouterr().err
    assert "the loss is not finite at step 5" in err and f"(newest: {out / 'checkpoint-4'})" in err
    assert "lower --learning_rate" in err and "fp16 overflow" in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("engine", "world", "batch", "message"),
    [
        ("FSDP", 2, 16, "was written under DEEPSPEED and this launch runs FSDP"),
        ("DEEPSPEED", 2, 8, "global batch of 16; this launch has 8"),
        ("DEEPSPEED", 1, 16, "python -m deepspeed.checkpoint.ds_to_universal --input_folder"),
    ],
    ids=["other-engine", "other-batch", "zero-other-world"],
)
def test_resume_refusals_name_the_fix(tmp_path, engine, world, batch, message):
    """A ZeRO checkpoint of 2 processes, global batch 16: what cannot be resumed is refused before loading."""
    from toolkit.errors import ConfigError
    from toolkit.training.resume import check_resumable

    checkpoint = tmp_path / "checkpoint-16"
    checkpoint.mkdir()
    (checkpoint / OWNER).write_text(json.dumps({"recipe": "llama3_fft", "model": "m", "engine": "DEEPSPEED",
                                                "world_size": 2, "global_batch_size": 16}))  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_resumable(checkpoint, engine, world, batch, accumulation=1)
    assert check_resumable(checkpoint, "DEEPSPEED", 2, 16, accumulation=1) == ""  # the same launch resumes


def test_a_tensor_parallel_checkpoint_resumes_on_its_own_processes_only(tmp_path):
    """A checkpoint of a model sharded at load holds one optimizer file a rank (sharded_state.py): another process
    count is refused before loading, and a rank's file missing makes the checkpoint incomplete."""
    from toolkit.errors import ConfigError
    from toolkit.training.checkpoint_damage import optimizer_damage, rank_optimizer
    from toolkit.training.resume import check_resumable

    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / OWNER).write_text(json.dumps({"recipe": "llama3_fft", "model": "m", "engine": "replicated",
                                                "world_size": 2, "global_batch_size": 8}))  # fmt: skip
    torch.save({"state": {}}, rank_optimizer(checkpoint, 0))
    torch.save({}, checkpoint / "scheduler.pt")
    with pytest.raises(ConfigError, match="optimizer shards of a model split over 2 processes"):
        check_resumable(checkpoint, "replicated", 4, 8, accumulation=1)
    assert check_resumable(checkpoint, "replicated", 2, 8, accumulation=1) == ""
    assert "optimizer-rank1.pt" in optimizer_damage(checkpoint, "replicated", ranks=2)
    torch.save({"state": {}}, rank_optimizer(checkpoint, 1))
    assert optimizer_damage(checkpoint, "replicated", ranks=2) is None


def test_a_batch_mismatch_names_the_micro_batch_of_the_mesh(tmp_path, monkeypatch):
    """fsdp2_tp on 4 processes (dp_shard=2 x tp=2): the ranks of a tensor-parallel group share their rows, so a
    global batch of 8 is 4 a device, not 8 / 4 processes (the hint said 2, which would not have resumed either)."""
    from toolkit.errors import ConfigError
    from toolkit.training.resume import check_resumable

    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / OWNER).write_text(json.dumps({"recipe": "llama3_fft", "model": "m", "engine": "replicated",
                                                "world_size": 4, "global_batch_size": 8}))  # fmt: skip
    with pytest.raises(ConfigError, match="Pass --per_device_train_batch_size 4 "):
        check_resumable(checkpoint, "replicated", 4, 16, accumulation=1)


def test_a_grpo_checkpoint_resumes_with_its_own_step_only(tmp_path):
    """A GRPO checkpoint records what a step is (group size, completions sampled at once, micro-batches a sampling):
    the same global batch cut otherwise is refused, naming the setting and the value that continues the run."""
    from toolkit.errors import ConfigError
    from toolkit.training.resume import check_resumable

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    shape = {"num_generations": 4, "generation_batch_size": 8, "steps_per_generation": 2}
    (checkpoint / OWNER).write_text(json.dumps({"recipe": "smollm2_grpo", "model": "m", "engine": "replicated",
                                                "world_size": 1, "global_batch_size": 8, **shape}))  # fmt: skip
    assert check_resumable(checkpoint, "replicated", 1, 8, 2, shape=shape) == ""
    assert check_resumable(checkpoint, "replicated", 1, 8, 2) == ""  # no step of GRPO's to compare
    with pytest.raises(ConfigError, match="num_generations 4; this launch has 2.* Pass --num_generations 4 "):
        check_resumable(checkpoint, "replicated", 1, 8, 2, shape={**shape, "num_generations": 2})
    with pytest.raises(ConfigError, match="steps_per_generation 2; this .* --gradient_accumulation_steps 2"):
        check_resumable(checkpoint, "replicated", 1, 8, 2, shape={**shape, "steps_per_generation": 1})


# ---------------------------------------------------------------------------------------- damaged checkpoints


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {  # what happens to the newest checkpoint, and the reason a resume gives
    "optimizer missing": (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    "optimizer truncated": (lambda c: truncate(c / "optimizer.pt"), "optimizer.pt is truncated"),
    "scheduler missing": (lambda c: (c / "scheduler.pt").unlink(), "scheduler.pt is missing"),
    "weights missing": (lambda c: (c / "model.safetensors").unlink(), "the model's weights are missing"),
    "weights truncated": (lambda c: truncate(c / "model.safetensors", 0.9), "model.safetensors is truncated"),
    "state missing": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "state not JSON": (
        lambda c: (c / "trainer_state.json").write_text('{"global_st'),
        "trainer_state.json is not JSON",
    ),
    "run file not JSON": (lambda c: (c / OWNER).write_text("\0\0"), f"{OWNER} is not JSON"),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny Llama run of 6 steps with checkpoints at 2, 4 and 6, and its final weights."""
    out = tmp_path_factory.mktemp("saved") / "run"
    trainer = train(LLAMA, [*EVERY_2, "--output_dir", str(out)], "llama3_fft").trainer
    return out, weights(trainer)


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_never_resumed(kind, saved_run, tmp_path):
    """A checkpoint is used only when complete and readable. An explicit one that is damaged is one error line
    (before, a missing optimizer.pt resumed with a fresh optimizer, exit 0, and the others ended in tracebacks);
    `--resume auto` falls back to the newest good one and says which it skipped and why."""
    from toolkit.errors import ConfigError
    from toolkit.training.resume import resume_point

    out = tmp_path / "run"
    shutil.copytree(saved_run[0], out)
    damage, reason = DAMAGE[kind]
    damage(out / "checkpoint-6")
    with pytest.raises(ConfigError, match=f"Cannot resume from '.*checkpoint-6': {re.escape(reason)}"):
        resume_point(str(out / "checkpoint-6"), out)
    folder, note = resume_point("auto", out)
    assert folder == str(out / "checkpoint-4")
    assert f"(skipped checkpoint-6: {reason}" in note


def test_auto_resumes_from_the_newest_good_checkpoint_and_ends_as_the_uninterrupted_run(saved_run, tmp_path):
    """The newest checkpoint's optimizer lost (the reproduction): `--resume auto` skips it, continues from step
    4 and ends with the uninterrupted run's weights; the damaged one is written anew, nothing good is lost."""
    out = tmp_path / "run"
    shutil.copytree(saved_run[0], out)
    (out / "checkpoint-6" / "optimizer.pt").unlink()
    good = listing(out / "checkpoint-4")
    resumed = train(LLAMA, [*EVERY_2, "--output_dir", str(out), "--resume", "auto"], "llama3_fft").trainer
    for name, value in saved_run[1].items():
        assert torch.equal(weights(resumed)[name], value), name
    assert (out / "checkpoint-6" / "optimizer.pt").is_file() and listing(out / "checkpoint-4") == good


def test_a_run_whose_every_checkpoint_is_damaged_is_refused(saved_run, tmp_path):
    from toolkit.errors import ConfigError
    from toolkit.training.resume import resume_point

    out = tmp_path / "run"
    shutil.copytree(saved_run[0], out)
    for step in (2, 4, 6):
        (out / f"checkpoint-{step}" / "optimizer.pt").unlink()
    with pytest.raises(ConfigError, match="no checkpoint in .* can be resumed from .*checkpoint-2: optimizer.pt is "
                       "missing.* Move them away, or pass another --output_dir"):  # fmt: skip
        resume_point("auto", out)
    before = listing(out)
    with pytest.raises(SystemExit) as stopped:  # the run's own entry: exit 2, nothing touched
        run(LLAMA, [*EVERY_2, "--output_dir", str(out), "--resume", "auto"], "llama3_fft")
    assert stopped.value.code == 2 and listing(out) == before


def test_a_checkpoint_is_published_with_its_marker_listing_every_file_last(saved_run):
    """The marker (toolkit_run.json), written after the rename, lists every other file of the checkpoint and its
    size: a fresh view of a bucket (a relaunch's mount) can tell a checkpoint whose uploads all landed."""
    from toolkit.training.checkpoint_damage import MANIFEST

    checkpoint = saved_run[0] / "checkpoint-6"
    files = json.loads((checkpoint / OWNER).read_text())[MANIFEST]
    on_disk = {str(p.relative_to(checkpoint)): p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()}
    assert files == {name: size for name, size in on_disk.items() if name != OWNER}
    assert {"rng_state.pth", "trainer_state.json", "toolkit_cost.json", "model.safetensors"} <= set(files)


def drop_rank_file(checkpoint) -> None:
    """A 2-rank checkpoint whose rank-1 RNG state the marker lists and the bucket never got (its node was lost)."""
    from toolkit.training.checkpoint_damage import MANIFEST

    owner = json.loads((checkpoint / OWNER).read_text())
    owner[MANIFEST]["rng_state_1.pth"] = 14_645
    (checkpoint / OWNER).write_text(json.dumps(owner))


def cut_rng_state(checkpoint) -> None:
    path = checkpoint / "rng_state.pth"
    path.write_bytes(path.read_bytes()[:100])


NOT_UPLOADED = ": its upload did not finish"
UPLOADS = {  # a bucket's newest checkpoint as a relaunch's fresh mount sees it, and the reason a resume gives
    "another rank's file missing": (drop_rank_file, "rank 1's RNG state rng_state_1.pth is missing" + NOT_UPLOADED),
    "a file missing": (lambda c: (c / "rng_state.pth").unlink(), "rng_state.pth is missing" + NOT_UPLOADED),
    "a file short": (cut_rng_state, "rng_state.pth is 100 bytes of "),
    "no marker": (lambda c: (c / OWNER).unlink(), f"{OWNER} is missing (written last, once every file is): its save"),
}


@pytest.mark.parametrize("kind", UPLOADS)
def test_a_checkpoint_is_trusted_only_with_its_marker_and_every_file_it_lists(kind, saved_run, tmp_path):
    """On a bucket mount (SkyPilot's MOUNT_CACHED) the marker can land before a file of the node that wrote it, or
    never: a checkpoint missing a listed file, holding one short, or without its marker, is skipped by --resume auto,
    named with why; the checks before read no RNG state, and a checkpoint without an owner record was trusted."""
    from toolkit.errors import ConfigError
    from toolkit.training.resume import resume_point

    out = tmp_path / "run"
    shutil.copytree(saved_run[0], out)
    damage, reason = UPLOADS[kind]
    damage(out / "checkpoint-6")
    folder, note = resume_point("auto", out)
    assert folder == str(out / "checkpoint-4")
    assert f"(skipped checkpoint-6: {reason}" in note, note
    with pytest.raises(ConfigError, match=f"Cannot resume from '.*checkpoint-6': {re.escape(reason)}"):
        resume_point(str(out / "checkpoint-6"), out)


def test_a_checkpoint_the_trainer_alone_wrote_needs_no_marker(saved_run, tmp_path):
    """A Trainer checkpoint copied from elsewhere (no toolkit run around it, no owner record) still resumes by path."""
    from toolkit.metrics.tracking import SPENT_FILE
    from toolkit.training.resume import resume_point

    checkpoint = tmp_path / "elsewhere" / "checkpoint-6"
    shutil.copytree(saved_run[0] / "checkpoint-6", checkpoint)
    (checkpoint / OWNER).unlink()
    (checkpoint / SPENT_FILE).unlink()
    assert resume_point(str(checkpoint), checkpoint.parent)[0] == str(checkpoint)


def test_rank_0_publishes_once_it_sees_every_ranks_files_or_names_the_missing_one(tmp_path, monkeypatch):
    """Rank 0 waits until every file the nodes reported is in its own view of the staging folder at its size (on a
    bucket mount another node's file shows once uploaded and the directory cache expired), then goes on; one that
    never shows is one error line naming it, whose it is, and the fix."""
    import threading
    import time
    from types import SimpleNamespace

    from toolkit.errors import ConfigError
    from toolkit.training import checkpoints

    monkeypatch.setattr(checkpoints, "POLL_S", 0.05)
    staged = tmp_path / ".staging" / "checkpoint-4"
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(b"m" * 10)  # rank 0's own
    part = SimpleNamespace(trainer=SimpleNamespace(is_world_process_zero=lambda: True))
    saver = checkpoints.StagedCheckpoints(part.trainer)
    arrives = threading.Timer(0.5, lambda: (staged / "rng_state_1.pth").write_bytes(b"r" * 20))  # the upload
    arrives.start()
    started = time.monotonic()
    saver.await_files(staged, {"model.safetensors": 10, "rng_state_1.pth": 20})
    assert 0.4 < time.monotonic() - started < 5
    (staged / "rng_state_1.pth").write_bytes(b"r" * 5)  # shown short: not yet
    monkeypatch.setattr(checkpoints, "VISIBLE_WITHIN_S", 0.3)
    said = "checkpoint-4 cannot be published: for 0 s rank 0 has not seen rank 1's RNG state rng_state_1.pth (20 bytes)"
    with pytest.raises(ConfigError, match=re.escape(said)) as error:
        saver.await_files(staged, {"model.safetensors": 10, "rng_state_1.pth": 20})
    assert "Relaunch with --resume auto" in str(error.value) and "\n" not in str(error.value)


def test_sharded_checkpoints_are_checked_from_their_metadata(tmp_path):
    """FSDP's sharded folders (torch.distributed.checkpoint: .metadata and .distcp files) and DeepSpeed's
    global_step folders (torch files named by `latest`): a shard cut short is found from the sizes its metadata
    records, a torch file from its zip directory."""
    import torch.distributed.checkpoint as dcp

    from toolkit.training.checkpoint_damage import dcp_damage, weights_damage

    dcp.save({"weight": torch.randn(256, 64)}, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"))
    assert dcp_damage(tmp_path / "pytorch_model_fsdp_0") is None
    assert weights_damage(tmp_path, "FSDP") is None
    truncate(next((tmp_path / "pytorch_model_fsdp_0").glob("*.distcp")))
    assert "is missing or truncated" in weights_damage(tmp_path, "FSDP")
    (tmp_path / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"nope")
    assert ".metadata is missing or unreadable" in weights_damage(tmp_path, "FSDP")

    zero = tmp_path / "zero"
    (zero / "global_step4").mkdir(parents=True)
    torch.save({"module": torch.randn(64)}, zero / "global_step4" / "mp_rank_00_model_states.pt")
    assert weights_damage(zero, "DEEPSPEED").startswith("latest")
    (zero / "latest").write_text("global_step4")
    assert weights_damage(zero, "DEEPSPEED") is None
    truncate(zero / "global_step4" / "mp_rank_00_model_states.pt")
    assert (
        weights_damage(zero, "DEEPSPEED") == "global_step4/mp_rank_00_model_states.pt is truncated or not a torch file"
    )


def test_a_run_again_into_a_finished_runs_folder_says_so_and_keeps_its_own_log(tmp_path, capsys):
    """A recipe run again into the folder of a finished run (no checkpoints: the default) replaced its model
    without a word and appended its steps to the old run_log.jsonl: now a warning says what is replaced, and the
    log holds the new run's steps only."""
    out = tmp_path / "run"
    flags = ["--tiny", "--max_steps", "3", "--report_to", "none", "--output_dir", str(out)]
    train(BERT, flags, "bert")
    assert "holds an earlier run's results" not in capsys.readouterr().err
    train(BERT, flags, "bert")
    assert f"warning: {out} holds an earlier run's results (written " in capsys.readouterr().err
    lines = [json.loads(line) for line in (out / "run_log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2, 3]  # one run's steps, not two


def test_a_resume_on_another_length_says_the_schedule_changes(tmp_path, capsys):
    """The refusal of a resume with nothing left said "raise --max_steps to continue it"; doing so, the Trainer
    recomputes the schedule for the new length (a 10-step cosine resumed with --max_steps 20 logged 0.0 at step 11,
    then jumped to 0.000843): said in one warning. A resume on the run's own length says nothing."""
    from toolkit.errors import ConfigError
    from toolkit.training.resume import check_steps_left

    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 10, "max_steps": 10}))
    with pytest.raises(ConfigError, match="on a learning-rate schedule for the new length"):
        check_steps_left(checkpoint, 10)
    check_steps_left(checkpoint, 20)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {checkpoint} was saved by a run of 10 steps and this one ends at step 20: ")
    assert "--max_steps 10 continues the run as it was" in line
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 5, "max_steps": 10}))
    check_steps_left(checkpoint, 10)
    assert capsys.readouterr().err == ""


def test_a_model_whose_checkpoint_names_are_converted_resumes_its_weights(tmp_path, monkeypatch):
    """transformers 5 saves Mixtral's fused experts as per-expert matrices (w1, w2, w3) and loads them back
    converted; the Trainer's resume matched the saved names against the model's, loaded none of them (a warning)
    and trained on from the first weights with the checkpoint's optimizer. Preempted after checkpoint-2 and resumed,
    the run now ends on the uninterrupted run's weights, bit for bit. (Image-text models: test_vlm_strategies.py.)"""
    from toolkit.models import tiny
    from toolkit.training.stopping import PREEMPTED

    mixtral = str(tiny.tiny_checkpoint("mistralai/Mixtral-8x7B-v0.1", "sft"))
    flags = [*EVERY_2, "--max_steps", "4", "--model_name_or_path", mixtral]
    whole = weights(train(LLAMA, [*flags, "--output_dir", str(tmp_path / "whole")], "llama3_fft").trainer)

    preempt_at(monkeypatch, 2)
    with pytest.raises(SystemExit) as exit_info:
        run(LLAMA, [*flags, "--output_dir", str(tmp_path / "cut")], "llama3_fft")
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED
    resumed = train(LLAMA, [*flags, "--output_dir", str(tmp_path / "cut"), "--resume", "auto"], "llama3_fft").trainer
    assert all(torch.equal(value, weights(resumed)[name]) for name, value in whole.items())


def test_the_best_checkpoint_of_a_converted_model_is_the_one_kept(tmp_path):
    """--load_best_model_at_end on Mixtral (its checkpoint names converted, as above): the best checkpoint, here the
    first (the highest held-out loss counts as best), is what the run ends with, not the last step's weights."""
    from transformers import AutoModelForCausalLM

    from toolkit.models import tiny

    mixtral = str(tiny.tiny_checkpoint("mistralai/Mixtral-8x7B-v0.1", "sft"))
    out = tmp_path / "run"
    trainer = train(LLAMA, [*EVERY_2, "--max_steps", "4", "--model_name_or_path", mixtral, "--eval_fraction", "0.1",
                            "--eval_strategy", "steps", "--eval_steps", "2", "--load_best_model_at_end", "true",
                            "--metric_for_best_model", "loss", "--greater_is_better", "true",
                            "--output_dir", str(out)], "llama3_fft").trainer  # fmt: skip
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    best = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2").state_dict()
    assert all(torch.equal(best[name], value) for name, value in weights(trainer).items())


@pytest.mark.parametrize("engine", ["fsdp", "none"])
def test_a_resume_takes_a_compiled_model_as_given(engine, monkeypatch, tmp_path):
    """FSDP's resume hands the Trainer its wrapped model, compiled where compile is on (fsdp2_fp8.yaml on a GPU,
    --torch_compile auto): the weights' load asked that model for its truth, which a compiled module answers with
    a TypeError ("LlamaForCausalLM does not support len()", the H200's fsdp2_fp8 row on 2026-11-28). The model is
    passed on as given, compiled or not, and the model asked only when none is given."""
    from transformers import Trainer

    loaded = []
    monkeypatch.setattr(Trainer, "_load_from_checkpoint", lambda self, checkpoint, model=None: loaded.append(model))
    trainer = object.__new__(RecipeTrainer)  # the method's own state only: no engine set up on one CPU
    trainer.pipeline, trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled = None, False, engine == "fsdp"
    trainer.model = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.Linear(2, 2))  # compiles at its first call, never made here
    trainer._load_from_checkpoint(str(tmp_path), compiled)
    assert loaded == [compiled]
