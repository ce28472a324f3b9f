"""The `occult-ft` console script (also `python -m occult_ft`).

Each subcommand lives in `occult_ft/commands/<name>.py` with `add_parser(subparsers)` (the parser
builder) and `run(args) -> int`; each module is also runnable alone (`python -m
occult_ft.commands.place ...`). Building a parser imports nothing heavy: torch, transformers and
deepspeed are imported by `run` where a command needs them, so `--help` and argument errors answer at
once (`tests/test_cli_startup.py` measures it).

One flag style in every command: `--max-tokens` and `--max_tokens` are the same flag, abbreviations
(`--device` for `--devices`) are refused, and an unknown flag or command is named together with the
closest valid one. Errors a user can cause (bad paths, files, flags, models) end the program with one
line `occult-ft <command>: error: ...` and exit status 2, never a traceback (set OCCULT_FT_DEBUG=1 to
see one).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from typing import NoReturn

from .checks import close_match

__all__ = [
    "COMMANDS",
    "HelpFormatter",
    "OneLineErrorParser",
    "build_parser",
    "close_match",
    "main",
    "run_command",
]

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


def _default_text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their lines as written (tables, examples); every option that has a default
    shows it once, as `(default: X)`. Options whose default is None or False explain what happens when
    they are left out in their own help text."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.required
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or "default" in text.lower()  # the help says it in its own words
        ):
            return text
        return f"{text} (default: {_default_text(default).replace('%', '%%')})"

    def _format_action_invocation(self, action):
        # `--max_steps, --max-steps N` rather than `--max_steps N, --max-steps N`
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        return f"{', '.join(action.option_strings)} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with one flag style and one-line errors.

    * `--max-tokens` and `--max_tokens` name the same option (help shows the spelling it was declared
      with); abbreviations are refused (`allow_abbrev=False`);
    * an unknown option is reported, with the closest valid one, before anything else is checked (so
      `place P --devcies 4` says `--devcies` is unknown, not that `--devices` is missing);
    * a bad flag ends with one line (`occult-ft place: error: ...`) and status 2, like every other user
      error; `--help` still prints the full usage, with every default shown (`HelpFormatter`).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    # ---- one flag style ------------------------------------------------------------------------
    def _long_options(self) -> dict[str, str]:
        """Every long option in its canonical spelling, keyed by its spelling with '-' for '_'."""
        return {
            opt.replace("_", "-"): opt
            for opt in self._option_string_actions
            if opt.startswith("--") and len(opt) > 2
        }

    def _subcommands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def normalise_flags(self, args: list[str]) -> list[str]:
        """`args` with every long option in its declared spelling; an unknown one is an error naming the
        closest valid option. Before a subcommand only this parser's own options are checked; after it,
        the subcommand's parser does the same."""
        options = self._long_options()
        commands = self._subcommands()
        out: list[str] = []
        takes_value = False
        for i, token in enumerate(args):
            if token == "--":
                return out + args[i:]
            if takes_value:  # the value of the option before (it may start with '-': a negative number)
                out.append(token)
                takes_value = False
                continue
            if commands and not token.startswith("-"):
                if token not in commands:
                    hint = close_match(token, commands)
                    did = f"; did you mean {hint!r}?" if hint else ""
                    self.error(f"unknown command {token!r}{did} commands: {', '.join(commands)}")
                return out + args[i:]
            if token.startswith("--") and len(token) > 2:
                name, eq, value = token.partition("=")
                canonical = options.get(name.replace("_", "-"))
                if canonical is None:
                    hint = close_match(name.replace("_", "-"), options)
                    did = f"; did you mean {options[hint]}?" if hint else ""
                    self.error(f"unrecognized argument {name}{did}")
                token = canonical + eq + value
                takes_value = not eq and self._option_string_actions[canonical].nargs is None
            out.append(token)
        return out

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if "-" in self.prefix_chars:
            args = self.normalise_flags(args)
        return super().parse_known_args(args, namespace)


def build_parser(commands=COMMANDS) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="occult-ft",
        description="Cheaper expert-parallel MoE training and serving: profile, place, prune, fine-tune, "
        "benchmark.\nEvery command takes --help; flags may be written --max-tokens or --max_tokens.",
    )
    # launchers such as `deepspeed --module occult_ft.cli` pass --local_rank before the command
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
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


def run_command(name: str, run, args: argparse.Namespace) -> int:
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
    """Notices of transformers that a user cannot act on would bury our one-line errors on stderr.
    Nothing is imported here (an error found before any model loads must come at once): transformers
    reads the environment when it is imported, and is told directly when it already is. A user's own
    TRANSFORMERS_VERBOSITY wins. Progress bars stay on: every phase that takes a while shows one."""
    if "TRANSFORMERS_VERBOSITY" not in os.environ:  # otherwise the user's choice stands
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    # PEFT reads a deprecated transformers property on every adapter: nothing a user can change
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")


def exit_process(code: int) -> NoReturn:
    """Leave the process with `code`. A process that ran a rank of a distributed run leaves through
    `occult_ft.dispatch.comm.exit_rank` (no interpreter finalization, where leftover gloo threads can
    abort a run that succeeded); any other exits normally, without importing torch for it."""
    if "occult_ft.dispatch.comm" in sys.modules:  # only a command that ran a model loaded it
        from .dispatch.comm import exit_rank

        exit_rank(code)
    sys.exit(code)


def entry() -> NoReturn:
    """The `occult-ft` console script."""
    exit_process(main())


if __name__ == "__main__":
    entry()
