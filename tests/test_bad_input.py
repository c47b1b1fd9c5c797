"""Bad input is one line naming the fix, exit code 2, no traceback, and nothing already trained is touched: a table
of mistakes across recipes, flags, YAML overrides, data files, model folders, strategy files, every command, and
1- and 2-process launches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from bert import RECIPE as BERT
from conftest import BIN, ROOT, free_port, run_cmd
from llama3_fft import RECIPE as LLAMA3_FFT
from llama3_lora import RECIPE as LLAMA3_LORA

from toolkit import run, train
from toolkit.models import tiny
from toolkit.project import load_recipe

RECIPES = {"bert": BERT, "llama3_fft": LLAMA3_FFT, "llama3_lora": LLAMA3_LORA}
TRAINED = ["--tiny", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none"]
BERT_TINY, LLAMA_TINY = "google-bert/bert-base-cased", "meta-llama/Meta-Llama-3-8B"

CONVERSATION = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "2 plus 2 is 4."}]


def jsonl(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def chats(bad: list) -> str:
    """Two good conversations, then the bad one (row 2)."""
    return jsonl([{"messages": CONVERSATION}] * 2 + [{"messages": bad}])


FILES = {  # name -> text; written once per module into `files`
    "empty.jsonl": "",
    "header_only.csv": "text,label\n",
    "empty_list.json": "[]\n",
    "truncated.jsonl": jsonl([{"text": "a fine film", "label": 1}]) + '{"text": "a dull fi',
    "data.txt": "a fine film\n",
    "sentences.jsonl": jsonl([{"sentence": "a fine film", "label": 1}] * 4),
    "label_null.jsonl": jsonl([{"text": "a fine film", "label": 1}, {"text": "a dull film", "label": None}]),
    "text_null.jsonl": jsonl([{"text": "a fine film", "label": 1}, {"text": None, "label": 0}]),
    "content_null.jsonl": chats([CONVERSATION[0], {"role": "assistant", "content": None}]),
    "sharegpt_roles.jsonl": chats([{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]),
    "sharegpt_keys.jsonl": chats([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]),
    "empty_conversation.jsonl": chats([]),
    "no_assistant.jsonl": chats([CONVERSATION[0]]),
    "bad.yaml": "learning_rate: [1e-5\n",
    "list.yaml": "- learning_rate\n",
    "typo.yaml": "learning_rat: 1e-5\n",
    "wrong_type.yaml": "learning_rate: fast\n",
    "lora_r_0.yaml": "lora_r: 0\n",
    "notes.txt": "not a folder\n",
    "messages_text.jsonl": jsonl([{"messages": "Hello there"}] * 3),
    "two_processes.yaml": "distributed_type: MULTI_GPU\nnum_processes: two\nuse_cpu: true\n",
    "mixed_formats.jsonl": jsonl([{"messages": CONVERSATION}, {"prompt": "2 + 2?", "completion": "4"}]),
    "tp_0.yaml": "distributed_type: MULTI_GPU\nnum_processes: 2\nparallelism_config:\n"
    "  parallelism_config_tp_size: 0\n",
    "sp_backend.yaml": "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: "
    "ds_configs/zero3.json\nparallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: "
    "megatron\n",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-input")
    paths = {}
    for name, text in FILES.items():
        (root / name).write_text(text)
        paths[name] = str(root / name)
    latin = root / "latin1" / "sport"  # a folder of class subfolders whose text is not utf-8
    latin.mkdir(parents=True)
    (latin / "001.txt").write_bytes("Caf\xe9 wins the derby".encode("latin-1"))
    (root / "latin1" / "tech").mkdir()
    (root / "latin1" / "tech" / "001.txt").write_text("a new phone")
    paths["latin1"] = str(root / "latin1")
    bert = tiny.tiny_checkpoint(BERT_TINY, "classification")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    for name, dropped in {"no_weights": ("model.safetensors",), "no_tokenizer": tokenizer_files}.items():
        shutil.copytree(bert, root / name)
        for file in dropped:
            (root / name / file).unlink(missing_ok=True)
        paths[name] = str(root / name)
    (root / "no_config").mkdir()
    paths["no_config"] = str(root / "no_config")
    for name, edit in {"unknown_type": lambda c: {**c, "model_type": "bert_from_the_future"},
                       "bad_config": None}.items():  # fmt: skip
        shutil.copytree(bert, root / name)
        config = root / name / "config.json"
        config.write_text(json.dumps(edit(json.loads(config.read_text()))) if edit else '{"model_type": "bert", ')
        paths[name] = str(root / name)
    (root / "no_data_files").mkdir()
    (root / "no_data_files" / "README.md").write_text("the data is elsewhere\n")
    paths["no_data_files"] = str(root / "no_data_files")
    from transformers import DebertaV2Config, Gemma2Config, T5Config

    # Gemma-2 has no sdpa attention (asked for by a flag); DeBERTa-v2 has no causal-LM head; T5 is
    # an encoder-decoder, which the toolkit does not train.
    Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16).save_pretrained(root / "gemma2")  # fmt: skip
    DebertaV2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4).save_pretrained(root / "deberta")  # fmt: skip
    T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16).save_pretrained(root / "t5")
    paths.update({name: str(root / name) for name in ("gemma2", "deberta", "t5")})
    paths["classification_rows"] = str(tiny.write_tiny_dataset("classification"))
    paths["chat_rows"] = str(tiny.write_tiny_dataset("sft"))
    paths["missing.jsonl"] = str(root / "missing.jsonl")
    return paths


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """An output folder per recipe that a finished tiny run left: checkpoints, the final model, its logs."""
    folders = {}
    for name, recipe in RECIPES.items():
        folders[name] = tmp_path_factory.mktemp(f"trained-{name}") / "run"
        train(recipe, [*TRAINED, "--output_dir", str(folders[name])], name)
    return folders


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def assert_one_clear_line(output: str, key: str) -> None:
    lines = error_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert key in lines[0], lines[0]
    assert "Traceback" not in output, output[-3000:]


# (id, recipe, flags, key word of the fix). {name} is a path from FILES / the fixture. Runs are --tiny, on the
# tiny data, and resume into a folder their recipe already trained into, which must come out untouched; a run
# that brings its own model folder is not tiny (tiny mode would build a toy copy of it) and starts afresh.
RUNS = [
    ("learning-rate", "bert", ["--learning_rate", "-1"], "pass 2e-5"),
    ("lora-norm-target", "llama3_lora", ["--lora_target_modules", "q_proj,norm"], "LoRA adapts linear, embedding"),
    ("mixed-formats", "llama3_fft", ["--dataset_name", "{mixed_formats.jsonl}"], "one format per data set"),
    ("batch-size-0", "bert", ["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be at least 1"),
    ("accumulation-0", "bert", ["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps must be at least"),
    ("epochs-0", "bert", ["--max_steps", "-1", "--num_train_epochs", "0"], "--num_train_epochs 1"),
    ("warmup-negative", "bert", ["--warmup_steps", "-1"], "warmup_steps >= 0"),
    ("weight-decay-negative", "bert", ["--weight_decay", "-0.1"], "pass 0"),
    ("dtype-typo", "bert", ["--dtype", "bf17"], "--dtype bfloat16"),
    ("lora-r-0", "llama3_lora", ["--lora_r", "0"], "lora_r must be at least 1"),
    ("liger-on-cpu", "llama3_fft", ["--use_liger_kernel", "true"], "Triton kernels for a GPU"),
    ("lora-alpha-0", "llama3_lora", ["--lora_alpha", "0"], "twice lora_r"),
    ("lora-dropout", "llama3_lora", ["--lora_dropout", "1.5"], "pass 0.05"),
    ("lora-targets", "llama3_lora", ["--lora_target_modules", "q_projx"], "q_proj"),
    ("lora-targets-empty", "llama3_lora", ["--lora_target_modules", ","], "all-linear"),
    ("seq-length-0", "llama3_fft", ["--max_seq_length", "0"], "max_seq_length must be at least 1"),
    ("eval-fraction", "bert", ["--eval_fraction", "1.5"], "--eval_split"),
    ("max-train-samples-0", "bert", ["--max_train_samples", "0"], "leave it unset"),
    ("task", "bert", ["--task", "regression"], "task must be one of 'classification', 'sft', 'dpo'"),
    ("pricing", "bert", ["--pricing", "spot2"], "'on_demand' or 'spot'"),
    ("budget-negative", "bert", ["--budget_usd", "-5"], "budget_usd must be positive"),
    ("overhead", "bert", ["--cost_overhead", "0.5"], "at least 1"),
    ("lr-reference-0", "bert", ["--lr_reference_batch_size", "0"], "lr_reference_batch_size must be at least 1"),
    ("gpu-type", "bert", ["--gpu_type", "H900"], "Known:"),
    ("flag-typo", "bert", ["--learning_rat", "0.1"], "Did you mean '--learning_rate'"),
    ("flag-choice", "bert", ["--optim", "adamw_bogus"], "choose from 'adamw_torch'"),
    ("flag-type", "bert", ["--max_steps", "lots"], "invalid int value"),
    ("save-steps-0", "bert", ["--save_strategy", "steps", "--save_steps", "0"], "pass --save_steps N"),
    ("save-no-and-steps", "bert", ["--save_strategy", "no", "--save_steps", "2"], "drop save_strategy no"),
    ("eval-without-data", "bert", ["--eval_strategy", "steps"], "--eval_fraction 0.1"),
    ("best-metric", "bert", ["--metric_for_best_model", "f1"], "--metric_for_best_model accuracy"),
    ("best-without-eval", "llama3_fft", ["--load_best_model_at_end", "true"], "tiny mode turns the"),
    ("attention-name", "bert", ["--attn_implementation", "fast"], "--attn_implementation sdpa"),
    ("flash-attention-missing", "llama3_fft", ["--attn_implementation", "flash_attention_2"], "pip install flash-attn"),
    ("flash-attention-3-missing", "llama3_fft", ["--attn_implementation", "flash_attention_3"], "vllm-flash-attn3"),
    ("flash-attention-4-missing", "llama3_fft", ["--attn_implementation", "flash_attention_4"], "flash-attn-4"),
    ("hub-kernel-missing", "llama3_fft", ["--attn_implementation", "kernels-community/flash-attn2"], "install kernels"),
    ("compile-backend", "llama3_fft", ["--torch_compile_backend", "inductorr"], "--torch_compile_backend inductor"),
    ("compile-mode", "llama3_fft", ["--torch_compile_mode", "fastest"], "pass --torch_compile_mode default"),
    (
        "sdpa-unsupported",
        "llama3_fft",
        ["--model_name_or_path", "{gemma2}", "--attn_implementation", "sdpa"],
        "--attn_implementation eager",
    ),
    ("flex-on-cpu", "llama3_fft", ["--attn_implementation", "flex_attention"], "pass --attn_implementation sdpa"),
    ("encoder-for-sft", "llama3_fft", ["--model_name_or_path", "{deberta}"], "--task classification"),
    ("encoder-decoder", "bert", ["--model_name_or_path", "{t5}"], "encoder-decoder"),
    ("model-missing", "bert", ["--model_name_or_path", "/nonexistent/model"], "pass an existing path"),
    ("model-no-config", "bert", ["--model_name_or_path", "{no_config}"], "save_pretrained"),
    ("model-no-weights", "bert", ["--model_name_or_path", "{no_weights}"], "model.save_pretrained"),
    ("model-no-tokenizer", "bert", ["--model_name_or_path", "{no_tokenizer}"], "tokenizer.save_pretrained"),
    ("model-unknown-type", "bert", ["--model_name_or_path", "{unknown_type}"], "model_type 'bert_from_the_future'"),
    ("model-config-not-json", "bert", ["--model_name_or_path", "{bad_config}"], "not a valid JSON file"),
    ("output-is-a-file", "bert", ["--output_dir", "{notes.txt}"], "pass a folder with --output_dir"),
    ("resume-nowhere", "bert", ["--resume", "/nowhere"], "--resume auto"),
    ("merge-without-lora", "bert", ["--merge_lora", "true"], "set use_lora true"),
    ("packing-classification", "bert", ["--packing", "true"], "drop it"),
    ("other-recipes-folder", "bert", ["--output_dir", "{trained:llama3_fft}"], "another --output_dir"),
    ("resume-other-recipe", "llama3_lora", ["--resume", "{trained:llama3_fft}/checkpoint-4"], "recipe llama3_fft"),
    ("data-missing", "bert", ["--dataset_name", "{missing.jsonl}"], "pass an existing path with --dataset_name"),
    ("data-empty", "bert", ["--dataset_name", "{empty.jsonl}"], "point --dataset_name at a file with rows"),
    ("data-header-only", "bert", ["--dataset_name", "{header_only.csv}"], "point --dataset_name at a file with rows"),
    ("data-empty-list", "bert", ["--dataset_name", "{empty_list.json}"], "point --dataset_name at a file with rows"),
    ("data-truncated", "bert", ["--dataset_name", "{truncated.jsonl}"], "fix that row"),
    ("data-format", "bert", ["--dataset_name", "{data.txt}"], "use one of"),
    ("data-folder-without-files", "bert", ["--dataset_name", "{no_data_files}"], "folder of .csv, .json"),
    ("data-column", "bert", ["--dataset_name", "{sentences.jsonl}"], "--text_columns"),
    ("data-label-null", "bert", ["--dataset_name", "{label_null.jsonl}"], "--skip_bad_rows"),
    ("data-text-null", "bert", ["--dataset_name", "{text_null.jsonl}"], "row 1 of the train split"),
    ("data-encoding", "bert", ["--dataset_name", "{latin1}"], "--text_encoding"),
    ("data-split", "bert", ["--eval_split", "test"], "has no split 'test'"),
    ("chat-content-null", "llama3_fft", ["--dataset_name", "{content_null.jsonl}"], "row 2"),
    ("chat-sharegpt-roles", "llama3_fft", ["--dataset_name", "{sharegpt_roles.jsonl}"], "'human': 'user'"),
    ("chat-sharegpt-keys", "llama3_fft", ["--dataset_name", "{sharegpt_keys.jsonl}"], "role/content"),
    ("chat-empty", "llama3_fft", ["--dataset_name", "{empty_conversation.jsonl}"], "--skip_bad_rows"),
    ("chat-no-assistant", "llama3_fft", ["--dataset_name", "{no_assistant.jsonl}"], "--skip_bad_rows"),
    ("chat-messages-text", "llama3_fft", ["--dataset_name", "{messages_text.jsonl}"], "holds text, not a list"),
    ("chat-column", "llama3_fft", ["--messages_column", "conversations"], "--messages_column"),
    ("chat-template-name", "llama3_fft", ["--chat_template", "llama4"], "--chat_template llama3"),
    ("yaml-missing", "bert", ["--config", "{missing.jsonl}"], "Config file not found"),
    ("yaml-invalid", "bert", ["--config", "{bad.yaml}"], "not valid YAML"),
    ("yaml-not-a-mapping", "bert", ["--config", "{list.yaml}"], "must be a mapping"),
    ("yaml-typo", "bert", ["--config", "{typo.yaml}"], "Did you mean 'learning_rate'"),
    ("yaml-wrong-type", "bert", ["--config", "{wrong_type.yaml}"], "learning_rate"),
    ("yaml-lora-r-0", "llama3_lora", ["--config", "{lora_r_0.yaml}"], "lora_r must be at least 1"),
]


def fill(flags: list[str], files: dict[str, str], trained: dict[str, Path]) -> list[str]:
    out = []
    for flag in flags:
        if flag.startswith("{trained:"):  # a trained folder, or a path inside it: {trained:bert}/checkpoint-4
            name, _, inside = flag[9:].partition("}")
            flag = str(trained[name]) + inside
        elif flag.startswith("{"):
            flag = files[flag[1:-1]]
        out.append(flag)
    return out


def own_model(recipe: str, files: dict[str, str]) -> list[str]:
    """The flags a recipe needs to run on a model folder of one's own, offline: the tiny data."""
    if recipe == "bert":
        return ["--dataset_name", files["classification_rows"], "--text_columns", "text", "--eval_split", "None"]
    return ["--dataset_name", files["chat_rows"], "--eval_split", "None", "--chat_template", "llama3"]


