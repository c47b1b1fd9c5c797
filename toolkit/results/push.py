"""`python -m toolkit push RUN --repo_id ORG/NAME`: the run's export to the Hugging Face Hub, with its card.

What goes: the weights (safetensors, sharded or whole; for LoRA the adapter, or with --merged the merged model), the
config, the tokenizer and its chat template, the card (README.md, written now if the run has none), its loss curve
and the evaluation (eval_results.json). Not the checkpoints, the run's logs, rank reports or staging folders. By
`huggingface_hub`'s upload API: the repository made if need be (private unless --private false), one commit on
--revision (a branch, made if need be); large files go as LFS uploads the Hub deduplicates, so a push cut short
uploads again only what had not arrived. The local folder is only read.

Refused in one line, naming the fix: no token, a repository id the Hub would refuse, a Hub that cannot be reached,
a namespace the token cannot write to. `--push_to_hub true --hub_model_id ORG/NAME` at the end of a run does the
same from rank 0 (the Trainer's own pushes during training are left off: one push, of the finished model).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError, command

MODEL_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
               "adapter_config.json", "tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.model",
               "chat_template.jinja", "added_tokens.json"]  # fmt: skip
RUN_FILES = ["README.md", "loss_curve.png", "eval_results.json"]  # the run's own, from its output folder


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


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def files_to_push(folder: Path, merged: bool) -> tuple[Path, list[str]]:
    """The folder whose model files go up (the run's, or its merged/ for --merged) and its patterns."""
    if merged:
        if not (folder / "merged" / "config.json").is_file():
            raise PushError(f"{folder} has no merged model: train with --merge_lora true, or push the adapter (drop "
                            "--merged).")  # fmt: skip
        return folder / "merged", MODEL_FILES
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json",
                                                       "adapter_model.safetensors")):  # fmt: skip
        raise PushError(f"{folder} holds no exported weights (no model.safetensors, index or adapter): pass a finished "
                        "run's --output_dir.")  # fmt: skip
    return folder, MODEL_FILES + RUN_FILES


def push(folder: str | Path, repo_id: str, private: bool = True, revision: str | None = None,
         merged: bool = False) -> str:  # fmt: skip
    """Upload the run's model and card; returns the commit's URL. Raises PushError with the fix."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from .card import CARD, write_card

    folder = Path(folder)
    token = check_push(repo_id)
    model_folder, patterns = files_to_push(folder, merged)
    if not (folder / CARD).is_file() or merged:
        write_card(folder)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    where = os.environ.get("HF_ENDPOINT") or "huggingface.co"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=model_folder,
            allow_patterns=patterns,
            ignore_patterns=["checkpoint-*/**", "merged/**", ".staging/**"],
            revision=revision,
            commit_message=f"Upload {folder.name} (finetune-recipes)",
        )
        if model_folder != folder:  # the merged model's card and the run's own files, from the run's folder
            commit = api.upload_folder(repo_id=repo_id, folder_path=folder, allow_patterns=RUN_FILES,
                                       revision=revision, commit_message="Model card and evaluation")  # fmt: skip
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

    parser = argparse.ArgumentParser(prog="python -m toolkit push", description=push_main.__doc__.splitlines()[0])
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
