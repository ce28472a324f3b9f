"""Pieces shared by several subcommands: loading a model with its data as batches."""

from __future__ import annotations

import argparse
import sys

__all__ = ["standalone", "load_data", "data_batches", "add_model_data_args", "positive_int"]

from ..evaluation import data_batches, load_data  # noqa: E402  (re-exported for the commands)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def add_model_data_args(p: argparse.ArgumentParser, data_required: bool = True) -> None:
    p.add_argument("model", help="local model directory or Hub model id (with its tokenizer)")
    p.add_argument(
        "--data",
        required=data_required,
        help="a .txt file, a .jsonl/.json file (text field, Alpaca instruction/input/output, prompt/completion "
        "or chat messages), a saved dataset directory, or a Hub dataset id; 'embedded' = the shipped eval text",
    )
    p.add_argument(
        "--skip-invalid-rows",
        action="store_true",
        help="skip data rows that do not fit the file's layout (counted) instead of stopping at the first",
    )
    p.add_argument("--max-tokens", type=positive_int, default=65536, help="stop after this many tokens")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")


def standalone(module_name: str, add_parser, argv=None) -> int:
    """Run one command module on its own (`python -m occult_ft.commands.X`)."""
    from ..cli import OneLineErrorParser, run_command

    parser = OneLineErrorParser(prog=f"occult-ft {module_name}")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args([module_name, *(sys.argv[1:] if argv is None else argv)])
    return run_command(module_name, args.func, args)
