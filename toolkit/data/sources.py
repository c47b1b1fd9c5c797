"""Where a model or data set comes from: a local path, a file shipped inside an installed package, or the Hub;
and, offline, the copies of the recipes' models' `config.json` and their data sets' sizes kept in the repo.

The Hub check runs before anything is downloaded, so an offline machine fails in about a second with the ways
forward, instead of after half a minute of retries.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..errors import ConfigError, ToolkitError
from ..project import PACKAGE_PREFIX, REASONING_GYM_PREFIX, check_local_path, recipe_names

HUB_CONFIGS = Path(__file__).resolve().parent.parent / "hub_configs"


class SourceUnavailable(ToolkitError, RuntimeError):
    """A model or data set that cannot be reached from this machine."""


def resolve(name: str) -> str:
    """`package:<module>/<path>` -> the path inside the installed package (or, for a file that needs converting,
    its converted form in the cache: packaged.py); `reasoning_gym:<task>?<settings>` -> its problems, generated
    once into the cache; anything else unchanged."""
    if name.startswith(REASONING_GYM_PREFIX):
        from .packaged import reasoning_gym_problems

        return str(reasoning_gym_problems(name[len(REASONING_GYM_PREFIX) :]))
    if not name.startswith(PACKAGE_PREFIX):
        return name
    module, _, rest = name[len(PACKAGE_PREFIX) :].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SourceUnavailable(
            f"'{name}' needs the Python package '{module}', which is not installed. "
            "Install the demo assets with `make install`."
        )
    path = Path(spec.origin).parent / rest
    if not path.exists():
        raise SourceUnavailable(f"'{name}': {path} does not exist in the installed package '{module}'.")
    from .packaged import converted

    return str(converted(module, path))  # a GGUF checkpoint, a corpus of YAML files: made loadable once


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
        f"Cannot load the {what} '{name}': {reason}. Use a local copy (--model_name_or_path /path/to/folder, a "
        "save_pretrained folder), --tiny (the same architecture at toy size, random weights, local data), or the "
        "offline demo on real pretrained weights (make demo). Gated models such as Llama 3 also need "
        "`hf auth login` and their license accepted on the Hub."
    )


def check_hub_dataset(name: str) -> None:
    """Fail fast when the Hub is unreachable. With HF_HUB_OFFLINE set, `datasets` reads its own cache."""
    if is_local(name) or hub_offline() or hub_reachable():
        return
    raise SourceUnavailable(
        f"Cannot load the data set '{name}': the Hugging Face Hub cannot be reached from this machine. Use "
        "--dataset_name /path/to/file.jsonl (json, jsonl, csv or parquet, or a folder of class "
        "subfolders), --tiny, or HF_HUB_OFFLINE=1 if the data set is already in the local datasets cache."
    )


# ------------------------------------------------------------------------------ configs without weights


def hub_config_path(model_name: str) -> Path:
    return HUB_CONFIGS / (model_name.replace("/", "--") + ".json")


def read_config(name: str, given: str | None = None, trust_remote_code: bool = False):
    """transformers' AutoConfig of a local folder or Hub id, every way it can fail one ConfigError naming the fix:
    a model_type this transformers does not know, a config.json that is not JSON, a repository's own code not
    allowed, a Hub id that is not there. `given`: the name as the user wrote it."""
    import transformers
    from transformers import AutoConfig

    given = given or name
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as error:
        message = " ".join(str(error).split())
        if "trust_remote_code" in message:
            raise ConfigError(f"'{given}' runs its own model code from its repository (auto_map in its config). "
                              "Read that code, then pass --trust_remote_code true to allow it.") from None  # fmt: skip
        found = re.search(r"model type `([^`]+)`", message)
        if found:
            raise ConfigError(f"{given}: its config.json names model_type '{found.group(1)}', which transformers "
                              f"{transformers.__version__} does not know: check the name, or the transformers release "
                              "that added it, or pass --trust_remote_code true if its repository ships the model's "
                              "code.") from None  # fmt: skip
        local = Path(name).is_dir()
        fix = ("pass a folder written by save_pretrained" if local else
               "check the id on the Hub, and `hf auth login` for a gated model")  # fmt: skip
        raise ConfigError(f"{given}: its config cannot be read ({message[:200]}): {fix}.") from None


def stored_config(model_name: str):
    """The real config of a recipe's model: a local folder's own, or the copy kept in the repo (no Hub call)."""
    from transformers import AutoConfig

    local = Path(resolve(model_name)) / "config.json"
    if local.is_file():
        return read_config(str(local.parent), model_name)
    check_local_path(model_name, "model", "--model_name_or_path", "config.json")  # a path, not a Hub id
    path = hub_config_path(model_name)
    if not path.is_file():
        known = sorted(p.stem.replace("--", "/") for p in HUB_CONFIGS.glob("*--*.json"))
        raise ConfigError(
            f"No stored config for '{model_name}' in {HUB_CONFIGS}; tiny mode knows {known}. "
            "Add the model's config.json there (named <org>--<name>.json) to use --tiny with it."
        )
    values = json.loads(path.read_text())
    values.pop("_source", None)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def model_config(name: str):
    """A model's config without its weights: a local folder's, the copy stored in the repo, or the Hub's."""
    from transformers import AutoConfig

    if (Path(resolve(name)) / "config.json").is_file():  # a folder's own: its errors are its own
        return stored_config(name)
    try:
        return stored_config(name)
    except ConfigError:
        pass
    try:
        check_hub_model(name)  # seconds, not the download client's retries, when the Hub is out of reach
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError, SourceUnavailable) as error:
        raise ConfigError(
            f"'{name}' is not a recipe ({', '.join(recipe_names())}), a folder with a config.json, or a model whose "
            f"config could be fetched from the Hub ({type(error).__name__}). Offline, put its config.json in "
            f"{HUB_CONFIGS} as <org>--<name>.json."
        ) from None


def stored_split_size(values: dict) -> int | None:
    """Rows in a recipe's training split, from hub_configs/datasets.json (public card figures)."""
    sizes = json.loads((HUB_CONFIGS / "datasets.json").read_text())
    name = values.get("dataset_name", "")
    key = f"{name}:{values['dataset_config']}" if values.get("dataset_config") else name
    return sizes.get(key, {}).get(values.get("train_split", "train"))