@pytest.mark.parametrize(("case", "recipe", "flags", "key"), RUNS, ids=[r[0] for r in RUNS])
def test_a_bad_run_is_one_line_and_touches_nothing(case, recipe, flags, key, files, trained, tmp_path, capsys):
    fresh = "--model_name_or_path" in flags
    out = tmp_path / "run"
    if not fresh:
        shutil.copytree(trained[recipe], out)
    before = listing(out) if out.exists() else None
    others = {name: listing(folder) for name, folder in trained.items()}
    common = own_model(recipe, files) if fresh else ["--tiny", "--resume", "auto"]
    with pytest.raises(SystemExit) as exit_info:
        run(RECIPES[recipe], ["--report_to", "none", "--output_dir", str(out), *common,
                              *fill(flags, files, trained)], recipe)  # fmt: skip
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, key)
    assert (listing(out) if out.exists() else None) == before  # nothing trained, written or rotated
    assert {name: listing(folder) for name, folder in trained.items()} == others
    assert Path(files["notes.txt"]).read_text() == FILES["notes.txt"]


COMMANDS = [  # (id, command, argv, key word of the fix)
    ("plan-unknown-model", "plan", ["nosuch-org/nosuch-model"], "hub_configs"),
    ("plan-gpus-0", "plan", ["llama3_fft", "--gpus", "0"], "--gpus must be at least 1"),
    ("plan-gpu-type", "plan", ["llama3_fft", "--gpu", "B300"], "Known:"),
    ("plan-wrong-task", "plan", ["{deberta}", "--task", "sft"], "--task classification"),
    ("plan-encoder-decoder", "plan", ["{t5}"], "encoder-decoder"),
    ("check-missing", "check", ["accelerate_configs/nope.yaml"], "accelerate_configs/"),
    ("check-yaml-typo", "check", ["{typo.yaml}"], "Unknown key 'learning_rat'"),
    ("check-recipe", "check", ["accelerate_configs/ddp.yaml", "bertt"], "Known: bert"),
    ("check-wrong-type", "check", ["{two_processes.yaml}"], "num_processes in"),
    ("plan-unknown-type", "plan", ["{unknown_type}"], "model_type 'bert_from_the_future'"),
    ("report-not-a-run", "report", ["{no_config}"], "--output_dir of a finished run"),
    ("launch-missing-config", "launch", ["--config_file", "nope.yaml", "recipes/bert.py"], "accelerate_configs/"),
    (
        "launch-unknown-recipe",
        "launch",
        ["--config_file", "accelerate_configs/ddp.yaml", "recipes/bertt.py"],
        "Known: bert",
    ),
    ("launch-missing-script", "launch", ["my_train.py"], "pass a recipe"),
    # A plain `accelerate launch` of this is refused by its ranks, and accelerate's launcher then adds a traceback of
    # its own and exit code 1 (it re-raises any failed rank: docs/strategies.md#launching); the toolkit's launcher
    # refuses it before any rank starts, in one line, exit 2.
    (
        "launch-pipeline-classification",
        "launch",
        ["--config_file", "accelerate_configs/pp.yaml", "--num_processes", "2", "recipes/bert.py", "--tiny"],
        "a classification recipe is not supported",
    ),
    ("launch-wrong-type", "launch", ["--config_file", "{two_processes.yaml}", "recipes/bert.py"], "an integer, got"),
    ("plan-mfu-negative", "plan", ["llama3_fft", "--mfu", "-0.3"], "--mfu is a share of the GPU's peak"),
    ("plan-epochs-negative", "plan", ["llama3_fft", "--epochs", "-1"], "--epochs must be positive"),
    ("plan-overhead-negative", "plan", ["llama3_fft", "--overhead", "-1"], "--overhead multiplies the cost"),
    ("plan-headroom-1", "plan", ["llama3_fft", "--headroom", "1"], "from 0 to below 1"),
    ("plan-gpu-not-plannable", "plan", ["llama3_fft", "--gpu", "cpu"], "pass one of RTX-3090"),
    ("check-mesh-size-0", "check", ["{tp_0.yaml}"], "tp_size must be at least 1"),
    ("check-sp-backend", "check", ["{sp_backend.yaml}"], "sp_backend must be one of ['deepspeed']"),
]


