"""Whether a checkpoint folder can be resumed from: its marker there (the owner record, written last) with every
file it lists at its size, its files read back (JSON, torch, safetensors, DCP) and the weights and optimizer states
its engine writes all there, or what is damaged, in words (checkpoints.py writes the folders; resume.py refuses a
damaged one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..outputs import OWNER, STAGING, SUMMARY

TRAINER_STATE = "trainer_state.json"  # the Trainer's, in every checkpoint
MANIFEST = "files"  # in the owner record: every file of the checkpoint (relative path) and its size in bytes

# Whose a checkpoint's file is, for a line that names one: a rank's (or stage's) part, by the names the Trainer,
# torch.distributed.checkpoint, DeepSpeed and the toolkit give them.
PARTS = (
    (re.compile(r"(?:^|/)rng_state_(\d+)\.pth$"), "rank {}'s RNG state"),
    (re.compile(r"(?:^|/)optimizer-rank(\d+)\.pt$"), "rank {}'s optimizer shard"),
    (re.compile(r"(?:^|/)optimizer-stage(\d+)\.pt$"), "pipeline stage {}'s optimizer state"),
    (re.compile(r"(?:^|/)optimizer_\d+/__(\d+)_\d+\.distcp$"), "rank {}'s optimizer shard"),
    (re.compile(r"/__(\d+)_\d+\.distcp$"), "rank {}'s weight shard"),
    (re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$"), "rank {}'s optimizer partition"),
    (re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$"), "rank {}'s model states"),
)


def whose(name: str) -> str:
    """A checkpoint's file in words: "rank 1's RNG state rng_state_1.pth", or its name."""
    for pattern, part in PARTS:
        if found := pattern.search(name):
            return f"{part.format(found.group(1))} {name}"
    return name


def manifest_damage(folder: Path, files: dict[str, int]) -> str | None:
    """The first file the marker lists that is missing or of another size: on a bucket mount, a node's upload that
    had not finished when it was lost (its marker and the other nodes' files made it)."""
    for name, size in files.items():
        path = folder / name
        found = path.stat().st_size if path.is_file() else None
        if found != size:
            state = "missing" if found is None else f"{found:,} bytes of {size:,}"
            return f"{whose(name)} is {state}: its upload did not finish"
    return None


def toolkit_written(folder: Path) -> bool:
    """Whether `folder` is a checkpoint of a toolkit run, so that its marker is due: the toolkit's cost file in it, or
    in its output folder the staging folder, the run's log or summary, or another checkpoint's marker. A checkpoint
    the Trainer alone wrote has none of them (check_resumable reads its config.json)."""
    from ..metrics.samples import RUN_LOG
    from ..metrics.tracking import SPENT_FILE

    run = folder.parent
    if (folder / SPENT_FILE).is_file() or (run / STAGING).is_dir() or (run / RUN_LOG).is_file():
        return True
    return (run / SUMMARY).is_file() or any((other / OWNER).is_file() for other in run.glob("checkpoint-*"))


def json_damage(path: Path) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{path.name} is not JSON"
    return None


def torch_file_damage(path: Path) -> str | None:
    """A torch.save file (a zip archive): present, and its central directory, written last, readable: a file cut
    short by a kill or a full disk fails here in microseconds, without reading its tensors."""
    import zipfile

    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return f"{path.name} is truncated or not a torch file"


