"""Bad input found before the tokenizer, the data or the weights load: one line naming the fix, exit 2, nothing
written."""

from __future__ import annotations

import json
import shutil

import pytest
from bert import RECIPE as BERT

from toolkit import run
from toolkit.pipeline import tiny


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
