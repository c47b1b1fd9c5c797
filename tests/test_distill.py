"""On-policy distillation (task distill) on TRL's DistillationTrainer with the toolkit's parts: a tiny student
learns a tiny teacher's distribution on its own completions (the teacher a mixture of experts, as the recipe's),
the plan holds the teacher's weights and forward, `toolkit eval` measures both models against the teacher, a
preempted run resumes bit-identically, 2 processes under DDP and ZeRO-3 train as one on the same completions, and
what distillation cannot take is one line before any weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check, launch, logged, preempt_at, rank_reports, reference_run
from qwen3_distill import RECIPE as DISTILL
from safetensors.torch import load_file

from toolkit import run, train
from toolkit.errors import ConfigError
from toolkit.results.evaluation import evaluate_run
from toolkit.results.record import RunRecord

NAME = "qwen3_distill"
REPLAY = str(ROOT / "tests" / "grpo_replay.py") + ":replay"


def distill_flags(out: Path, steps: int = 6, *extra: str) -> list[str]:
    return ["--tiny", "--max_steps", str(steps), "--record_rank_reports", "true", "--report_to", "none",
            "--output_dir", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distill") / "one"
    train(DISTILL, distill_flags(out, 6, "--eval_fraction", "0.05", "--save_strategy", "steps", "--save_steps", "3",
                                 "--peak_tflops", "0.1", "--memory_tbs", "0.01"), NAME)  # fmt: skip
    return out


def test_a_tiny_student_learns_its_teachers_distribution(one_process):
    """The divergence to the teacher on the student's own completions falls; the teacher (a tiny Qwen3-MoE of the
    recipe's teacher's family, the student's tokenizer) is recorded, and the student alone is exported."""
    losses = logged(one_process, "loss")
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0], losses
    record = RunRecord.read(one_process)
    assert record.task == "distill" and record.settings["beta"] == 1.0
    assert "Qwen3-30B-A3B-distill" in record.settings["teacher_model_name_or_path"]
    assert (one_process / "model.safetensors").is_file()
    assert f"| teacher | {record.settings['teacher_model_name_or_path']} |" in (one_process / "README.md").read_text()
    summary = json.loads((one_process / "run_summary.json").read_text())
    assert summary["summary"]["status"] == "completed" and summary["config"]["cost_plan"]["sampling_seconds"] > 0


def test_the_plan_holds_the_teachers_weights_and_forward(tmp_path, capsys):
    """The memory plan's teacher_model is its weights in the run's dtype (fp32 here), and no reference (distill's
    beta picks a divergence); the FLOPs per trained token add the teacher's forward, which torch's FlopCounterMode
    counts on the teacher's checkpoint (eager attention and experts, operators it sees; the full logits, as the
    formula assumes) within 2%: its routed experts by the tokens sent to them, not all of them."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from toolkit.planner.estimate import training_flops_per_token

    trainer = train(DISTILL, distill_flags(tmp_path / "run", 1, "--save_strategy", "no"), NAME).trainer
    teacher = trainer.teacher_model
    assert trainer.plan.memory.device["teacher_model"] == 4 * sum(p.numel() for p in teacher.parameters())
    assert "reference_model" not in trainer.plan.memory.device
    header = capsys.readouterr().out
    assert "teacher       " in header and "reverse KL (beta 1) to the teacher's next-token distribution" in header
    counted = AutoModelForCausalLM.from_pretrained(
        trainer.recipe.model.teacher_model_name_or_path, attn_implementation="eager", experts_implementation="eager"
    )
    seq = 32
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        counted(input_ids=torch.randint(0, 256, (2, seq)))
    added = trainer.plan.flops_per_token(seq) - training_flops_per_token(trainer.plan.shape, seq)
    assert added == pytest.approx(counter.get_total_flops() / (2 * seq), rel=0.02)


def test_eval_measures_both_models_against_the_teacher(one_process, capsys):
    """`toolkit eval`: the teacher's greedy answers to the held-out prompts, and each model's KL from the teacher
    and top-1 agreement on them; the student moved towards the teacher. The data has gold answers, so each
    model's own answers are scored by them too, and the teacher's once."""
    result = evaluate_run(one_process)
    metrics = {row["metric"]: row for row in result["results"]}
    assert result["tasks"] == ["held-out"]
    assert set(metrics) == {"kl_to_teacher", "agreement", "accuracy", "finished"}
    assert metrics["kl_to_teacher"]["tuned"] < metrics["kl_to_teacher"]["base"]
    for name in ("agreement", "accuracy", "finished"):
        assert 0 <= metrics[name]["base"] <= 1 and 0 <= metrics[name]["tuned"] <= 1
    assert capsys.readouterr().err.count("eval: the teacher's own held-out accuracy") == 1


class Adder:
    """A model whose greedy answer to "What is A plus B?" is scripted: right, or off by one for every
    `wrong_every`-th question."""

    def __init__(self, tokenizer, wrong_every: int = 0) -> None:
        self.tokenizer, self.wrong_every, self.asked = tokenizer, wrong_every, 0
        self.generation_config = type("Config", (), {"eos_token_id": tokenizer.eos_token_id})()
        self.device = torch.device("cpu")

    def reply(self, question: str) -> str:
        a, b = (int(word) for word in question.split("What is ")[-1].split("?")[0].split(" plus "))
        self.asked += 1
        wrong = self.wrong_every and self.asked % self.wrong_every == 0
        return f"{a} plus {b} is {a + b + wrong}."

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **_):
        replies = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            text = self.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
            ids = self.tokenizer.encode(self.reply(text), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            replies.append(ids[:max_new_tokens])
        width = max(map(len, replies))
        padded = [r + [pad_token_id] * (width - len(r)) for r in replies]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=1)


@pytest.mark.parametrize(("wrong_every", "expected"), [(0, 1.0), (2, 0.5), (1, 0.0)])
def test_eval_scores_a_distilled_model_s_answers_by_the_gold_ones(one_process, wrong_every, expected):
    """A distill run has no rewards: its held-out answers, and the teacher's, are scored by GRPO's accuracy
    reward against the data's gold answers (here a scripted model, right on all, half or none of 4 questions)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from toolkit.results.held_out_rewards import held_out_rewards
    from toolkit.results.held_out_teacher import teacher_accuracy

    tokenizer = AutoTokenizer.from_pretrained(one_process)
    record = RunRecord.read(one_process)
    questions = [(3, 4), (10, 22), (0, 9), (51, 48)]
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                               "answer": str(a + b)} for a, b in questions])  # fmt: skip
    scores = held_out_rewards(record, Adder(tokenizer, wrong_every), tokenizer, rows, batch_size=3,
                              rewards="accuracy")  # fmt: skip
    assert scores["accuracy"] == expected and scores["finished"] == 1.0
    teacher = Adder(tokenizer, wrong_every)
    answers = [tokenizer.encode(teacher.reply(f"What is {a} plus {b}?")) for a, b in questions]
    assert teacher_accuracy(record, tokenizer, rows, answers) == expected


