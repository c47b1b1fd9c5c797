"""`python -m toolkit push RUN --repo_id ORG/NAME`: the run's export to the Hugging Face Hub, with its card.

What goes: the weights (safetensors, sharded or whole; for LoRA the adapter, or with --merged the merged model), the
config, the tokenizer and its chat template, the card with its loss curve, the evaluation (eval_results.json), and
the GGUF files `toolkit export` wrote with their Modelfile (at the repository's top, where llama.cpp's `-hf` and
Ollama's `hf.co/` look).
The card is the run's README.md as it is (edited by hand or not); a run without one, and the merged model (a full
model, not the adapter the run's card describes), get one made in a temporary folder. Not the checkpoints, the
run's logs, rank reports or staging folders. By `huggingface_hub`'s commit API: the repository made if need be
(private unless --private false), one commit on --revision (a branch, made if need be); large files go as LFS
uploads the Hub deduplicates, so a push cut short uploads again only what had not arrived. The run's folder is only
read, whether the push succeeds or fails.

Refused in one line, naming the fix: no token, a repository id the Hub would refuse, a Hub that cannot be reached,
a namespace the token cannot write to. `--push_to_hub true --hub_model_id ORG/NAME` at the end of a run does the
same from rank 0 (the Trainer's own pushes during training are left off: one push, of the finished model).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..errors import ConfigError, command, description, first_line
from ..metrics.samples import EVAL_FILE, EXPORTS_FILE
from .card import CARD, CURVE, write_card
from .record import check_export

MODEL_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
               "adapter_config.json", "tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.model",
               "chat_template.jinja", "added_tokens.json"]  # fmt: skip


class PushError(ConfigError):
    """A push that cannot happen as asked: the run's files are as they were."""


def check_push(repo_id: str | None) -> str:
    """The token, and a repository id the Hub accepts, before anything is uploaded (or, at the end of a run, before
    training starts). Returns the token."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not repo_id:
        raise PushError("pushing needs a repository: --repo_id your-name/model-name (--hub_model_id at the end of a "
                        "run).")  # fmt: skip
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"{repo_id!r} is not a repository id the Hub accepts ({first_line(error)}): use "
                        "your-name/model-name (letters, digits, '-', '_', '.').") from None  # fmt: skip
    if "/" not in repo_id:
        raise PushError(f"{repo_id!r} has no namespace: use your-name/{repo_id} or an-organization/{repo_id}.")
    token = get_token()
    if not token:
        raise PushError("no Hugging Face token: `hf auth login`, or set HF_TOKEN to a token with write access.")
    return token


def files_to_push(folder: Path, merged: bool, scratch: Path) -> dict[str, Path]:
    """Each file to upload by its name in the repository: the model's (the run's, or its merged/ for --merged),
    the evaluation, and the card with its curve: the run's own as they are, or, for a run without a card and for
    the merged model, made in `scratch`."""
    from huggingface_hub.utils import filter_repo_objects

    model_folder = folder / "merged" if merged else folder
    if merged and not (model_folder / "config.json").is_file():
        raise PushError(f"{folder} has no merged model: train with --merge_lora true, or push the adapter (drop "
                        "--merged).")  # fmt: skip
    check_export(model_folder)
    files = {path.name: path for path in filter_repo_objects(sorted(model_folder.iterdir()), allow_patterns=MODEL_FILES,
                                                             key=lambda path: path.name) if path.is_file()}  # fmt: skip
    card_folder = folder if (folder / CARD).is_file() and not merged else scratch
    if card_folder == scratch:
        write_card(folder, into=scratch, merged=merged)
    files.update({name: card_folder / name for name in (CARD, CURVE) if (card_folder / name).is_file()})
    if (folder / EVAL_FILE).is_file():
        files[EVAL_FILE] = folder / EVAL_FILE
    exports = folder / EXPORTS_FILE
    if exports.is_file():  # toolkit export's GGUF files, at the top: where llama.cpp's -hf and Ollama's hf.co look
        names = [row["file"] for row in json.loads(exports.read_text())] + ["Modelfile"]
        files.update({name: exports.parent / name for name in names if (exports.parent / name).is_file()})
    return files


def push(folder: str | Path, repo_id: str, private: bool = True, revision: str | None = None,
         merged: bool = False) -> str:  # fmt: skip
    """Upload the run's model and card in one commit; returns the commit's URL. Raises PushError with the fix."""
    folder = Path(folder)
    token = check_push(repo_id)
    with tempfile.TemporaryDirectory(prefix="toolkit-push-") as scratch:  # the cards the push makes: not the run's
        return upload(folder, files_to_push(folder, merged, Path(scratch)), repo_id, token, private, revision)


def upload(folder: Path, files: dict[str, Path], repo_id: str, token: str, private: bool,
           revision: str | None) -> str:  # fmt: skip
    """One commit of `files` (name in the repository: local path), its refusals one PushError each."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    where = os.environ.get("HF_ENDPOINT") or "huggingface.co"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in files.items()]
        commit = api.create_commit(repo_id, operations, revision=revision,
                                   commit_message=f"Upload {folder.name} (finetune-recipes)")  # fmt: skip
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        if status == 401:
            raise PushError("the Hub refused the token (401): `hf auth login` again, or set HF_TOKEN to a valid token "
                            "with write access.") from None  # fmt: skip
        if status == 403:
            raise PushError(f"the token cannot write to {repo_id} ({first_line(error)}): push to your own "
                            "namespace, or ask the organization for write access.") from None  # fmt: skip
        if status == 404:
            raise PushError(f"the Hub does not know {repo_id} or its namespace ({first_line(error)}): check the name, "
                            "and that the token can see it.") from None  # fmt: skip
        raise PushError(f"the Hub refused the upload ({status}: {first_line(error)}).") from None
    except Exception as error:  # noqa: BLE001 (a connection refused or timed out, as the HTTP library raises it)
        if not network_error(error):
            raise
        raise PushError(
            f"the Hub cannot be reached at {where} ({first_line(error)}): the run's files are as they were; "
            f"push later with `python -m toolkit push {folder} --repo_id {repo_id}`."
        ) from None
    return commit.commit_url


def network_error(error: BaseException) -> bool:
    """A connection that failed (refused, timed out, offline mode), whichever HTTP library huggingface_hub uses."""
    library = type(error).__module__.split(".")[0]
    return isinstance(error, OSError) or library in ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3")


@command
def push_main(argv: list[str] | None = None) -> int:
    """`python -m toolkit push RUN --repo_id ORG/NAME [--private false] [--revision BRANCH] [--merged]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit push", description=description(push_main.__doc__))
    parser.add_argument("run", help="a run's --output_dir")
    parser.add_argument("--repo_id", required=True, help="your-name/model-name")
    parser.add_argument("--private", default="true", choices=["true", "false"], help="a private repository (default)")
    parser.add_argument("--revision", help="a branch to commit to (made if need be); the main branch otherwise")
    parser.add_argument("--merged", action="store_true", help="LoRA: the merged model (OUTPUT/merged), not the adapter")
    args = parser.parse_args(argv)
    if not Path(args.run).is_dir():
        raise PushError(f"{args.run}: no such folder: pass a run's --output_dir.")
    url = push(args.run, args.repo_id, args.private == "true", args.revision, args.merged)
    print(f"pushed {args.run} to {args.repo_id}: {url}")
    return 0
