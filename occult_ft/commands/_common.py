"""Pieces shared by several subcommands: loading a model with its data as batches."""

from __future__ import annotations

import argparse
import sys

__all__ = ["standalone", "load_data", "data_batches", "add_model_data_args", "positive_int"]


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
    p.add_argument("--data", required=data_required,
                   help="a .txt file, a .jsonl/.json file (text field or Alpaca instruction/input/output), "
                        "a saved dataset directory, or a Hub dataset id; 'embedded' = the shipped eval text")
    p.add_argument("--max-tokens", type=positive_int, default=65536, help="stop after this many tokens")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")


def load_data(data: str):
    """The raw dataset behind a --data value (checked before any model is loaded)."""
    from ..data import load_text_dataset

    if data == "embedded":
        from ..embedded import embedded_data_path

        data = embedded_data_path("eval")
    return load_text_dataset(data)


def data_batches(tokenizer, data, seq_len: int, batch_size: int, max_tokens: int | None = None) -> list[dict]:
    """Tokenised `data` (a --data value or a loaded dataset) as padded batches of `input_ids`,
    `attention_mask` and `labels` (-100 on padding, and on prompts of instruction rows); enough rows
    for `max_tokens`."""
    from ..data import DataError, make_collator, tokenize_dataset

    if tokenizer is None:
        raise DataError("the model has no tokenizer; save one beside the model (tokenizer.save_pretrained)")
    ds = load_data(data) if isinstance(data, str) else data
    ds = tokenize_dataset(ds, tokenizer, seq_len=seq_len)
    if len(ds) == 0:
        raise DataError(f"data {data if isinstance(data, str) else 'set'!r} gave no tokens; check the file is not empty")
    collate = make_collator(tokenizer)
    limit = len(ds) if max_tokens is None else min(len(ds), -(-max_tokens // seq_len))
    return [collate([ds[j] for j in range(i, min(i + batch_size, limit))]) for i in range(0, limit, batch_size)]


def standalone(module_name: str, add_parser, argv=None) -> int:
    """Run one command module on its own (`python -m occult_ft.commands.X`)."""
    from ..cli import run_command

    parser = argparse.ArgumentParser(prog=f"occult-ft {module_name}")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args([module_name, *(sys.argv[1:] if argv is None else argv)])
    return run_command(module_name, args.func, args)
