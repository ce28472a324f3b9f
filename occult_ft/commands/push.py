"""`occult-ft push`: upload a checkpoint directory to the Hugging Face Hub with an Occult model card.

    occult-ft push DIR --repo-id owner/name [--private] [--token T] [--message M] [--figure PNG] [--dry-run]

DIR is a full checkpoint (config.json, e.g. from `occult-ft prune` or `occult-ft train`) or a LoRA
adapter directory (adapter_config.json). The card (README.md, written into DIR) records the base
model, the expert placement, the routing budget, measured comm_complexity and evaluation results, and
how to load the model. `--dry-run` writes the card and lists the files that would be uploaded,
without contacting the Hub.
"""

from __future__ import annotations

import argparse

from ._common import standalone

__all__ = ["add_parser", "run", "main"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "push",
        help="upload a checkpoint to the Hub with an Occult model card",
        description="Write an Occult model card (README.md) into a checkpoint directory and upload the "
        "directory to the Hugging Face Hub (the repo is created if needed).",
    )
    p.add_argument("checkpoint", metavar="DIR", help="full checkpoint or LoRA adapter directory")
    p.add_argument("--repo-id", required=True, help="Hub repo id, owner/name")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--token", default=None, help="Hub token (default: the logged-in token or HF_TOKEN)")
    p.add_argument("--message", default=None, help="commit message (default: 'Upload occult_ft checkpoint')")
    p.add_argument(
        "--figure",
        default=None,
        help="a PNG to show in the card (copied into DIR); default: measure the checkpoint's "
        "comm_complexity on --figure-data and plot it",
    )
    p.add_argument(
        "--figure-data",
        default="embedded",
        help="text the default figure routes (a --data value; default: the shipped eval text)",
    )
    p.add_argument("--no-figure", action="store_true", help="no figure in the card")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="write README.md and list the files that would be uploaded; do not contact the Hub",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..hub import (
        check_repo_id,
        make_comm_complexity_figure,
        push_checkpoint,
        upload_file_list,
        write_model_card,
    )

    check_repo_id(args.repo_id)
    if args.figure is None and not args.no_figure:
        args.figure = make_comm_complexity_figure(args.checkpoint, data=args.figure_data)
    if args.dry_run:
        repo_id = check_repo_id(args.repo_id)
        readme = write_model_card(args.checkpoint, repo_id=repo_id, figure=args.figure)
        files = upload_file_list(args.checkpoint)
        print(f"wrote {readme}; would upload {len(files)} files to {repo_id}:")
        for name in files:
            print(f"  {name}")
        return 0
    url = push_checkpoint(
        args.checkpoint,
        args.repo_id,
        private=args.private,
        token=args.token,
        commit_message=args.message,
        figure=args.figure,
    )
    print(f"pushed {args.checkpoint} to {url}")
    return 0


def main(argv=None) -> int:
    return standalone("push", add_parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