def safetensors_damage(path: Path) -> str | None:
    """A safetensors file: its header readable and the file as long as the header says its tensors reach."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_bytes))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, MemoryError, OverflowError):
        return f"{path.name} has no readable safetensors header"
    expected = 8 + header_bytes + end
    return f"{path.name} is truncated ({size:,} of {expected:,} bytes)" if size < expected else None


def dcp_damage(folder: Path) -> str | None:
    """A torch.distributed.checkpoint folder (FSDP's sharded state dicts): its metadata readable and every shard file
    as long as the metadata says its tensors reach."""
    if not folder.is_dir():
        return f"{folder.name}/ is missing"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - a missing or unpicklable .metadata, whatever the error
        return f"{folder.name}/.metadata is missing or unreadable"
    for info in storage.values():
        path = folder / info.relative_path
        if not path.is_file() or path.stat().st_size < info.offset + info.length:
            return f"{folder.name}/{info.relative_path} is missing or truncated"
    return None


def weights_damage(folder: Path, engine: str) -> str | None:
    """The model's weights as the engine checkpoints them: DeepSpeed's global_step folder (named by `latest`), FSDP's
    sharded folder or whole file, the Trainer's safetensors (sharded with an index, or a LoRA adapter)."""
    if engine == "DEEPSPEED":
        latest = folder / "latest"
        if not latest.is_file() or not (folder / latest.read_text().strip()).is_dir():
            return "latest (DeepSpeed's pointer to its global_step folder) or that folder is missing"
        for part in sorted((folder / latest.read_text().strip()).glob("*.pt")):
            if damage := torch_file_damage(part):
                return f"{latest.read_text().strip()}/{damage}"
        return None
    if engine == "FSDP" and (folder / "pytorch_model_fsdp_0").exists():
        return dcp_damage(folder / "pytorch_model_fsdp_0")
    for single in ("model.safetensors", "adapter_model.safetensors"):
        if (folder / single).exists():
            return safetensors_damage(folder / single)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        if damage := json_damage(index):
            return damage
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            if damage := safetensors_damage(folder / shard):
                return damage
        return None
    return "the model's weights are missing (no model.safetensors, adapter or shards)"


def stage_optimizer(folder: str | Path, stage: int) -> Path:
    """A pipeline stage's optimizer state in a checkpoint (training/pipeline.py writes one a stage)."""
    return Path(folder) / f"optimizer-stage{stage}.pt"


def rank_optimizer(folder: str | Path, rank: int) -> Path:
    """A rank's optimizer state in a checkpoint of a model transformers sharded at load (sharded_state.py)."""
    return Path(folder) / f"optimizer-rank{rank}.pt"


def optimizer_damage(folder: Path, engine: str, stages: int = 1, ranks: int = 1) -> str | None:
    """The optimizer's state and the scheduler's, without which a resume would silently start a fresh optimizer
    (DeepSpeed keeps both in its global_step folder, checked with the weights; a pipeline one file a stage; a model
    sharded at load one file a rank)."""
    if engine == "DEEPSPEED":
        return None
    if engine == "FSDP" and (folder / "optimizer_0").exists():
        damage = dcp_damage(folder / "optimizer_0")
    elif engine == "PIPELINE":
        damage = next(filter(None, (torch_file_damage(stage_optimizer(folder, s)) for s in range(stages))), None)
    elif rank_optimizer(folder, 0).exists():
        damage = next(filter(None, (torch_file_damage(rank_optimizer(folder, r)) for r in range(ranks))), None)
    else:
        damage = torch_file_damage(folder / "optimizer.pt")
    return damage or torch_file_damage(folder / "scheduler.pt")


def checkpoint_damage(folder: Path, engine: str, weights_only: bool) -> str | None:
    """Why `folder` cannot be resumed from, or None: a checkpoint is used only when complete and readable. Its marker
    and the toolkit's own files (where the toolkit wrote it), the Trainer's state, the weights, and unless checkpoints
    are of the weights only (`weights_only`: --save_only_model) the optimizer and scheduler; then every file the
    marker lists, at its size (the RNG states and rank files the checks before do not read). Cheap: headers, zip
    directories and file sizes, never the tensors."""
    from ..metrics.tracking import SPENT_FILE

    if not (folder / OWNER).exists() and toolkit_written(folder):
        return f"{OWNER} is missing (written last, once every file is): its save or upload never finished"
    if damage := json_damage(folder / TRAINER_STATE):
        return damage
    toolkit_files = [folder / name for name in (OWNER, SPENT_FILE)]
    if any(p.exists() for p in toolkit_files):
        for path in toolkit_files:
            if damage := json_damage(path):
                return damage
    recorded = json.loads((folder / OWNER).read_text()) if (folder / OWNER).is_file() else {}
    engine = recorded.get("engine", engine)
    stages = recorded.get("pipeline_stages", 1)
    ranks = recorded.get("world_size", 1)
    optimizer = None if weights_only else optimizer_damage(folder, engine, stages, ranks)
    return weights_damage(folder, engine) or optimizer or manifest_damage(folder, recorded.get(MANIFEST) or {})
