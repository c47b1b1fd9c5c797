"""A finished run as its output folder records it: its summary, its resolved settings, what it started from."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..metrics.samples import EVAL_FILE
from ..outputs import SUMMARY

# A run's exported weights (an adapter, or every weight, whole or sharded), each with its config
EXPORTS = {"adapter_model.safetensors": "adapter_config.json", "model.safetensors": "config.json",
           "model.safetensors.index.json": "config.json"}  # fmt: skip


def check_export(folder: Path) -> None:
    """The model a run exported (a LoRA adapter, or every weight), with its config, before anything uses it."""
    if not any((folder / weights).is_file() and (folder / config).is_file() for weights, config in EXPORTS.items()):
        raise ConfigError(f"{folder} holds no exported model (model.safetensors or its index with config.json, or "
                          "adapter_model.safetensors with adapter_config.json): pass the --output_dir of a run that "
                          "finished (a stopped run exports once `--resume auto` finishes it), or restore its "
                          "files.")  # fmt: skip


@dataclass
class RunRecord:
    folder: Path
    summary: dict[str, Any]  # run_summary.json's "summary": the figures the run ended with
    config: dict[str, Any]  # its "config": the resolved settings ("toolkit"), strategy, plans, pricing

    @classmethod
    def read(cls, folder: str | Path) -> RunRecord:
        folder = Path(folder)
        path = folder / SUMMARY
        if not path.is_file():
            raise ConfigError(f"{folder} holds no finished run (no {SUMMARY}): pass a run's --output_dir.")
        try:
            written = json.loads(path.read_text())
            return cls(folder, written["summary"], written["config"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path} is cut short or not the toolkit's: pass the --output_dir of a run that "
                              "finished.") from None  # fmt: skip

    @property
    def settings(self) -> dict[str, Any]:
        return self.config["toolkit"]

    @property
    def task(self) -> str:
        return self.settings["task"]

    @property
    def base_model(self) -> str:
        """The model the run started from (a Hub id, a local folder, or tiny mode's random checkpoint)."""
        return self.settings["model_name_or_path"]

    @property
    def lora(self) -> bool:
        return bool(self.settings.get("use_lora"))

    def evaluation(self) -> dict[str, Any] | None:
        path = self.folder / EVAL_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def arguments(self, cls):
        """One of the settings' dataclasses (ModelArguments, DataArguments, RunArguments) as the run resolved it."""
        names = {f.name for f in fields(cls) if f.init}
        return cls(**{k: v for k, v in self.settings.items() if k in names})
