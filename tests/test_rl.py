"""Online RL (task grpo) on TRL's GRPOTrainer with the toolkit's parts: a tiny run samples, scores each reward,
counts the tokens it trains on and exports; `toolkit eval` compares base and tuned on the same held-out prompts;
a preempted run resumes bit-identically (the sampling included); 2 processes under DDP, ZeRO-2, ZeRO-3 and
FSDP2 split the prompts; and every mistake (a reward that fails, settings GRPO cannot take, configs it cannot run
on) is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check, launch, logged, preempt_at, rank_reports, reference_run
from safetensors.torch import load_file
from smollm2_grpo import RECIPE as GRPO

from toolkit import run, train
from toolkit.errors import ConfigError, ToolkitError
from toolkit.results.evaluation import evaluate_run
from toolkit.results.record import RunRecord

NAME = "smollm2_grpo"


def grpo_flags(out: Path, steps: int = 4, *extra: str) -> list[str]:
    return ["--tiny", "--max_steps", str(steps), "--record_rank_reports", "true", "--report_to", "none",
            "--output_dir", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grpo") / "one"
    train(GRPO, grpo_flags(out, 4, "--eval_fraction", "0.02", "--save_steps", "2", "--beta", "0.04",
                           "--peak_tflops", "0.1", "--memory_tbs", "0.01"), NAME)  # fmt: skip
    return out


def test_a_tiny_grpo_run_samples_scores_trains_and_exports(one_process, capsys):
    """Each step: 2 prompts x 4 completions sampled, both rewards logged (their mean and spread) with the weighted
    sum, the KL to the reference (beta 0.04), the tokens trained on (prompts and completions) counted, the adapter
    moved; the trained adapter exported alone, and the header states the batch arithmetic."""
    steps = logged(one_process, "loss")
    assert len(steps) == 4
    for key in ("rewards/accuracy/mean", "rewards/format/std", "reward", "completions/mean_length"):
        assert len(logged(one_process, key)) == 4, key
    assert any(v > 0 for v in logged(one_process, "rewards/format/mean"))  # the reward varies: advantages do too
    assert any(norm > 0 for norm in logged(one_process, "grad_norm"))
    tokens = logged(one_process, "num_input_tokens_seen")
    assert tokens[0] > 8 * 8 and tokens == sorted(tokens)  # 8 completions of up to 8 tokens, and their prompts
    report = rank_reports(one_process)[0]
    assert report["micro_batches"] == 4 and len(report["rows"]) == 4 * 8
    summary = json.loads((one_process / "run_summary.json").read_text())["summary"]
    assert summary["status"] == "completed" and summary["tokens"] == tokens[-1]
    # sampling timed apart from the step's training part, whose tokens/s is then the higher
    shares = logged(one_process, "sampling_share")
    assert len(shares) == 4 and all(0 < share < 1 for share in shares)
    assert summary["training_tokens_per_second"] > summary["tokens_per_second"] > 0
    # the plan's floor (--peak_tflops, --memory_tbs: CPUs have no datasheet figures) beneath what the steps took
    plan = json.loads((one_process / "run_summary.json").read_text())["config"]["cost_plan"]
    assert plan["steps"] == 4
    assert plan["seconds"] == pytest.approx(4 * (plan["sampling_seconds"] + plan["training_seconds"]))
    sampled = [share * seconds for share, seconds in zip(shares, logged(one_process, "step_seconds"), strict=True)]
    assert 0 < plan["sampling_seconds"] < min(sampled)
    # sampled tokens a second: rank 0's completions (1 process: all of them) over the sampling time
    lengths = logged(one_process, "completions/mean_length")
    rates = logged(one_process, "sampling_tokens_per_second_per_device")
    assert rates == pytest.approx([8 * length / s for length, s in zip(lengths, sampled, strict=True)], rel=1e-3)
    assert (one_process / "adapter_model.safetensors").is_file() and not (one_process / "README.md").read_text(
    ).startswith("---\nbase_model")  # the toolkit's card, not TRL's draft  # fmt: skip
    # beta > 0 under LoRA: TRL's frozen "ref" adapter was the reference (checkpoints keep it), the export leaves it out
    assert logged(one_process, "kl") and (one_process / "checkpoint-2" / "ref").is_dir()
    assert not (one_process / "ref").exists()


def test_report_draws_the_reward_against_steps_and_dollars(one_process, tmp_path):
    from toolkit.metrics.report import main

    assert main([str(one_process), "--output", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "reward.png").is_file()
    assert "sampling" in (tmp_path / "report" / "report.md").read_text()


def test_eval_compares_base_and_tuned_on_the_same_held_out_prompts(one_process):
    """`toolkit eval` on a grpo run: both models answer the held-out prompts greedily, scored by the run's own
    rewards: each reward's mean, the weighted sum and the share that finished; the same prompts for both."""
    result = evaluate_run(one_process)
    assert result["tasks"] == ["held-out"]
    metrics = {row["metric"]: row for row in result["results"]}
    assert set(metrics) == {"accuracy", "format", "reward", "finished"}
    for row in metrics.values():
        assert 0 <= row["base"] <= 2 and 0 <= row["tuned"] <= 2
    assert metrics["reward"]["base"] == pytest.approx(metrics["accuracy"]["base"] + metrics["format"]["base"])
    assert result["inputs"]["base"] == result["inputs"]["tuned"]


