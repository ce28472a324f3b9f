"""The `occult-ft` console script (also `python -m occult_ft`).

Each subcommand lives in `occult_ft/commands/<name>.py` with `add_parser(subparsers)` (the parser
builder) and `run(args) -> int`; each module is also runnable alone (`python -m
occult_ft.commands.place ...`). Errors a user can cause (bad paths, files, flags, models) end the
program with one line `occult-ft <command>: error: ...` and exit status 2, never a traceback
(set OCCULT_FT_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["COMMANDS", "OneLineErrorParser", "build_parser", "main", "run_command"]

# name -> module under occult_ft.commands, in the order `occult-ft --help` lists them
COMMANDS = (
    "demo",
    "profile",
    "place",
    "prune",
    "analyze",
    "train",
    "plan",
    "eval",
    "push",
    "bench",
    "study",
    "convert",
)


def _load(name: str):
    return importlib.import_module(f"occult_ft.commands.{name}")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends with one line (`occult-ft place: error: ...`) and status 2,
    like every other user error; `--help` still prints the full usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser(commands=COMMANDS) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="occult-ft",
        description="Cheaper expert-parallel MoE training and serving: profile, place, prune, fine-tune, benchmark.",
    )
    # launchers such as `deepspeed --module occult_ft.cli` pass --local_rank before the command
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands:
        try:
            module = _load(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("occult_ft.commands"):
                continue  # command not built into this install
            raise
        module.add_parser(sub)
    return parser


def run_command(name: str, run, args) -> int:
    """Run one command, turning user errors into one line and exit status 2."""
    _quiet_libraries()
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print(f"occult-ft {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI promises one line, never a traceback
        if os.environ.get("OCCULT_FT_DEBUG"):
            raise
        msg = " ".join(str(exc).split()) or type(exc).__name__
        print(f"occult-ft {name}: error: {msg}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return run_command(args.command, args.func, args)


def _quiet_libraries() -> None:
    """Progress bars of transformers/datasets would bury our one-line errors on stderr."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
