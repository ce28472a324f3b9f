"""Hub pushes of occult_ft checkpoints, with their model card (`occult_ft.checkpoint.card`).

`push_checkpoint` uploads a checkpoint directory with `HfApi.create_repo(exist_ok=True)` +
`HfApi.upload_folder` from a staged mirror of the folder: the card is its README.md, the figure sits
beside it, and an adapter's `base_model_name_or_path` names a local base by its folder name. The folder
itself is never written, by a push, a dry run (`staged_upload`) or a failed push. A push checks the
endpoint first and names the endpoint and the step that failed. `push_after_training` does the same for
a finished training run, given the trainer (anything with `.args.output_dir`) or its output directory.
`card_figure` measures a checkpoint's routing and draws the figure the card can show, outside the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from .checkpoint import CheckpointSummary, describe_checkpoint
from .checkpoint.card import (
    CARD_TAGS,
    KNOWN_LICENSES,
    OCCULT_CITATION,
    base_model_reference,
    build_model_card,
    figure_name,
    last_eval_metrics,
    write_model_card,
)
from .evaluation import FIGURE_NAME, make_comm_complexity_figure, measure_checkpoint
from .fileio import read_json_object
from .hub_access import hub_endpoint, hub_unreachable, offline_refusal
from .plots import comm_complexity_figure

__all__ = [
    "FIGURE_NAME",
    "HubPushError",
    "card_figure",
    "check_endpoint",
    "make_comm_complexity_figure",
    "staged_upload",
    "OCCULT_CITATION",
    "CARD_TAGS",
    "DEFAULT_IGNORE_PATTERNS",
    "KNOWN_LICENSES",
    "CheckpointSummary",
    "describe_checkpoint",
    "build_model_card",
    "write_model_card",
    "upload_file_list",
    "check_repo_id",
    "push_checkpoint",
    "push_after_training",
    "last_eval_metrics",
]

DEFAULT_IGNORE_PATTERNS = (
    "checkpoint-*/*",
    "runs/*",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state*.pth",
    # training state may hold secrets (a pickled TrainingArguments carries its hub_token): pass your own
    # ignore_patterns to upload it on purpose
    "training_args.bin",
    "optimizer.bin",
    "scaler.pt",
    "optimizer_expert_shard_*.pt",
    "global_step*/*",
    "__pycache__/*",
    ".cache/*",
)


def upload_file_list(
    checkpoint_dir: str | os.PathLike, ignore_patterns: tuple[str, ...] | list[str] = DEFAULT_IGNORE_PATTERNS
) -> list[str]:
    """Repo paths `upload_folder` sends from the directory, filtered the way it filters (sorted)."""
    from huggingface_hub.utils import filter_repo_objects

    path = os.fspath(checkpoint_dir)
    files = [
        os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/")
        for root, _, names in os.walk(path)
        for name in names
    ]
    return sorted(filter_repo_objects(files, ignore_patterns=list(ignore_patterns)))


class HubPushError(ValueError):
    """A push that failed, in one line: the endpoint, the step (reaching the Hub, creating the repo,
    uploading) and the reason. Nothing was written into the checkpoint folder."""


def check_endpoint(step: str = "reaching the Hub") -> str:
    """The endpoint (HF_ENDPOINT or https://huggingface.co) after checking that offline mode is off
    (HF_HUB_OFFLINE) and that it answers, once and quickly; a `HubPushError` saying which otherwise."""
    refusal = offline_refusal("pushing to the Hub")
    if refusal is not None:
        raise HubPushError(f"{refusal}; nothing was uploaded and nothing written into the folder")
    endpoint = hub_endpoint()
    reason = hub_unreachable()
    if reason is not None:
        raise HubPushError(
            f"{step}: the Hub at {endpoint} cannot be reached ({reason}); nothing was uploaded and nothing "
            "written into the folder (check the network, or HF_ENDPOINT)"
        )
    return endpoint


def card_figure(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    data: Any = "embedded",
    max_tokens: int = 2048,
) -> str:
    """Measure the checkpoint's routing on `data` (`evaluation.measure_checkpoint`) and draw its
    comm_complexity figure as `out_dir/FIGURE_NAME` (not into the checkpoint); returns the PNG's path."""
    report = measure_checkpoint(checkpoint_dir, data=data, max_tokens=max_tokens)
    path = os.path.join(os.fspath(out_dir), FIGURE_NAME)
    comm_complexity_figure(report, path)
    return path


# ---- pushing -----------------------------------------------------------------------------------
def check_repo_id(repo_id: Any) -> str:
    """`repo_id` if it is a valid Hub repo id, else a one-line ValueError."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"repo id {repo_id!r} is empty; pass --repo-id owner/name")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(
            f"repo id {repo_id!r} is not a valid Hub repo id; use owner/name with letters, digits, '-', '_' or '.'"
        ) from None
    return repo_id


def push_checkpoint(
    checkpoint_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    figure: str | os.PathLike | None = None,
    *,
    eval_results: Mapping[str, Any] | None = None,
    ignore_patterns: tuple[str, ...] | list[str] = DEFAULT_IGNORE_PATTERNS,
    api=None,
) -> str:
    """Upload `checkpoint_dir` to the Hub with the model card as its README.md.

    The card is written into a temporary mirror of the folder, never into the folder itself: a
    README.md of the user's survives the push, and nothing is written when the Hub cannot be reached.

    Args:
        checkpoint_dir: a full or LoRA adapter checkpoint directory (see `build_model_card`).
        repo_id: `owner/name` (or `name`, in the token owner's namespace); created if it does not exist.
        private: create the repo private (an existing repo keeps its visibility).
        token: Hub token; default: the logged-in token / `HF_TOKEN`.
        commit_message: default `"Upload occult_ft checkpoint"`.
        figure: a PNG to show in the card; copied into the folder when it lives elsewhere.
        eval_results: metrics for the card (see `build_model_card`).
        ignore_patterns: files not uploaded (default: trainer checkpoints, optimizer states, logs).
        api: an `HfApi`-like object (`create_repo`, `upload_folder`); default `HfApi(token=token)`.

    Returns:
        The commit URL (the repo URL when the API returns no commit information).

    Raises:
        ValueError: missing directory, not a checkpoint, bad repo id, bad figure.
    """
    repo_id = check_repo_id(repo_id)
    path = os.fspath(checkpoint_dir)
    card = build_model_card(path, repo_id=repo_id, eval_results=eval_results, figure=figure)
    if api is None:
        from huggingface_hub import HfApi

        check_endpoint()
        api = HfApi(token=token)
    endpoint = getattr(api, "endpoint", None) or hub_endpoint()
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, token=token)
    except Exception as exc:  # noqa: BLE001 - network, auth, permissions: one line naming the step
        raise HubPushError(f"creating the repo {repo_id} at {endpoint} failed: {_first_line(exc)}") from None
    with staged_upload(path, str(card), figure) as staged:
        try:
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=staged,
                commit_message=commit_message or "Upload occult_ft checkpoint",
                ignore_patterns=list(ignore_patterns),
                token=token,
            )
        except Exception as exc:  # noqa: BLE001
            raise HubPushError(
                f"uploading {path} to {repo_id} at {endpoint} failed: {_first_line(exc)}; the repo exists, "
                "nothing of the folder was changed: push again"
            ) from None
    url = getattr(info, "commit_url", None) or getattr(repo_url, "url", None) or repo_url
    return str(url) if url is not None else f"{endpoint}/{repo_id}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(exc).__name__


@contextlib.contextmanager
def staged_upload(path: str, card: str, figure: str | os.PathLike | None = None):
    """A temporary folder that mirrors `path` (hard links, symlinks across file systems) with the card
    as README.md, the figure beside it and, for an adapter, `base_model_name_or_path` naming a local base
    by its folder name (a path of this machine means nothing on the Hub; the card says how to point it at
    a copy): what gets uploaded. `path` itself is never modified, so a user's own README.md survives a
    push, failed or not, and a dry run leaves the folder as it was."""
    with tempfile.TemporaryDirectory(prefix=".occult-push-") as staged:
        for root, _, names in os.walk(path):
            rel = os.path.relpath(root, path)
            os.makedirs(os.path.join(staged, rel), exist_ok=True)
            for name in names:
                if rel == "." and name == "README.md":
                    continue
                src, dst = os.path.join(root, name), os.path.join(staged, rel, name)
                if rel == "." and name == "adapter_config.json":
                    _write_portable_adapter_config(src, dst)
                    continue
                try:
                    os.link(src, dst)
                except OSError:
                    os.symlink(os.path.abspath(src), dst)
        with open(os.path.join(staged, "README.md"), "w", encoding="utf-8") as f:
            f.write(card)
        if figure is not None:
            target = os.path.join(staged, figure_name(path, figure))
            if not os.path.exists(target):
                shutil.copyfile(os.fspath(figure), target)
        yield staged


def _write_portable_adapter_config(src: str, dst: str) -> None:
    config = read_json_object(src)
    base = base_model_reference(config.get("base_model_name_or_path"))
    if base is not None and base != "embedded" and (os.path.isabs(base) or os.path.exists(base)):
        base = os.path.basename(os.path.normpath(base))  # a local model: its folder name
    config["base_model_name_or_path"] = base
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def push_after_training(
    trainer_or_output_dir: Any,
    repo_id: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    figure: str | os.PathLike | None = None,
    *,
    eval_results: Mapping[str, Any] | None = None,
    api=None,
) -> str | None:
    """Push the saved result of a training run, with its Occult model card.

    Works with any trainer whose `.args` carries TrainingArguments' `output_dir`, `hub_model_id`,
    `hub_private_repo` and `hub_token`, or with the output directory itself. The model must already be
    saved there (`trainer.save_model()`). With a trainer, only the main process pushes, and the last
    evaluation in `trainer.state.log_history` goes into the card.

    Args:
        trainer_or_output_dir: the trainer, or the directory the final model was saved to.
        repo_id: default `args.hub_model_id`, else the output directory's name.
        private: default `args.hub_private_repo` (else False).
        token: default `args.hub_token`.
        commit_message: default `"End of training"`.
        figure, eval_results, api: as in `push_checkpoint`.

    Returns:
        The commit URL, or None on processes other than the main one.
    """
    args = getattr(trainer_or_output_dir, "args", None)
    if args is None:
        output_dir = os.fspath(trainer_or_output_dir)
        metrics: dict[str, Any] = {}
    else:
        is_main = getattr(trainer_or_output_dir, "is_world_process_zero", None)
        if callable(is_main) and not is_main():
            return None
        output_dir = os.fspath(args.output_dir)
        repo_id = repo_id or getattr(args, "hub_model_id", None)
        private = getattr(args, "hub_private_repo", None) if private is None else private
        token = token or getattr(args, "hub_token", None)
        state = getattr(trainer_or_output_dir, "state", None)
        metrics = last_eval_metrics(getattr(state, "log_history", []))
    repo_id = repo_id or os.path.basename(os.path.abspath(output_dir))
    if eval_results is None and metrics:
        eval_results = metrics
    return push_checkpoint(
        output_dir,
        repo_id,
        private=bool(private),
        token=token,
        commit_message=commit_message or "End of training",
        figure=figure,
        eval_results=eval_results,
        api=api,
    )