def test_preempted_grpo_run_resumes_bit_identically(one_process, tmp_path, monkeypatch):
    """SIGTERM at step 2: checkpoint-2, exit 75; resumed, the same losses and bit-identical weights as the
    uninterrupted run: the prompts' order and the sampling's random state come back with the checkpoint."""
    from toolkit.training.stopping import PREEMPTED

    preempt_at(monkeypatch, 2)
    out = tmp_path / "run"
    flags = grpo_flags(out, 4, "--eval_fraction", "0.02", "--save_steps", "2", "--beta", "0.04")
    with pytest.raises(SystemExit) as exit_info:
        run(GRPO, flags, NAME)
    monkeypatch.undo()
    assert exit_info.value.code == PREEMPTED
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    train(GRPO, [*flags, "--resume", "auto"], NAME)
    full, resumed = rank_reports(one_process)[0], rank_reports(out)[0]
    assert resumed["losses"] == full["losses"] and resumed["weights_sha256"] == full["weights_sha256"]
    assert logged(out, "reward")[-2:] == logged(one_process, "reward")[-2:]


REWARDS = """
def raises(prompts, completions, **kwargs):
    raise KeyError("score")

def too_few(prompts, completions, **kwargs):
    return [1.0]

def text(prompts, completions, **kwargs):
    return ["high"] * len(completions)

def later(prompts, completions, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step >= 1:
        raise ZeroDivisionError("division by zero")
    return [0.5] * len(completions)

def silent(prompts, completions, **kwargs):
    return [None] * len(completions)

def goes_silent(prompts, completions, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step >= 1:
        return [None] * len(completions)
    return [float(len(str(c)) % 3) for c in completions]
"""


@pytest.mark.parametrize(
    "function, key",
    [
        ("raises", r"reward .*:raises raised KeyError: 'score' \(called on the first 2 prompts before training\)"),
        ("too_few", r"reward .*:too_few returned 1 values for 2 completions"),
        ("text", r"reward .*:text returned 'high' \(str\): each reward must be a number"),
        ("silent", r"reward .*:silent returned None for all 2 probed completions .*nothing to learn from"),
    ],
)
def test_a_reward_that_fails_before_training_is_one_line(function, key, tmp_path, capsys):
    """Each reward is called on the first prompts before any weights load: what it does wrong, one line naming it."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(GRPO, grpo_flags(out, 2, "--reward_funcs", f"{tmp_path / 'rewards.py'}:{function}"), NAME)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and __import__("re").search(key, errors[0]), errors
    assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*"))


def test_a_reward_that_fails_during_training_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys):
    """A reward that raises at step 2: one line naming it and what it raised; checkpoint-1 stays as it was."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(GRPO, grpo_flags(out, 3, "--reward_funcs", f"{tmp_path / 'rewards.py'}:later", "--save_strategy", "steps",
                             "--save_steps", "1"), NAME)  # fmt: skip
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: reward {tmp_path / 'rewards.py'}:later raised ZeroDivisionError: division by zero"]
    assert "Traceback" not in err
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]


