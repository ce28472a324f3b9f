"""Writes that lose nothing: every artifact goes to a temporary sibling and is renamed into place.

A reader of a path written here sees the old artifact or the new one, never a mix: a crash, a full
disk or `kill -9` in the middle of a write leaves the previous artifact untouched (plus a hidden
`.<name>.tmp-*` sibling that the next write removes).

    atomic_write_text(path, text)          one file (JSON, model card, placement)
    atomic_save(path, save_fn)             one file written by a library call (`save_fn(tmp_path)`)
    atomic_directory(out_dir)              a whole directory (checkpoints): a context manager that
                                           yields a temporary sibling and swaps it in on success
    check_output_path(out, *inputs)        refuse an output that is one of the inputs or inside one
    read_json_object(path)                 a JSON file that must hold an object, with one-line errors
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

__all__ = [
    "OutputPathError",
    "atomic_write_text",
    "atomic_save",
    "atomic_directory",
    "check_output_path",
    "read_json_object",
]


class OutputPathError(ValueError):
    """An output path that would destroy an input or another artifact."""


def _sibling(path: str, kind: str) -> str:
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    return parent, f".{os.path.basename(os.path.abspath(path))}.{kind}-"


def atomic_save(path: str | os.PathLike, save_fn: Callable[[str], object]) -> str:
    """Call `save_fn(tmp)` to write a file at a temporary sibling of `path`, then rename it over `path`."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OutputPathError(f"{path!r} is a directory; pass a file path")
    parent, prefix = _sibling(path, "tmp")
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=parent)
    os.close(fd)
    try:
        save_fn(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> str:
    """Write `text` (UTF-8) to `path` through a temporary sibling."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_save(path, write)


@contextlib.contextmanager
def atomic_directory(out_dir: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary sibling directory; on success it replaces `out_dir` whole.

    An existing `out_dir` is renamed aside, the new one renamed in, and the old one removed, so no file
    of the previous artifact (a stale adapter, old weights) survives beside the new one. On an error
    the temporary directory is removed and `out_dir` is left as it was.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OutputPathError(f"output {out_dir!r} is a file; pass a directory path")
    parent, prefix = _sibling(out_dir, "tmp")
    for stale in os.listdir(parent):  # leftovers of an interrupted write of this same artifact
        if stale.startswith(prefix) or stale.startswith(prefix.replace(".tmp-", ".old-")):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.isdir(out_dir):
        old = tempfile.mkdtemp(prefix=prefix.replace(".tmp-", ".old-"), dir=parent)
        os.rmdir(old)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output_path(
    out: str | os.PathLike, *inputs: str | os.PathLike | None, what: str = "output"
) -> None:
    """Raise `OutputPathError` when `out` is one of `inputs`, lies inside an input directory, or contains
    an input (writing it would destroy what is being read). Hub ids and missing inputs are ignored."""
    out = os.fspath(out)
    for source in inputs:
        if source is None:
            continue
        source = os.fspath(source)
        if not os.path.exists(source):
            continue
        if _inside(out, source) or (os.path.isdir(out) and _inside(source, out)):
            raise OutputPathError(
                f"{what} {out!r} would overwrite the input {source!r}; write to a new path outside it"
            )


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object stored at `path`; a broken file or another JSON type is a one-line ValueError."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); rewrite or remove it"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object; rewrite or remove it")
    return data