@pytest.mark.parametrize(("case", "name", "argv", "key"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_bad_command_is_one_line(case, name, argv, key, files, capsys, monkeypatch):
    from toolkit.__main__ import entry

    monkeypatch.chdir(ROOT)
    try:
        code = entry(name)(fill(argv, files, {}))
    except SystemExit as exit_info:  # as argparse ends; `report` returns its code
        code = exit_info.code
    assert code == 2
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, key)


def test_plan_takes_families_it_has_no_special_case_for(files, capsys):
    """GPT-2 names its MLP width n_inner and OPT ffn_dim: the planner reads it off the model instead of raising."""
    from transformers import GPT2Config, OPTConfig

    from toolkit.planner.cli import main

    for config, parameters in ((GPT2Config(architectures=["GPT2LMHeadModel"]), "124,439,808"), (OPTConfig(), None)):
        folder = Path(files["no_config"]).parent / config.model_type
        config.save_pretrained(folder)
        assert main([str(folder), "--gpus", "1"]) == 0
        out = capsys.readouterr().out
        assert "(task sft)" in out and "recommended:" in out
        assert parameters is None or f"parameters  {parameters} total" in out  # GPT-2's published count, tied


def refused(recipe, argv, capsys, tmp_path) -> str:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(recipe, [*argv, "--report_to", "none", "--output_dir", str(out)], "bert")
    assert exit_info.value.code == 2
    assert not out.exists()  # nothing trained or written
    return capsys.readouterr().err


def test_max_seq_length_above_the_model_limit(capsys, tmp_path):
    err = refused(BERT, ["--tiny", "--max_seq_length", "4096"], capsys, tmp_path)
    assert "max_seq_length 4096 is above the model's 512 positions" in err and "--max_seq_length 512 or less" in err


def test_remote_code_needs_consent(capsys, tmp_path):
    """A model whose config asks to run code from its repository: refused until --trust_remote_code true."""
    folder = tmp_path / "custom"
    shutil.copytree(tiny.tiny_checkpoint("google-bert/bert-base-cased", "classification"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_custom_bert", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    err = refused({**BERT, "model_name_or_path": str(folder)}, ["--max_steps", "1"], capsys, tmp_path)
    assert "runs its own model code from its repository" in err and "--trust_remote_code true" in err


def test_rows_skipped_on_request_are_counted(files, tmp_path, capsys):
    """--skip_bad_rows: the unusable conversation is left out, counted, and the rest trains."""
    result = train(LLAMA3_FFT, ["--tiny", "--report_to", "none", "--max_steps", "1", "--dataset_name",
                                files["no_assistant.jsonl"], "--skip_bad_rows", "true", "--packing", "false",
                                "--output_dir", str(tmp_path / "run")], "llama3_fft")  # fmt: skip
    assert len(result.trainer.train_dataset) == 2
    err = capsys.readouterr().err
    assert (
        f"left out 1 of 3 rows of the train split of {files['no_assistant.jsonl']} (--skip_bad_rows); the first, "
        "row 2: it has no assistant" in err
    )


def test_liger_on_a_gpu_without_its_package_names_the_extra(monkeypatch, tmp_path):
    """On a GPU the missing package is the fix (this machine has none, so that path is reached with CUDA faked)."""
    import importlib.util

    import torch
    from transformers import TrainingArguments

    from toolkit.errors import ConfigError
    from toolkit.settings.arguments import check_training

    training = TrainingArguments(str(tmp_path), use_liger_kernel=True, report_to="none")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else found(name))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[liger\]'"):
        check_training(training)


def test_a_hub_id_without_the_push_is_one_warning(capsys):
    """--hub_model_id alone pushes nothing: said in one line, with the flag that would."""
    from toolkit.settings.parser import parse

    parse(BERT, "bert", ["--hub_model_id", "me/bert-sst2"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "--push_to_hub true" in lines[0] and "me/bert-sst2" in lines[0], lines
    parse(BERT, "bert", [])
    assert "hub_model_id" not in capsys.readouterr().err


def test_a_compile_backend_or_mode_turns_compile_on_and_off_is_off():
    """transformers' rule: a backend or a mode asks for compile, which `auto` would have turned off on a CPU while
    the Trainer still handed the backend to accelerate (the model compiled under a header saying "off")."""
    from toolkit.settings.compile import set_compile
    from toolkit.settings.parser import parse

    assert parse(LLAMA3_FFT, "llama3_fft", ["--torch_compile_backend", "eager"]).torch_compile is True
    assert parse(LLAMA3_FFT, "llama3_fft", ["--torch_compile_mode", "default"]).torch_compile is True
    args = parse(LLAMA3_FFT, "llama3_fft", ["--torch_compile", "false", "--torch_compile_backend", "eager"])
    assert args.torch_compile is False
    set_compile(args.training, False)
    assert args.training.torch_compile_backend is None and args.training.torch_compile_mode is None


def test_flash_attention_comes_from_the_hub_on_a_gpu_with_kernels(monkeypatch):
    """Without its package, transformers loads FlashAttention's kernel from the Hub through `kernels`: taken on a GPU,
    refused without one (this machine has neither, so `kernels` is faked)."""
    import transformers.utils

    from toolkit.errors import ConfigError
    from toolkit.models.attention import check_installed

    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda: True)
    check_installed("flash_attention_3", on_gpu=True)
    check_installed("kernels-community/flash-attn2", on_gpu=False)
    with pytest.raises(ConfigError, match="needs FlashAttention 3 .* and a GPU"):
        check_installed("flash_attention_3", on_gpu=False)


def owned_checkpoint(folder: Path, owner: dict) -> Path:
    folder.mkdir(parents=True)
    record = {"engine": "replicated", "pipeline_stages": 1, "world_size": 1, "global_batch_size": 8}
    (folder / "toolkit_run.json").write_text(json.dumps({**owner, **record}))
    return folder


def test_a_checkpoint_of_another_model_is_not_resumed(files, tmp_path):
    """The checkpoint's recipe and model (toolkit_run.json), or without that record its config.json's architecture
    against the model's: refused before any weight loads, where the optimizer's groups would fail to match."""
    from transformers import LlamaConfig

    from toolkit.errors import ConfigError
    from toolkit.training.resume import check_resumable

    def resumable(checkpoint: Path, model: str) -> str:
        return check_resumable(checkpoint, "replicated", 1, 8, 1, {"recipe": "llama3_fft", "model": model})

    owned = owned_checkpoint(tmp_path / "owned" / "checkpoint-4", {"recipe": "llama3_fft", "model": "/models/a"})
    assert resumable(owned, "/models/a") == ""
    with pytest.raises(ConfigError, match="model /models/a.*pass --model_name_or_path /models/a"):
        resumable(owned, "/models/b")
    plain = tmp_path / "plain" / "checkpoint-4"  # a plain Trainer's: no toolkit_run.json, its config.json
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(plain)  # fmt: skip
    with pytest.raises(ConfigError, match="model_type llama.*gemma2"):
        resumable(plain, files["gemma2"])
    assert resumable(plain, str(plain)) == ""  # the same architecture


def test_dtype_aliases_people_type_are_accepted():
    from toolkit.settings.parser import parse

    assert parse(BERT, "bert", ["--dtype", "bf16"]).model.dtype == "bfloat16"
    assert parse(BERT, "bert", ["--dtype", "FP32"]).model.dtype == "float32"
    assert parse(LLAMA3_FFT, "llama3_fft", ["--eval_split", "None"]).data.eval_split is None  # unset, not "None"
    assert parse(LLAMA3_FFT, "llama3_fft", ["--chat_template", "none"]).data.chat_template is None  # the tokenizer's


def test_rank_zero_reports_a_shared_mistake_and_a_lone_rank_its_own(monkeypatch, capsys):
    """The launcher ends the job when its first process exits: the other ranks leave rank 0 time to print the
    mistake (a race CI lost with 8 ranks), then print it themselves only if still alive (a mistake rank 0 never
    met)."""
    from toolkit import errors

    monkeypatch.setattr(errors, "PEER_GRACE_S", 0.2)
    monkeypatch.setenv("RANK", "0")
    assert errors.report(errors.DataError("bad row")) == 2
    assert capsys.readouterr().err == "error: bad row\n"
    monkeypatch.setenv("RANK", "3")
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    assert errors.report(errors.DataError("bad row")) == 2
    assert slept == [0.2] and capsys.readouterr().err == "error (rank 3): bad row\n"


# Launchers: the same mistakes through `python -m toolkit launch`, make and the SLURM script. One message however many
# processes, the rank's own exit code, and no launcher traceback after it.
def launched(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cmd(cmd, cwd=cwd, env={"TOOLKIT_DEBUG": None, **(env or {})}, timeout=240)


@pytest.mark.launch
@pytest.mark.parametrize("processes", [1, 2])
def test_a_bad_launch_is_one_line_with_its_exit_code(processes, files, trained, tmp_path):
    """A data file cut short, into a folder a 1-process run trained (resumed with the same global batch, 8)."""
    out = tmp_path / "run"
    shutil.copytree(trained["llama3_fft"], out)
    before = listing(out)
    config = "single_gpu" if processes == 1 else "ddp"
    result = launched([str(BIN / "python"), "-m", "toolkit", "launch", "--config_file",
                       f"accelerate_configs/{config}.yaml", "--num_processes", str(processes), "--main_process_port",
                       str(free_port()), "recipes/llama3_fft.py", "--tiny", "--output_dir", str(out), "--resume",
                       "auto", "--per_device_train_batch_size", str(8 // processes), "--dataset_name",
                       files["truncated.jsonl"]], cwd=ROOT)  # fmt: skip
    assert result.returncode == 2
    assert_one_clear_line(result.stdout + result.stderr, "fix that row")
    assert listing(out) == before


@pytest.mark.launch
def test_make_finetune_offline_ends_on_the_toolkits_line(tmp_path):
    """The design card's own command, offline: the toolkit's message and make's exit status, nothing below it."""
    result = launched(["make", "-s", "finetune", "MODEL=bert", "CONFIG=ddp", f"ARGS=--output_dir {tmp_path / 'run'}"],
                      cwd=ROOT, env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert result.returncode == 2
    assert_one_clear_line(result.stdout + result.stderr, "--tiny")
    assert not (tmp_path / "run").exists()


@pytest.mark.launch
def test_slurm_job_with_a_bad_flag_is_one_line(tmp_path):
    """Two "nodes" of one process each through slurm/finetune.sbatch: every rank refuses, rank 0 alone says so."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n")
    (fake_bin / "srun").write_text(
        "#!/usr/bin/env bash\nshift\npids=()\n"
        'for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" & pids+=($!); done\n'
        'status=0; for p in "${pids[@]}"; do wait "$p" || status=$?; done; exit $status\n'
    )
    for tool in fake_bin.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{fake_bin}:{BIN}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_SUBMIT_DIR": str(ROOT), "GPUS_PER_NODE": "1", "MAIN_PORT": str(free_port())}  # fmt: skip
    result = launched(["bash", str(ROOT / "slurm" / "finetune.sbatch"), "accelerate_configs/ddp.yaml",
                       "recipes/bert.py", "--tiny", "--learning_rate", "-1", "--output_dir", str(tmp_path / "run")],
                      cwd=tmp_path, env=env)  # fmt: skip
    assert result.returncode == 2
    assert_one_clear_line(result.stdout + result.stderr, "pass 2e-5")


DAMAGED_RUNS = {  # what is done to a finished run's folder, the command and the key of its one line
    "log-missing": (lambda r: (r / "run_log.jsonl").unlink(), "report", "has no run_log.jsonl"),
    "summary-truncated": (lambda r: (r / "run_summary.json").write_text('{"summary": {"st'), "report",
                          "is not a run's summary"),
    "log-line-broken": (lambda r: (r / "run_log.jsonl").write_text("{}\n{nope\n{}\n"), "report", "line 2 is not JSON"),
    "weights-missing": (lambda r: (r / "model.safetensors").unlink(), "generate", "cannot be loaded"),
    "config-not-json": (lambda r: (r / "config.json").write_text("{x"), "generate", "cannot be loaded"),
    "no-tokenizer": (lambda r: [p.unlink() for p in r.glob("tokenizer*")], "chat", "has no tokenizer files"),
    "checkpoint-without-weights": (lambda r: (r / "checkpoint-4" / "model.safetensors").unlink(), "chat",
                                   "cannot be loaded"),
}  # fmt: skip


@pytest.mark.parametrize("case", DAMAGED_RUNS)
def test_a_damaged_run_folder_is_one_line(case, trained, tmp_path, capsys):
    """report, generate and chat on a run folder that is not whole (a log or summary missing or cut short, a
    checkpoint without weights, a config that is not JSON, no tokenizer files): one line naming what is wrong,
    where each ended in a traceback; a last log line cut short (a run killed as it wrote) is only left out."""
    from toolkit.__main__ import entry

    folder = tmp_path / "run"
    shutil.copytree(trained["llama3_fft"], folder)
    damage, command, key = DAMAGED_RUNS[case]
    damage(folder)
    target = folder / "checkpoint-4" if case.startswith("checkpoint") else folder
    argv = {"report": [str(target), "--output", str(tmp_path / "report")], "generate": [str(target), "--prompt",
            "hi"], "chat": [str(target)]}[command]  # fmt: skip
    try:
        code = entry(command)(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, key)


def test_report_keeps_a_run_whose_last_log_line_was_cut_short(trained, tmp_path):
    from toolkit.metrics.report import load_run

    folder = tmp_path / "run"
    shutil.copytree(trained["llama3_fft"], folder)
    log = (folder / "run_log.jsonl").read_text()
    (folder / "run_log.jsonl").write_text(log + '{"loss": 1.2, "st')
    assert len(load_run(folder).history) == len(load_run(trained["llama3_fft"]).history)


def test_report_output_naming_a_file_is_one_line(trained, tmp_path, capsys):
    from toolkit.metrics.report import main

    (tmp_path / "taken").write_text("")
    assert main([str(trained["llama3_fft"]), "--output", str(tmp_path / "taken")]) == 2
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, "is a file: pass a folder")


@pytest.mark.parametrize(("text", "key"), [("RECIPE = dict(\n  task='sft',\n", "does not import: '(' was never closed"),
                                           ("OTHER = 1\n", "defines no RECIPE dict")])  # fmt: skip
def test_a_recipe_file_that_does_not_import_is_one_line(text, key, tmp_path, monkeypatch, capsys):
    """`toolkit check`, `plan` and `launch` with a recipe file that has a syntax error or no RECIPE."""
    import toolkit.project
    from toolkit.__main__ import entry

    recipes = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    (recipes / "mine.py").write_text(text)
    monkeypatch.setattr(toolkit.project, "RECIPES", recipes)
    for command, argv in {"check": [str(ROOT / "accelerate_configs" / "ddp.yaml"), "mine"], "plan": ["mine"],
                          "launch": ["--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
                                     str(recipes / "mine.py")]}.items():  # fmt: skip
        try:
            code = entry(command)(argv)
        except SystemExit as exit_info:
            code = exit_info.code
        assert code == 2, command
        captured = capsys.readouterr()
        assert_one_clear_line(captured.out + captured.err, key)


@pytest.mark.parametrize("command", ["eval", "push", "report", "check", "mesh", "plan"])
def test_each_commands_help_says_what_it_does_in_whole_sentences(command, capsys):
    """`toolkit eval --help` read "the fine-tuned model against the one": each command's description was its
    docstring's first line, cut mid-sentence. Now its first paragraph, ending where a sentence ends."""
    from toolkit.__main__ import entry

    with pytest.raises(SystemExit) as exit_info:
        entry(command)(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    description = " ".join(help_text.split("\n\n")[1].split())  # after the usage block
    assert description.endswith((".", ")")), description


TOOL_NAMED_CALCULATOR = '''
def calculator(expression: str) -> str:
    """My own calculator.

    Args:
        expression: Anything.
    """
    return expression
'''


def silent_mistake(case: str, tmp_path: Path, monkeypatch) -> tuple[str, list[str]]:
    """The recipe and flags of a mistake that ended in a traceback or in silence, its files written under
    tmp_path and its environment set."""
    if case == "memory-limit-inf":  # int(float('inf')) was an OverflowError once the weights had loaded
        monkeypatch.setenv("TOOLKIT_MEMORY_LIMIT_GIB", "inf")
        return "llama3_fft", ["--per_device_train_batch_size", "auto"]
    if case == "profile-past-the-end":  # the window never opened: no trace, no word
        return "llama3_fft", ["--max_steps", "4", "--profile", "6-8"]
    if case == "dropout-on-a-model-without":  # Llama's dropouts are all 0: --dropout set nothing
        return "llama3_fft", ["--dropout", "0.1"]
    if case == "kto-one-label":  # KTO trained on desirable rows alone, TRL's advice on weights its only word
        rows = [{"prompt": "What is 2 plus 2?", "completion": "4", "label": True}] * 8
        (tmp_path / "rows.jsonl").write_text(jsonl(rows))
        return "qwen3_kto", ["--dataset_name", str(tmp_path / "rows.jsonl"), "--eval_fraction", "0"]
    if case == "teacher-a-classifier":  # its score head dropped, a next-token head made up, loaded anyway
        student = tiny.tiny_checkpoint(load_recipe("qwen3_distill")["model_name_or_path"], "distill")
        shutil.copytree(student, tmp_path / "teacher")  # the student's weights and tokenizer, saved as a classifier
        config = tmp_path / "teacher" / "config.json"
        config.write_text(json.dumps(dict(json.loads(config.read_text()),
                                          architectures=["Qwen3ForSequenceClassification"])))  # fmt: skip
        return "qwen3_distill", ["--teacher_model_name_or_path", str(tmp_path / "teacher")]
    assert case == "tool-named-like-a-built-in"  # both offered under one name; TRL ran the later for both
    (tmp_path / "mine.py").write_text(TOOL_NAMED_CALCULATOR)
    return "qwen3_grpo_tools", ["--tools", f"calculator,{tmp_path / 'mine.py'}:calculator"]


@pytest.mark.parametrize(
    ("case", "key"),
    [
        ("memory-limit-inf", "TOOLKIT_MEMORY_LIMIT_GIB='inf' is not a positive number of GiB: unset it"),
        (
            "profile-past-the-end",
            "--profile 6-8: this run ends at step 4, so nothing would be recorded: pass a "
            "window within steps 1-4 (--profile 1-4, say)",
        ),  # fmt: skip
        (
            "dropout-on-a-model-without",
            "--dropout 0.1 sets the dropouts a model trains with, and llama trains with "
            "none (its dropouts are all 0 (attention_dropout))",
        ),  # fmt: skip
        ("kto-one-label", "all 8 training rows are labelled true (desirable)"),
        ("teacher-a-classifier", "was saved as Qwen3ForSequenceClassification, not a causal language model"),
        (
            "tool-named-like-a-built-in",
            "mine.py:calculator is named calculator, like the built-in calculator that --tools also offers",
        ),  # fmt: skip
    ],
)
def test_a_mistake_once_a_traceback_or_silence_is_one_line_before_the_weights(case, key, tmp_path, monkeypatch,
                                                                              capsys):  # fmt: skip
    from toolkit import runner

    name, flags = silent_mistake(case, tmp_path, monkeypatch)
    monkeypatch.setattr(runner, "load_for_training", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(SystemExit) as exit_info:
        run(load_recipe(name), ["--tiny", "--report_to", "none", "--output_dir", str(tmp_path / "run"), *flags], name)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert_one_clear_line(captured.out + captured.err, key)


def test_a_profile_window_that_outlasts_the_run_is_a_warning(capsys):
    """A window that opens within the run and closes after it records up to the last step: a warning. One that
    opens before the step a resume starts from never opens: one line."""
    from toolkit.errors import ConfigError
    from toolkit.training.profiling import check_profile_window

    check_profile_window("3-8", steps=4)
    assert capsys.readouterr().err == ("warning: --profile 3-8: this run ends at step 4, so steps 3-4 are recorded; "
                                       "--profile 3-4 says so.\n")  # fmt: skip
    check_profile_window("5-8", steps=10, resumed_at=4)
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"this run resumes after step 5, .* pass a window within steps 6-10 "
                                          r"\(--profile 7-10, say\)"):  # fmt: skip
        check_profile_window("5-8", steps=10, resumed_at=5)