def test_a_reward_that_is_none_for_every_probed_completion_beside_one_that_judges_is_a_warning(capsys):
    """None is no opinion: beside a reward that judges, TRL sums the others (nansum), so the probe only warns."""
    from toolkit.training.rewards import Checked, check_rewards

    rows = [{"prompt": "What is 1 plus 2?", "answer": "3"}] * 2
    check_rewards([Checked(lambda prompts, completions, **_: [1.0, 0.0], "judges"),
                   Checked(lambda prompts, completions, **_: [None, None], "abstains")], rows)  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: reward abstains returned None for all 2 probed")


def test_rewards_that_turn_none_during_training_stop_the_run(tmp_path, capsys, caplog):
    """Numbers in the probe and at step 1, then None for every completion: one warning at the stretch's first step
    (not one a step), and after NO_REWARD_STEPS such steps the run stops as a diverged one does: one error line,
    exit 3, no checkpoint of the last of them, no export, the summary's status no_rewards."""
    from toolkit.errors import DIVERGED
    from toolkit.training.stopping import NO_REWARD_STEPS

    (tmp_path / "rewards.py").write_text(REWARDS)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(GRPO, grpo_flags(out, 8, "--reward_funcs", f"{tmp_path / 'rewards.py'}:goes_silent", "--save_strategy",
                             "steps", "--save_steps", "1"), NAME)  # fmt: skip
    assert exit_info.value.code == DIVERGED
    last = 1 + NO_REWARD_STEPS
    err = capsys.readouterr().err
    # (mid-run, a line follows the progress bar's)
    assert re.findall(r"warning: step .*", err) == [
        f"warning: step 2: every reward returned None for all 8 completions, so it trains on nothing (no "
        f"advantages); {NO_REWARD_STEPS} such steps in a row stop the run."]  # fmt: skip
    assert "All reward functions returned None" not in err + caplog.text  # TRL's, every such step: said above
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"at steps 2-{last}: there is nothing to learn from" in errors[0], errors
    assert "Traceback" not in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{k}" for k in range(1, last)]
    assert not (out / "adapter_model.safetensors").exists()
    assert json.loads((out / "run_summary.json").read_text())["summary"]["status"] == "no_rewards"


def test_a_grpo_resume_with_another_group_size_is_refused_and_touches_nothing(tmp_path, capsys):
    """A finished 2-step run (2 prompts x 4 completions a step, checkpoint-2, its export) trained on to step 3 with
    --num_generations 2: the same 8 completions a step would be 4 prompts x 2, not the run it continues. One line
    naming num_generations and the value that continues it, exit 2, before any weights load; every file of the
    folder as it was (without the check it trained on, exit 0, and rewrote the export and card)."""
    out = tmp_path / "run"
    train(GRPO, grpo_flags(out, 2, "--save_strategy", "steps", "--save_steps", "2"), NAME)
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    before = {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(GRPO, grpo_flags(out, 3, "--save_strategy", "steps", "--save_steps", "2", "--num_generations", "2",
                             "--resume", "auto"), NAME)  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "num_generations 4; this launch has 2" in errors[0], errors
    assert "Pass --num_generations 4 to continue" in errors[0] and "Traceback" not in err
    after = {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--num_generations", "1"], "num_generations must be at least 2"),
        (["--loss_type", "sigmoid"], r"loss_type 'sigmoid' is not among TRL's GRPO losses \(grpo, dr_grpo, dapo"),
        (["--beta", "-0.1"], "beta must be 0 or more"),
        (["--reward_funcs", "acuracy"], "reward 'acuracy' is neither a built-in one"),
        (["--reward_funcs", "format", "--format_pattern", "None"], "the format reward matches each completion"),
        (["--reward_weights", "1,2,3"], "gives 3 weights for 2 rewards"),
        (["--format_pattern", "(unclosed"], "is not a regular expression"),
        (
            ["--per_device_train_batch_size", "6"],
            r"grpo: generation_batch_size \(6\) must be divisible by "
            r"num_generations \(4\)",
        ),  # fmt: skip
        (["--prompt_column", "question"], "has no column 'question'"),
        (["--reward_funcs", "nowhere_module:f"], "importing nowhere_module failed"),
        (["--use_vllm", "true"], "vLLM, which runs on CUDA GPUs only"),
        (["--max_completion_length", "64"], "leaves no room for the prompt in max_seq_length 64"),
        (["--fused_loss", "false"], "task grpo always scores with TRL's fused head"),
        (["--sampler", "paged"], "sampler must be one of generate, continuous, vllm"),
        (["--sampler", "continuous", "--use_vllm", "true"], "name two samplers: pass one"),
        (
            ["--sampler", "continuous", "--bf16", "true", "--dtype", "float32"],
            "train on in bfloat16. Pass --dtype bfloat16",
        ),
    ],
)
def test_settings_grpo_cannot_take_are_one_line(flags, key, tmp_path):
    """Each refused before a weight loads (an exception here; the runner prints its one line)."""
    with pytest.raises(ToolkitError, match=key):
        train(GRPO, grpo_flags(tmp_path / "run", 2, *flags), NAME)


