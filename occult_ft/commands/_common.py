"""Pieces shared by several subcommands: model and data arguments, loading data as batches, phase
lines, and the one behaviour for Hub ids that cannot be reached.

Nothing here imports torch or the Hub libraries at module level: parsers are built from it, and
`occult-ft --help` must answer at once.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

__all__ = [
    "YAML_MAX_BYTES",
    "YAML_MAX_NODES",
    "read_yaml",
    "standalone",
    "load_data",
    "load_args_data",
    "data_batches",
    "add_model_data_args",
    "positive_int",
    "phase",
    "note",
    "note_data_ran_out",
    "is_hub_id",
    "check_hub_sources",
    "quiet_deepspeed_accelerator",
]


#: A recipe is a few KB of `field: value` lines (the shipped ones: under 4 KB, under 300 YAML nodes).
YAML_MAX_BYTES = 1 << 20
#: The most YAML nodes a file may hold once its aliases are expanded: an alias bomb (nine lists of nine
#: aliases to the previous one) is a few hundred bytes that expand to 9**9 leaves
YAML_MAX_NODES = 100_000


def _expanded_nodes(root, limit: int) -> int | None:
    """Nodes of a composed YAML document with every alias expanded, counted without expanding anything
    (each distinct node once: 1 + its children's counts, capped at limit + 1); None for an alias that
    refers to a node containing it (a cycle, which expands forever)."""
    import yaml

    def children(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return ()

    counts: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose subtree is being counted (a node met again inside is a cycle)
    stack = [(root, False)]
    while stack:  # iterative post-order: a deep document cannot exhaust the Python stack here
        node, closing = stack.pop()
        key = id(node)
        if closing:
            open_.discard(key)
            counts[key] = min(limit + 1, 1 + sum(counts[id(c)] for c in children(node)))
            continue
        if key in counts:
            continue
        if key in open_:
            return None
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in counts)
    return counts[id(root)]


def read_yaml(path: str, what: str = "recipe"):
    """The content of a YAML (or JSON) file, read with safe tags only and bounded: a file over
    `YAML_MAX_BYTES`, aliases that expand past `YAML_MAX_NODES` nodes (an alias bomb) or refer to
    themselves, nesting deeper than Python's stack, or invalid YAML is a one-line ValueError naming the
    file (`what` names its role) and the fix, raised before anything is expanded. Every YAML occult_ft reads
    goes through here."""
    import yaml

    from ..fileio import read_text

    if os.path.isfile(path) and os.path.getsize(path) > YAML_MAX_BYTES:
        raise ValueError(
            f"{what} {path!r} is {os.path.getsize(path)} bytes, over the {YAML_MAX_BYTES} a {what} may hold; "
            "a recipe is a short mapping of field: value lines"
        )
    text = read_text(path)  # one line naming the file when it is missing or not UTF-8 text
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_nodes(node, YAML_MAX_NODES)
        if size is None:
            raise ValueError(
                f"{what} {path!r} has an alias (*name) inside the value it names (&name), which expands "
                "forever; write the value out"
            )
        if size > YAML_MAX_NODES:
            raise ValueError(
                f"{what} {path!r} expands to more than {YAML_MAX_NODES} YAML nodes through its aliases "
                "(&name / *name), an alias bomb; write the values out without aliases"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{what} {path!r} is not valid YAML{where}") from None
    except RecursionError:
        raise ValueError(
            f"{what} {path!r} nests its values too deeply to read; a recipe is a mapping of field: value"
        ) from None
    finally:
        loader.dispose()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def add_model_data_args(
    p: argparse.ArgumentParser,
    data_required: bool = True,
    embedded_split: str = "eval",
    max_tokens: int = 65536,
) -> None:
    """MODEL, --data, --split, --max-tokens, --seq-len, --batch-size.

    Args:
        embedded_split: the split `--data embedded` reads unless --split says otherwise (profile: train,
            so that placement is not fitted on the evaluation text; analyze, eval, bench: eval).
    """
    p.add_argument("model", help="local model directory or Hub model id (with its tokenizer)")
    p.add_argument(
        "--data",
        required=data_required,
        help="a .txt file, a .jsonl/.json file (text field, Alpaca instruction/input/output, prompt/completion "
        "or chat messages), a saved dataset directory, or a Hub dataset id; 'embedded' = the shipped corpus",
    )
    p.add_argument(
        "--split",
        default=None,
        help="split of --data: for 'embedded' one of train, eval, instructions; for a saved dataset or Hub id "
        f"its split name; a single file has none (default: {embedded_split} for 'embedded', else train)",
    )
    p.set_defaults(embedded_split=embedded_split)
    p.add_argument(
        "--skip-invalid-rows",
        action="store_true",
        help="skip data rows that do not fit the file's layout (counted) instead of stopping at the first",
    )
    p.add_argument("--max-tokens", type=positive_int, default=max_tokens, help="stop after this many tokens")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")


def load_data(
    data: str, split: str | None = None, embedded_split: str = "eval", skip_invalid_rows: bool = False
):
    """The raw dataset behind a --data value and its --split (checked before any model is loaded; rows
    that do not fit its layout are an error, or skipped and counted with `skip_invalid_rows`)."""
    from ..data import load_text_dataset

    if data == "embedded":
        return load_text_dataset("embedded", split=split or embedded_split)
    return load_text_dataset(data, split=split, skip_invalid_rows=skip_invalid_rows)


def load_args_data(args: argparse.Namespace):
    """`load_data` of a command's parsed --data, --split and --skip-invalid-rows."""
    return load_data(
        args.data,
        getattr(args, "split", None),
        getattr(args, "embedded_split", "eval"),
        getattr(args, "skip_invalid_rows", False),
    )


def data_batches(
    tokenizer, data, seq_len: int, batch_size: int, max_tokens: int | None = None, response_only: bool = True
) -> list[dict]:
    """`occult_ft.evaluation.data_batches` (imported when called)."""
    from ..evaluation import data_batches as batches

    return batches(tokenizer, data, seq_len, batch_size, max_tokens, response_only)


def check_plot_arg(plot: str | None, *inputs, written: tuple = ()) -> None:
    """`--plot`, before any work: a .png in an existing directory, not an input nor inside one, and not
    a path the command writes something else to (`written`, e.g. its `--out`)."""
    if plot is None:
        return
    from ..fileio import check_output_path
    from ..plots.base import check_figure_path

    check_output_path(plot, *inputs, what="--plot")
    for other in written:
        if other is not None and os.path.realpath(other) == os.path.realpath(plot):
            raise ValueError(
                f"--plot {plot!r} is also where this command writes {other!r}; give the figure its own path"
            )
    check_figure_path(plot)


def phase(command: str, text: str) -> None:
    """`occult-ft COMMAND: TEXT ...` on stderr: what a command does next, for phases that take more than
    a few seconds and have no progress bar of their own (stdout stays the command's result)."""
    print(f"occult-ft {command}: {text} ...", file=sys.stderr, flush=True)


def note(command: str, text: str) -> None:
    """`occult-ft COMMAND: note: TEXT` on stderr: something the result depends on that the user may not
    expect (the data ran out, settings taken from a run, the Hub read from its cache)."""
    print(f"occult-ft {command}: note: {text}", file=sys.stderr, flush=True)


def note_data_ran_out(command: str, data: str, got: int, asked: int) -> None:
    """Say so when --data held fewer tokens than --max-tokens asked for: the results cover fewer tokens."""
    if got < asked:
        note(
            command,
            f"--data {data} ran out after {got:,} of the {asked:,} tokens --max-tokens asked for; the result "
            f"covers {got:,} tokens (pass more data, or --max-tokens {got} to silence this)",
        )


def quiet_deepspeed_accelerator() -> None:
    """Without a GPU, DeepSpeed warns at every start (it is imported by transformers' model loading) that
    it fell back to its CPU accelerator; naming that accelerator is the same choice without the warning.
    A machine with any accelerator is left to DeepSpeed's own detection. Imports torch: call it where a
    command starts its real work."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.accelerator.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


# ---- Hub ids -------------------------------------------------------------------------------------
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".yaml", ".yml", ".safetensors", ".bin", ".csv", ".parquet")


def is_hub_id(name) -> bool:
    """Whether `name` is read as a Hub repo id (`owner/name` or `name`): not 'embedded', not an existing
    path, not a file name."""
    return (
        isinstance(name, str)
        and name != "embedded"
        and bool(_HUB_ID.match(name))
        and not name.lower().endswith(_FILE_SUFFIXES)
        and not os.path.exists(name)
    )


def check_hub_sources(command: str, models=(), datasets=()) -> None:
    """One behaviour for every command when a Hub id is given and the Hub cannot be reached: one line at
    once, naming the id, the endpoint and the reason, instead of a minute of retries. Ids found in the
    Hub cache are then read from it (offline mode), with one note saying so.

    Args:
        command: the command's name, for the note.
        models: --model values (local directories, 'embedded' and None are skipped).
        datasets: --data / dataset values (local files and directories, 'embedded' and None are skipped).

    Raises:
        ValueError: a Hub id that is not in the cache while the Hub cannot be reached (or HF_HUB_OFFLINE
            is set).
    """
    from ..hub_access import (
        go_offline,
        hub_cache,
        hub_endpoint,
        hub_unreachable,
        is_cached,
        offline_requested,
    )

    hub_models = [m for m in models if is_hub_id(m)]
    hub_data = [d for d in datasets if is_hub_id(d)]
    if not hub_models and not hub_data:
        return
    missing = [("model", m) for m in hub_models if not is_cached(m, "models")]
    missing += [("dataset", d) for d in hub_data if not is_cached(d, "datasets")]
    if offline_requested():
        if missing:
            what, name = missing[0]
            raise ValueError(
                f"{what} {name!r} is not a local {'directory' if what == 'model' else 'file or directory'} and "
                f"not in the Hub cache {hub_cache()}, and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to "
                f"download it, or pass a local {'model directory' if what == 'model' else 'data file'}"
            )
        return
    reason = hub_unreachable()
    if reason is None:
        return
    if missing:
        what, name = missing[0]
        local = (
            "a local model directory"
            if what == "model"
            else "a local .txt / .jsonl / .json file or a save_to_disk directory"
        )
        raise ValueError(
            f"{what} {name!r} is not a local path, so it is read from the Hub, but the Hub at {hub_endpoint()} "
            f"cannot be reached ({reason}) and {name!r} is not in the cache {hub_cache()}; pass {local}"
        )
    go_offline()
    note(
        command,
        f"the Hub at {hub_endpoint()} cannot be reached ({reason}); reading "
        f"{', '.join(hub_models + hub_data)} from the cache {hub_cache()}",
    )


def standalone(module_name: str, add_parser, argv=None) -> int:
    """Run one command module on its own (`python -m occult_ft.commands.X`)."""
    from ..cli import OneLineErrorParser, run_command

    parser = OneLineErrorParser(prog="occult-ft")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args([module_name, *(sys.argv[1:] if argv is None else argv)])
    return run_command(module_name, args.func, args)
