"""The trainer's parts compose with another Trainer subclass, not only with transformers.Trainer: stacked on TRL's
SFTTrainer (which overrides training_step, log and the loss itself), a run gets the toolkit's header and plan,
live metrics, a checkpoint published whole with its owner and cost, and the end-of-run summary."""

from __future__ import annotations

import json

import pytest
from llama3_fft import RECIPE as LLAMA3_FFT

from toolkit.models.counts import ParameterCounts
from toolkit.models.tiny import tiny_layer
from toolkit.outputs import OWNER
from toolkit.settings.parser import parse
from toolkit.training.trainer import RecipeTrainer, ToolkitTrainerMixin

trl = pytest.importorskip("trl")


def test_parts_compose_with_trls_sft_trainer(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data.loading import load_raw
    from toolkit.data.preparation import prepare

    class ToolkitSFTTrainer(ToolkitTrainerMixin, trl.SFTTrainer):
        pass

    assert ToolkitSFTTrainer.training_step is RecipeTrainer.training_step  # the parts' own, in front of TRL's
    flags = ["--tiny", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none",
             "--output_dir", str(tmp_path), "--packing", "false"]  # fmt: skip
    arguments = parse(LLAMA3_FFT, "llama3_fft", flags, tiny_defaults=tiny_layer)
    tokenizer = AutoTokenizer.from_pretrained(arguments.model.model_name_or_path)
    data = prepare(load_raw(arguments.data), tokenizer, arguments.data, arguments.training.main_process_first)
    model = AutoModelForCausalLM.from_pretrained(arguments.model.model_name_or_path)
    config = trl.SFTConfig(**{**arguments.training.to_dict(), "max_length": arguments.data.max_seq_length,
                              "dataset_num_proc": None})  # fmt: skip
    trainer = ToolkitSFTTrainer(model=model, args=config, train_dataset=data.train.select_columns(["input_ids"]),
                                processing_class=tokenizer, arguments=arguments,
                                param_counts=ParameterCounts.of(model))  # fmt: skip
    trainer.train()
    trainer.end_of_run("completed", {})

    out = capsys.readouterr().out
    assert "memory plan" in out and "sharding      none (single process)" in out  # the run's own plan and header
    logged = [line for line in trainer.state.log_history if "loss" in line]
    assert len(logged) == 4 and all(line["tokens_per_second"] > 0 and "cost_usd" in line for line in logged)
    assert (tmp_path / "run_log.jsonl").read_text().count("\n") == len(trainer.state.log_history)
    checkpoints = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2", "checkpoint-4"] and not (tmp_path / ".staging" / "checkpoint-4").exists()
    owner = json.loads((tmp_path / "checkpoint-4" / OWNER).read_text())
    assert owner["recipe"] == "llama3_fft" and owner["engine"] == "replicated"
    assert json.loads((tmp_path / "checkpoint-4" / "toolkit_cost.json").read_text())["usd"] > 0
    summary = json.loads((tmp_path / "run_summary.json").read_text())["summary"]
    assert summary["status"] == "completed" and summary["steps"] == 4 and summary["tokens"] > 0