def test_the_continuous_sampler_samples_what_generate_does_and_trains(tmp_path):
    """--sampler continuous: transformers' continuous batching, its paged cache sized to the generation batch (not
    TRL's half of the device's memory, a CPU's RAM): greedy, each prompt's completion is generate's token for token
    (a toy Qwen3, prompts of different lengths); a tiny GRPO run samples with it, trains and exports."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from toolkit.data.sources import stored_config
    from toolkit.models import tiny
    from toolkit.settings.policy import paged_cache

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny.shrunk_config(stored_config("Qwen/Qwen3-0.6B"), 512)).eval()
    prompts = [torch.randint(10, 512, (n,)).tolist() for n in (5, 17, 9, 30)]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = paged_cache(len(prompts), 30 + 12)
    assert cache["num_blocks"] == 4  # a 64-token page a row
    batched = model.generate_batch(prompts, generation_config=config, progress_bar=False,
                                   continuous_batching_config=ContinuousBatchingConfig(**cache))  # fmt: skip
    for prompt, out in zip(prompts, batched.values(), strict=True):
        alone = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
        assert list(out.generated_tokens) == alone
    out = tmp_path / "run"
    trainer = train(GRPO, grpo_flags(out, 2, "--sampler", "continuous", "--save_strategy", "no"), NAME).trainer
    assert trainer.args.use_transformers_continuous_batching
    assert trainer.args.transformers_continuous_batching_config["num_blocks"] == 8 * 1  # 8 completions, 64 tokens
    assert len(logged(out, "loss")) == 2 and (out / "adapter_model.safetensors").is_file()


def test_the_continuous_sampler_under_bf16_keeps_the_adapter_in_fp32(tmp_path):
    """--sampler continuous --bf16: TRL casts the whole model to bf16 before each sampling, the LoRA adapter (fp32,
    the masters of its updates) with it; the adapter is fp32 again for every training step and in the export."""
    out = tmp_path / "run"
    flags = ["--sampler", "continuous", "--bf16", "true", "--dtype", "bfloat16", "--save_strategy", "no"]
    trainer = train(GRPO, grpo_flags(out, 2, *flags), NAME).trainer
    saved = load_file(out / "adapter_model.safetensors")
    assert saved and {tensor.dtype for tensor in saved.values()} == {torch.float32}
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)


def reward_model_folder(folder: Path, labels: int = 1) -> Path:
    """A toy sequence classifier with its tokenizer, saved as a reward model is (TRL's RewardTrainer: 1 label)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from toolkit.data.conversations import apply_chat_template_setting
    from toolkit.models import tiny

    tokenizer = tiny.tiny_tokenizer("meta-llama/Meta-Llama-3-8B", "sft")
    apply_chat_template_setting(tokenizer, "llama3")  # TRL formats the conversations with it before scoring
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=labels,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_reward_model_scores_beside_a_function(tmp_path):
    """--reward_funcs accuracy,FOLDER: TRL loads the folder's one-label classifier and its tokenizer, and scores every
    completion with it; its mean and spread logged under the folder's name, weighted into the reward."""
    folder = reward_model_folder(tmp_path / "judge")
    out = tmp_path / "run"
    train(GRPO, grpo_flags(out, 2, "--reward_funcs", f"accuracy,{folder}", "--reward_weights", "1,0.5"), NAME)
    judged, right = logged(out, "rewards/judge/mean"), logged(out, "rewards/accuracy/mean")
    assert len(judged) == 2 and all(score != 0 for score in judged)  # a random head's scores: not all zero
    assert logged(out, "reward") == pytest.approx([a + 0.5 * j for a, j in zip(right, judged, strict=True)], abs=1e-5)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "a LlamaForCausalLM, where TRL scores completions by a sequence"),
        ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "bad", "1": "good"}},
         "a LlamaForSequenceClassification with 2 labels, where"),
        ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "score"}}, "has no tokenizer"),
        ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "score"}, "tokenizer": {}},
         "its tokenizer has no chat template, which TRL formats these conversations with"),
    ],
)  # fmt: skip
def test_a_folder_that_cannot_be_a_reward_model_is_one_line(config, key, tmp_path):
    """Checked before any weights load: a language model (TRL would give it a fresh, random score head), a
    classifier of several classes (it would not load with one label), no tokenizer to read the completions with, or
    one without the chat template the (conversational) prompts need."""
    folder = tmp_path / "judge"
    folder.mkdir()
    if "tokenizer" in config:
        (folder / "tokenizer_config.json").write_text(json.dumps(config.pop("tokenizer")))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=key):
        train(GRPO, grpo_flags(tmp_path / "run", 2, "--reward_funcs", str(folder)), NAME)