def test_preempted_distill_run_resumes_bit_identically(one_process, tmp_path, monkeypatch):
    from toolkit.training.stopping import PREEMPTED

    preempt_at(monkeypatch, 3)
    out = tmp_path / "run"
    flags = distill_flags(out, 6, "--eval_fraction", "0.05", "--save_strategy", "steps", "--save_steps", "3")
    with pytest.raises(SystemExit) as exit_info:
        run(DISTILL, flags, NAME)
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED
    train(DISTILL, [*flags, "--resume", "auto"], NAME)
    full, resumed = rank_reports(one_process)[0], rank_reports(out)[0]
    assert resumed["losses"] == full["losses"] and resumed["weights_sha256"] == full["weights_sha256"]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> Path:
    """The 1-process run on replayed completions (tests/grpo_replay.py as the rollout_func: TRL's distillation
    takes none, the toolkit's trainer does)."""
    out = tmp_path_factory.mktemp("distill") / "replayed"
    return reference_run(NAME, distill_flags(out, 3, "--rollout_func", REPLAY), out)


@pytest.mark.launch
@pytest.mark.parametrize("config", ["ddp", "zero3"])
def test_two_processes_train_as_one_on_the_same_completions(config, replayed, tmp_path):
    """2 processes of 4 prompts against 1 of 8, the same completions: the same losses and exported weights (TRL
    divides the summed divergence by the completion tokens of the whole generation batch, all ranks; the teacher
    partitioned under ZeRO-3 as the student is)."""
    out = tmp_path / "run"
    check(launch(config, NAME, *distill_flags(out, 3, "--rollout_func", REPLAY, "--per_device_train_batch_size",
                                              "4"), cwd=tmp_path))  # fmt: skip
    reports = rank_reports(out)
    assert sorted(reports[0]["rows"] + reports[1]["rows"]) == sorted(rank_reports(replayed)[0]["rows"])
    for key in ("loss", "grad_norm"):
        assert logged(out, key) == pytest.approx(logged(replayed, key), rel=1e-4, abs=1e-7), key
    ours, theirs = load_file(out / "model.safetensors"), load_file(replayed / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():  # AdamW's sign-like steps: apart by at most 1% of lr x steps an element
        apart = float((ours[name] - value).norm())
        assert apart <= 0.01 * 2e-3 * 3 * value.numel() ** 0.5, (name, apart)


def test_a_teacher_of_another_vocabulary_is_one_line_before_weights_load(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    config = json.loads((Path(tiny_student()) / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps(dict(config, vocab_size=1000)))
    with pytest.raises(
        ConfigError,
        match=r"the teacher .*teacher has a vocabulary of 1,000 and the student .* one "
        r"of \d+: distillation compares their whole next-token distributions",
    ):
        train(DISTILL, distill_flags(tmp_path / "run", 1, "--teacher_model_name_or_path", str(teacher)), NAME)


def test_a_teacher_of_as_many_rows_but_another_vocabulary_is_one_line(tmp_path):
    """Mistral-7B and Llama-2 both have 32,000 rows: equal sizes are not one vocabulary. A teacher whose config
    matches the student's and whose tokenizer gives two of its tokens each other's ids is refused before any weights
    load (TRL compares their distributions row by row: those rows mean other tokens)."""
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_student(), teacher)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match=r"the teacher .*teacher's vocabulary is not the student's .* 2 of their "
                                          r"tokens have another id in one of them"):  # fmt: skip
        train(DISTILL, distill_flags(tmp_path / "run", 1, "--teacher_model_name_or_path", str(teacher),
                                     "--save_strategy", "no"), NAME)  # fmt: skip


def test_a_qlora_students_teacher_is_the_one_eval_loads_and_the_header_says_so(tmp_path, capsys):
    """--load_in_4bit quantizes the student's base, not its teacher: the teacher loads in the run's dtype, as the
    plan counts it and as `toolkit eval` loads it to measure the students against (a 4-bit teacher in training
    and a full one in eval compared the students with a teacher they never learnt from). The header names the
    teacher's dtype, and says its temperature softens both distributions of the divergence."""
    pytest.importorskip("bitsandbytes")
    trainer = train(DISTILL, distill_flags(tmp_path / "run", 1, "--use_lora", "true", "--load_in_4bit", "true",
                                           "--save_strategy", "no", "--temperature", "0.7"), NAME).trainer  # fmt: skip
    assert type(trainer.model.base_model.model.model.layers[0].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    teacher = trainer.teacher_model
    assert not [m for m in teacher.modules() if type(m).__name__ == "Linear4bit"]
    assert {p.dtype for p in teacher.parameters()} == {torch.float32}  # tiny mode's dtype on a CPU
    out = capsys.readouterr().out
    assert "frozen, float32, not quantized with the 4-bit student: as toolkit eval loads it" in out
    assert "both distributions at temperature 0.7 (TRL divides both models' logits by it)" in out


def tiny_student() -> str:
    """The tiny student's folder, as tiny mode makes it."""
    from toolkit.models.tiny import tiny_checkpoint

    return str(tiny_checkpoint(DISTILL["model_name_or_path"], "distill"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--teacher_model_name_or_path", ""], "a distill recipe needs a teacher: set teacher_model_name_or_path"),
        (["--beta", "2"], r"beta must be in \[0, 1\] for distill, got 2"),
        (["--reward_funcs", "accuracy"], "reward_funcs 'accuracy' is read only by tasks grpo and rloo"),
        (["--sampler", "continuous"], "TRL's distillation trainer samples with generate or vLLM only"),
        (["--task", "grpo", "--reward_funcs", "accuracy"], "teacher_model_name_or_path is distillation's: drop it"),
        (
            ["--teacher_model_name_or_path", "{tmp}/runs/smollm2_chat/merged"],  # a run's folder not yet written
            r"The teacher path .*/runs/smollm2_chat/merged does not exist: it is recipes/smollm2_chat.py's model "
            r"merged with its adapter \(make finetune MODEL=smollm2_chat ARGS='--use_lora true --merge_lora true'",
        ),
    ],
)
def test_settings_distill_cannot_take_are_one_line(flags, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        train(DISTILL, distill_flags(tmp_path / "run", 1, *(f.format(tmp=tmp_path) for f in flags)), NAME)


def test_a_local_teacher_folder_is_taken_as_it_is(tmp_path):
    """A teacher given as a folder (a run's output, say) is not swapped for a tiny one by tiny mode."""
    folder = tiny_student()
    trainer = train(DISTILL, distill_flags(tmp_path / "run", 1, "--save_strategy", "no",
                                           "--teacher_model_name_or_path", folder), NAME).trainer  # fmt: skip
    assert trainer.recipe.model.teacher_model_name_or_path == folder


def test_a_lora_student_trains_and_exports_its_adapter(tmp_path):
    """A LoRA student: the adapter alone trains (the teacher and the base frozen) and is exported; the divergence
    falls."""
    out = tmp_path / "run"
    trainer = train(DISTILL, distill_flags(out, 4, "--use_lora", "true", "--save_strategy", "no"), NAME).trainer
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    losses = logged(out, "loss")
    assert losses[-1] < losses[0] and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
