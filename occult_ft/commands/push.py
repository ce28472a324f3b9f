"""`occult-ft push`: upload a checkpoint directory to the Hugging Face Hub with an Occult model card.

    occult-ft push DIR --repo-id owner/name [--private] [--token T] [--message M] [--figure PNG] [--dry-run]

DIR is a full checkpoint (config.json, e.g. from `occult-ft prune` or `occult-ft train`) or a LoRA
adapter directory (adapter_config.json). The card (the uploaded README.md) records the base model, the
expert placement, the routing budget, measured comm_complexity and evaluation results, and how to load
the model. Nothing is written into DIR: the card and the figure go into a staged copy of it, which is
what gets uploaded. The endpoint (HF_ENDPOINT, default https://huggingface.co) is checked before the
figure is measured; a failed push names the endpoint and the step. `--dry-run` prints the files that
would be uploaded and the card, without contacting the Hub.
"""

from __future__ import annotations

import argparse

from ._common import phase, quiet_deepspeed_accelerator, standalone

__all__ = ["add_parser", "run", "main"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "push",
        help="upload a checkpoint to the Hub with an Occult model card",
        description=__doc__,
    )
    p.add_argument("checkpoint", metavar="DIR", help="full checkpoint or LoRA adapter directory")
    p.add_argument("--repo-id", required=True, help="Hub repo id, owner/name")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--token", default=None, help="Hub token; omitted: the logged-in token or HF_TOKEN")
    p.add_argument("--message", default="Upload occult_ft checkpoint", help="commit message")
    p.add_argument(
        "--figure",
        default=None,
        help="a PNG to show in the card; omitted: measure the checkpoint's comm_complexity on "
        "--figure-data and plot it",
    )
    p.add_argument(
        "--figure-data",
        default="embedded",
        help="text the measured figure routes (a --data value; 'embedded' is the shipped eval text)",
    )
    p.add_argument("--no-figure", action="store_true", help="no figure in the card")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the files that would be uploaded and the card; do not contact the Hub",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import tempfile

    quiet_deepspeed_accelerator()
    from ..checkpoint import describe_checkpoint
    from ..hub import (
        build_model_card,
        card_figure,
        check_endpoint,
        check_repo_id,
        push_checkpoint,
        staged_upload,
        upload_file_list,
    )

    repo_id = check_repo_id(args.repo_id)
    describe_checkpoint(args.checkpoint)  # a folder that is not a checkpoint fails here, before any work
    if not args.dry_run:
        check_endpoint()  # before the figure's measurement: a push that cannot happen fails at once
    with tempfile.TemporaryDirectory(prefix="occult-push-figure-") as scratch:
        figure = args.figure
        if figure is None and not args.no_figure:
            phase("push", f"measuring the checkpoint's comm_complexity on {args.figure_data} for the card")
            figure = card_figure(args.checkpoint, scratch, data=args.figure_data)
        if args.dry_run:
            card = str(build_model_card(args.checkpoint, repo_id=repo_id, figure=figure))
            with staged_upload(args.checkpoint, card, figure) as staged:
                files = upload_file_list(staged)
            print(f"would upload {len(files)} files to {repo_id} (nothing written into {args.checkpoint}):")
            for name in files:
                print(f"  {name}")
            print(f"\nthe card (README.md):\n\n{card}")
            return 0
        url = push_checkpoint(
            args.checkpoint,
            repo_id,
            private=args.private,
            token=args.token,
            commit_message=args.message,
            figure=figure,
        )
    print(f"pushed {args.checkpoint} to {url}")
    return 0


def main(argv=None) -> int:
    return standalone("push", add_parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
