"""Where a model or data set comes from: a local path, a file shipped inside an installed package, or the Hub.

The Hub check runs before anything is downloaded, so an offline machine fails in about a second with the ways
forward, instead of after half a minute of retries.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from urllib.parse import urlparse

PACKAGE_PREFIX = "package:"


class SourceUnavailable(RuntimeError):
    """A model or data set that cannot be reached from this machine."""


def resolve(name: str) -> str:
    """`package:<module>/<path>` -> the path inside the installed package; anything else unchanged."""
    if not name.startswith(PACKAGE_PREFIX):
        return name
    module, _, rest = name[len(PACKAGE_PREFIX) :].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SourceUnavailable(
            f"'{name}' needs the Python package '{module}', which is not installed. "
            "Install the demo assets with `make install` (or `pip install -e '.[demo]'`)."
        )
    path = Path(spec.origin).parent / rest
    if not path.exists():
        raise SourceUnavailable(f"'{name}': {path} does not exist in the installed package '{module}'.")
    return str(path)


def is_local(name: str) -> bool:
    return Path(name).exists()


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the Hub endpoint (HF_ENDPOINT honoured), with a short timeout."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def cached_on_disk(repo_id: str, filename: str, repo_type: str = "model") -> bool:
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, filename, repo_type=repo_type)
    return isinstance(hit, str)


def check_hub_model(name: str, what: str = "model") -> None:
    """Raise `SourceUnavailable` with the ways forward when a Hub model cannot be loaded from here."""
    if is_local(name) or cached_on_disk(name, "config.json"):
        return
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set and it is not in the local cache"
    elif not hub_reachable():
        reason = "the Hugging Face Hub cannot be reached from this machine and it is not in the local cache"
    else:
        return
    raise SourceUnavailable(
        f"Cannot load the {what} '{name}': {reason}.\n"
        "Ways forward:\n"
        "  1. a local copy:   --model_name_or_path /path/to/folder (a save_pretrained folder)\n"
        "  2. the tiny mode:  --tiny (same architecture at toy size, random weights, local data)\n"
        "  3. the offline demo with real pretrained weights: make demo\n"
        "  (Gated models such as Llama 3 also need `hf auth login` and accepting the license on the Hub.)"
    )


def check_hub_dataset(name: str) -> None:
    """Fail fast when the Hub is unreachable. With HF_HUB_OFFLINE set, `datasets` reads its own cache."""
    if is_local(name) or hub_offline() or hub_reachable():
        return
    raise SourceUnavailable(
        f"Cannot load the data set '{name}': the Hugging Face Hub cannot be reached from this machine.\n"
        "Ways forward: --dataset_name /path/to/file.jsonl (json, jsonl, csv or parquet, or a folder of class "
        "subfolders), --tiny, or HF_HUB_OFFLINE=1 if the data set is already in the local datasets cache."
    )