def test_the_gsm8k_recipe_trains_in_tiny_mode(tmp_path):
    """`make finetune MODEL=qwen3_grpo ARGS=--tiny`, as the recipe documents it: its prompt column (GSM8K's
    question) gives way to the tiny data's, and a toy Qwen3 trains and exports."""
    from qwen3_grpo import RECIPE as QWEN

    out = tmp_path / "qwen"
    train(QWEN, ["--tiny", "--max_steps", "1", "--report_to", "none", "--output_dir", str(out)], "qwen3_grpo")
    assert (out / "model.safetensors").is_file() and len(logged(out, "reward")) == 1


def test_rewards_given_as_lists_async_or_reading_trls_arguments_are_taken():
    """A recipe's lists for reward_funcs and reward_weights; a reward that reads TRL's trainer_state or log_metric,
    or is async, passes the check before training (which stands in TRL's arguments) and returns its numbers."""
    import asyncio

    from toolkit.settings.parser import parse
    from toolkit.training.rewards import Checked, check_rewards

    policy = parse(
        {**GRPO, "reward_funcs": ["accuracy", "format"], "reward_weights": [1, 0.5]}, NAME, ["--tiny"]
    ).policy
    assert policy.rewards() == ["accuracy", "format"] and policy.weights() == [1.0, 0.5]

    def steps(prompts, completions, trainer_state, log_metric, **kwargs):
        log_metric("seen", len(completions))
        return [0.0 if trainer_state is None else float(trainer_state.global_step)] * len(completions)

    async def later(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    rows = [{"prompt": [{"role": "user", "content": "What is 1 plus 2?"}], "answer": "3"}] * 2
    functions = [Checked(steps, "steps"), Checked(later, "later")]
    check_rewards(functions, rows)
    assert functions[1]([r["prompt"] for r in rows], ["3", "4"], [[0], [0]]) == [1.0, 1.0]


def test_an_epoch_of_prompts_is_each_prompt_answered_num_generations_times():
    """The steps an epoch-long GRPO run takes (what a resume's check and the schedule count): TRL's sampler repeats
    each prompt num_generations times, and the batch counts completions."""
    from trl import GRPOConfig

    from toolkit.training.run_plan import planned_steps

    config = GRPOConfig(output_dir="unused", per_device_train_batch_size=8, num_generations=4, use_cpu=True,
                        num_train_epochs=1, report_to=[])  # fmt: skip
    assert planned_steps(config, 10) == 5  # 40 completions, 8 a step


def test_prompts_with_a_length_column_keep_each_prompts_group_together(tmp_path):
    """Prompt data with a `length` column (the toolkit's length-grouped order reads it): the run still samples with
    TRL's RepeatSampler, each prompt num_generations times in a row, so a group holds one prompt's completions (the
    length-grouped sampler fed each prompt once, and TRL's groups of 4 were 4 prompts)."""
    from toolkit.models.tiny_data import prompt_rows

    rows = [dict(row, length=len(row["prompt"][0]["content"])) for row in prompt_rows(64)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    trainer = train(GRPO, grpo_flags(tmp_path / "run", 1, "--dataset_name", str(data), "--save_strategy", "no",
                                     "--record_rank_reports", "false"), NAME).trainer  # fmt: skip
    assert "length" in trainer.train_dataset.column_names
    indices = list(trainer._get_train_sampler(trainer.train_dataset))
    groups = [indices[k : k + 4] for k in range(0, len(indices), 4)]  # num_generations 4 (tiny mode)
    assert len(groups) >= 16 and all(len(set(group)) == 1 for group in groups), groups[:4]
    assert len({group[0] for group in groups[:2]}) == 2  # a step's 2 prompts: 2 of them, 4 completions each
    assert trainer.order.sampler is None  # the length-grouped order was never made


def test_reasoning_gym_problems_are_generated_once_with_their_checker(tmp_path):
    """The demo's source: reasoning-gym's problems as prompts, each question once, with the answer and its
    checker's entry; the accuracy reward scores a right and a wrong answer by that checker; a misspelt task names
    the close one. And the demo's own split: not one held-out problem is among the training ones."""
    from datasets import load_dataset

    from toolkit.data.loading import load_data
    from toolkit.data.sources import resolve
    from toolkit.settings.parser import parse
    from toolkit.settings.policy import PolicyArguments
    from toolkit.training.rewards import reward_functions

    folder = resolve("reasoning_gym:basic_arithmetic?size=8&seed=3&min_digits=1&max_digits=1")
    assert resolve("reasoning_gym:basic_arithmetic?size=8&seed=3&min_digits=1&max_digits=1") == folder
    rows = load_dataset(folder)["train"]
    questions = [prompt[0]["content"] for prompt in rows["prompt"]]
    assert 0 < len(rows) <= 8 and len(set(questions)) == len(rows)  # each question once
    assert rows[0]["prompt"][0]["role"] == "user"
    policy = PolicyArguments(reward_funcs="accuracy")
    policy.resolve("grpo")
    (accuracy,) = reward_functions(policy)
    right = [[{"role": "assistant", "content": f"The answer is {row['answer']}."}] for row in rows]
    wrong = [[{"role": "assistant", "content": f"It is {int(row['answer']) + 1}"}] for row in rows]
    columns = {"answer": rows["answer"], "reasoning_gym": rows["reasoning_gym"]}
    n = len(rows)
    assert accuracy(rows["prompt"], right, [[0]] * n, **columns) == [1.0] * n
    assert accuracy(rows["prompt"], wrong, [[0]] * n, **columns) == [0.0] * n
    with pytest.raises(ConfigError, match="did you mean basic_arithmetic"):
        resolve("reasoning_gym:basic_arithmatic")
    split, _ = load_data(parse(GRPO, NAME, []).data)  # the demo's data, as its run reads and splits it
    seen = {prompt[0]["content"] for prompt in split["train"]["prompt"]}
    assert len(split["eval"]) == 61 and not seen & {prompt[0]["content"] for prompt in split["eval"]["prompt"]}


def test_accuracy_without_reasoning_gym_asks_math_verify():
    """A plain `answer` column (GSM8K's last number): math-verify judges equal values written differently."""
    from toolkit.training.rewards import accuracy_reward

    accuracy = accuracy_reward(r"-?\d[\d,]*(?:\.\d+)?")
    answers = ["1234", "0.5", "7"]
    said = ["so 1,234 apples", "half: 0.50", "eight: 8"]
    assert accuracy([""] * 3, said, [[0]] * 3, answer=answers) == [1.0, 1.0, 0.0]


REPLAY = str(ROOT / "tests" / "grpo_replay.py") + ":replay"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> Path:
    """The 1-process run on replayed completions (tests/grpo_replay.py), 2 prompts x 4 a step."""
    out = tmp_path_factory.mktemp("grpo") / "replayed"
    return reference_run(NAME, grpo_flags(out, 3, "--rollout_func", REPLAY), out)


@pytest.fixture(scope="module")
def replayed_full(tmp_path_factory) -> Path:
    """The same, fine-tuning every weight (--use_lora false)."""
    out = tmp_path_factory.mktemp("grpo") / "replayed_full"
    return reference_run(NAME, grpo_flags(out, 3, "--rollout_func", REPLAY, "--use_lora", "false"), out)


@pytest.mark.launch
@pytest.mark.parametrize(("config", "lora"), [("ddp", True), ("zero2", False), ("zero3", True), ("fsdp2", True)])
def test_two_processes_train_as_one_on_the_same_completions(config, lora, request, tmp_path):
    """2 processes (DDP, ZeRO-3, FSDP2 with the LoRA adapter; ZeRO-2 fine-tuning every weight), a prompt's whole
    group on each rank (4 completions of 1 prompt), the same completions as the 1-process run (replayed; sampling
    differs with how rows are split): the same rewards and losses each step, the same exported weights. Each rank
    trained on its own prompt's completions."""
    replayed = request.getfixturevalue("replayed" if lora else "replayed_full")
    out = tmp_path / "run"
    flags = grpo_flags(out, 3, "--rollout_func", REPLAY, "--per_device_train_batch_size", "4",
                       "--use_lora", str(lora).lower())  # fmt: skip
    check(launch(config, NAME, *flags, cwd=tmp_path))
    reports = rank_reports(out)
    assert len(reports) == 2 and all(len(r["rows"]) == 3 * 4 for r in reports)
    assert not set(reports[0]["rows"]) & set(reports[1]["rows"])
    assert sorted(reports[0]["rows"] + reports[1]["rows"]) == sorted(rank_reports(replayed)[0]["rows"])
    assert logged(out, "reward") == pytest.approx(logged(replayed, "reward"), abs=1e-6)
    assert logged(out, "loss") == pytest.approx(logged(replayed, "loss"), rel=1e-4, abs=1e-6)
    exported = "adapter_model.safetensors" if lora else "model.safetensors"
    ours, reference = load_file(out / exported), load_file(replayed / exported)
    assert sorted(ours) == sorted(reference)
    # AdamW moves every element by about lr a step (lr x the gradient's sign, whatever its size): where a gradient is
    # near 0, summing it in another order (two ranks' halves) moves that element by a share of lr, or flips it (one
    # of 2,048 moved by 1.2e-5 on a Zen 4 EPYC), so the runs agree on each tensor's update as a whole: apart by at
    # most 1% of its size, lr x steps per element (a rank's gradient left out or counted twice moves them all)
    step_size = RunRecord.read(replayed).settings["learning_rate"] * 3
    for name, value in reference.items():
        apart = float((ours[name] - value).norm())
        assert apart <= 0.01 * step_size * value.numel() ** 0.5, (name, apart)


@pytest.mark.parametrize("config", ["tp", "pp", "zero3_sp"])
def test_configs_grpo_cannot_run_on_are_one_line(config, capsys):
    from toolkit.distributed.launch_check import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(ROOT / "accelerate_configs" / f"{config}.yaml"), str(ROOT / "recipes" / f"{NAME}.py")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "under grpo: TRL's GRPOTrainer samples completions" in err
