"""Files that lose nothing: how every artifact is written, where it may go, and how files are read.

Writing. Every artifact goes to a temporary sibling and is renamed into place, so a reader sees the
old artifact or the new one, never a mix; a crash, a full disk or `kill -9` in the middle leaves the
previous artifact readable. Files and directories get the permissions a plain `open()` / `mkdir`
would give them (the umask applied; an existing file keeps its mode), not the private 0600 / 0700 of
`tempfile`. The directory swap, step by step: the comments above `recover_directory`.

    atomic_write_text(path, text)          one file (JSON, model card, placement)
    atomic_save(path, save_fn)             one file written by a library call (`save_fn(tmp_path)`)
    atomic_directory(out_dir)              a whole directory (checkpoints): a context manager that
                                           yields a temporary sibling and swaps it in on success
    recover_directory(out_dir)             finish (or undo) a directory swap that was interrupted
    umask_modes(path)                      files written private by a library (safetensors) get the
                                           modes of a plain open() / mkdir
    check_output_path / WRITTEN            where outputs may go; who owns each entry of an output folder
    check_results_dir                      a demo's or study's results folder: only its own entries

Reading (`reading`, `reading_directory`, `read_json_object`, `read_text`, `load_safetensors`,
`torch_load`): a file that cannot be read (missing, not UTF-8, not JSON, a truncated safetensors file,
a pickle that holds code) is one `ReadError` line, `could not read FILE: reason; fix`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import glob
import json
import os
import pickle
import platform
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "OutputPathError",
    "ReadError",
    "WRITTEN",
    "Written",
    "CONVERTED_MARK",
    "atomic_write_text",
    "atomic_save",
    "atomic_directory",
    "recover_directory",
    "umask_modes",
    "check_output_path",
    "check_results_dir",
    "foreign_entries",
    "is_artifact",
    "model_card_writer",
    "reading",
    "reading_directory",
    "read_error",
    "read_json_object",
    "read_text",
    "load_safetensors",
    "torch_load",
]


class OutputPathError(ValueError):
    """An output path that would destroy an input, the user's files or another artifact."""


class ReadError(ValueError):
    """A file that cannot be read: `could not read FILE: reason; fix`."""


# ---- permissions: what a plain open() / mkdir would give -------------------------------------------
def _read_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; set it straight back
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once, at import (os.umask is process-wide and not thread-safe)


def _new_mode(path: str, directory: bool) -> int:
    """The mode `path` gets: its current one when it exists, else the umask applied to 0666 / 0777."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(path).st_mode)
    return (0o777 if directory else 0o666) & ~_UMASK


def umask_modes(path: str | os.PathLike) -> None:
    """Give `path` (recursively) the permissions of a plain `open()` / `mkdir`: files left private
    (0600, as `tempfile` and safetensors create them) and directories left 0700 get the umask's modes;
    other modes are left as their owner set them."""
    path = os.fspath(path)
    for root, dirs, files in os.walk(path) if os.path.isdir(path) else [("", [], [path])]:
        for name, private, wanted in [(d, 0o700, 0o777) for d in dirs] + [(f, 0o600, 0o666) for f in files]:
            full = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if not os.path.islink(full) and stat.S_IMODE(os.lstat(full).st_mode) == private:
                    os.chmod(full, wanted & ~_UMASK)


# ---- files -----------------------------------------------------------------------------------------
def _sibling(path: str, kind: str) -> tuple[str, str]:
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    return parent, f".{os.path.basename(os.path.abspath(path))}.{kind}-"


def atomic_save(path: str | os.PathLike, save_fn: Callable[[str], object]) -> str:
    """Call `save_fn(tmp)` to write a file at a temporary sibling of `path`, then rename it over `path`."""
    path = os.fspath(path)
    if not path.strip():
        raise OutputPathError("the output path is empty; pass a file path")
    if os.path.isdir(path):
        raise OutputPathError(f"{path!r} is a directory; pass a file path")
    mode = _new_mode(path, directory=False)
    parent, prefix = _sibling(path, "tmp")
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=parent)
    os.close(fd)
    try:
        save_fn(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # after save_fn, which may have re-created the file
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


# ---- directories -----------------------------------------------------------------------------------
def _swap_names(out_dir: str) -> tuple[str, str, str, str]:
    parent, name = os.path.split(out_dir)
    return parent, os.path.join(parent, f".{name}.tmp-"), os.path.join(parent, f".{name}.new"), name


def _retired(out_dir: str) -> list[str]:
    """`.NAME.old` and the `.NAME.old-*` of earlier releases, most recent first."""
    parent, _, _, name = _swap_names(out_dir)
    found = [p for p in [os.path.join(parent, f".{name}.old")] if os.path.isdir(p)]
    found += glob.glob(os.path.join(glob.escape(parent), glob.escape(f".{name}.old-") + "*"))
    return sorted(set(found), key=lambda p: os.stat(p).st_mtime, reverse=True)


# The directory swap. On Linux the new copy and NAME are exchanged in one atomic step
# (`renameat2(RENAME_EXCHANGE)`, through ctypes), so NAME is at every instant the old artifact or the
# new one, for any reader (stock transformers, PEFT, `ls`, a copy script):
#
#     write .NAME.tmp-*             NAME = old       incomplete: removed by the next write, ignored by readers
#     exchange .NAME.tmp-* <-> NAME NAME = new       the old copy, now at .NAME.tmp-*, is removed by the next write
#     .NAME.tmp-* -> .NAME.old      NAME = new       .NAME.old is removed (by `recover_directory` if killed)
#     remove .NAME.old              NAME = new       what is left of .NAME.old is removed
#
# Where the call is unavailable (another OS, an old kernel or libc, a filesystem that answers EINVAL)
# the swap is journalled by names, `.NAME.new` (complete) and `.NAME.old` (retired): NAME is missing
# for a moment, and `recover_directory` (run by the next write and by the model loader) always ends a
# swap killed at any instant in the last state:
#
#     write .NAME.tmp-*         NAME = old       incomplete: removed by the next write, ignored by readers
#     .NAME.tmp-* -> .NAME.new  NAME = old       the new artifact is complete: the swap is finished
#     NAME -> .NAME.old         NAME missing     the swap is finished (.NAME.new -> NAME)
#     .NAME.new -> NAME         NAME = new       .NAME.old is removed
#     remove .NAME.old          NAME = new       what is left of .NAME.old is removed
def recover_directory(out_dir: str | os.PathLike) -> None:
    """Finish a directory swap of `atomic_directory` that a killed process left half done (see the module
    docstring): afterwards `out_dir` is the old or the new artifact and no `.new` / `.old` sibling is
    left. Temporary `.tmp-*` siblings (writes still in progress, or killed) are left to the next write.
    Safe to call on any path, and by readers."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent, _, new, name = _swap_names(out_dir)
    if not name or not os.path.isdir(parent):
        return
    old = os.path.join(parent, f".{name}.old")
    if os.path.isdir(new):  # the new artifact is complete: it becomes out_dir
        if os.path.isdir(out_dir):
            if os.path.isdir(old):
                shutil.rmtree(old)  # a retired copy of an earlier swap: out_dir supersedes it
            with contextlib.suppress(FileNotFoundError):  # another reader may be finishing it too
                os.replace(out_dir, old)
        with contextlib.suppress(FileNotFoundError):
            os.replace(new, out_dir)
    for retired in _retired(out_dir):
        if os.path.isdir(out_dir):
            shutil.rmtree(retired, ignore_errors=True)
        else:  # out_dir was retired and nothing new took its place: it comes back
            with contextlib.suppress(FileNotFoundError):
                os.replace(retired, out_dir)


# renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE): <fcntl.h>, <linux/fs.h>; its system call number
# where libc has no wrapper (glibc < 2.28): <asm/unistd_64.h>, <asm/unistd_32.h>, and <asm-generic/unistd.h>
# for arm64, riscv64 and loongarch64
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_RENAMEAT2_SYSCALL = {
    "x86_64": 316,
    "i386": 353,
    "i686": 353,
    "aarch64": 276,
    "riscv64": 276,
    "loongarch64": 276,
}
# what a kernel, filesystem or sandbox that cannot exchange answers: the journal is used instead
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM, errno.ENOENT}


@functools.cache
def _renameat2(libc_wrapper: bool = True) -> Callable[[bytes, bytes, int], int] | None:
    """`renameat2` relative to the working directory (0, or -1 with errno set): libc's wrapper, else
    (or with `libc_wrapper=False`) the system call; None off Linux or with neither."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    wrapper = getattr(libc, "renameat2", None) if libc_wrapper else None
    if wrapper is not None:
        wrapper.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        wrapper.restype = ctypes.c_int
        return lambda a, b, flags: wrapper(_AT_FDCWD, a, _AT_FDCWD, b, flags)
    number = _RENAMEAT2_SYSCALL.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    return lambda a, b, flags: syscall(
        ctypes.c_long(number),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(a),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(b),
        ctypes.c_uint(flags),
    )


def _exchange_directories(a: str, b: str) -> bool:
    """Exchange the directories `a` and `b` in one atomic step; False (nothing moved) where that is not
    possible: no renameat2, a filesystem or sandbox refusing RENAME_EXCHANGE, or `b` missing."""
    call = _renameat2()
    if call is None:
        return False
    if call(os.fsencode(a), os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


@contextlib.contextmanager
def atomic_directory(out_dir: str | os.PathLike, what: str = "output") -> Iterator[str]:
    """Yield a temporary sibling directory; on success it replaces `out_dir` whole.

    `out_dir` must be missing, empty or an artifact of this project (`check_output_path`), so a user's
    files are never replaced. The swap leaves no file of the previous artifact (a stale adapter, old
    weights) beside the new one, and is recoverable at every instant (`recover_directory`). On an
    error the temporary directory is removed and `out_dir` is left as it was.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    recover_directory(out_dir)  # an interrupted swap first, so the check below sees the artifact
    check_output_path(out_dir, what=what, directory=True)
    parent, prefix, new, name = _swap_names(out_dir)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(glob.escape(prefix) + "*"):  # writes of this artifact that were killed
        shutil.rmtree(stale, ignore_errors=True)
    mode = _new_mode(out_dir, directory=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(prefix), dir=parent)
    os.chmod(tmp, mode)
    try:
        yield tmp
        umask_modes(tmp)  # safetensors writes its files 0600
        if _exchange_directories(tmp, out_dir):  # out_dir is the new artifact, tmp the old one
            with contextlib.suppress(OSError):  # retired: recover_directory removes it, also if killed
                os.replace(tmp, os.path.join(parent, f".{name}.old"))
            shutil.rmtree(tmp, ignore_errors=True)  # in case it could not be retired by name
        else:  # the journal: complete, and from here on every reader ends up with the new artifact
            os.replace(tmp, new)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    recover_directory(out_dir)


# ---- who writes what: the one ownership rule ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Written:
    """A name that a writer of checkpoints or of a training run's `output_dir` puts into a directory.

    pattern: a regular expression matched against the whole entry name.
    kind: `file`; `folder`, kept whole (logs, DeepSpeed's and FSDP's state); `checkpoint`, a Trainer
        `checkpoint-N` folder whose entries are checked against this table again; `card`, a README.md
        that is this project's only when `model_card_writer` finds a writer of this table that wrote it
        there.
    top: only at the top of a directory, never inside a `checkpoint-N` folder.
    """

    pattern: str
    writer: str
    kind: str = "file"
    top: bool = False


#: every entry transformers, PEFT, Trainer, DeepSpeed, TensorBoard and occult_ft write into a checkpoint
#: or a training run's output_dir (transformers 5.x, PEFT 0.21, DeepSpeed 0.19); nothing else is theirs
WRITTEN = (
    # a transformers checkpoint (`save_pretrained`), its tokenizer or processor and remote code
    Written(r"config\.json", "transformers"),
    Written(r"generation_config\.json", "transformers"),
    Written(r"model(-\d+-of-\d+)?\.safetensors", "transformers"),
    Written(r"model\.safetensors\.index\.json", "transformers"),
    Written(r"pytorch_model(-\d+-of-\d+)?\.bin", "transformers"),
    Written(r"pytorch_model\.bin\.index\.json", "transformers"),
    Written(r"(tokenizer|special_tokens_map|added_tokens|vocab|chat_template)\.json", "transformers"),
    Written(r"tokenizer_config\.json", "transformers"),
    Written(r"vocab\.txt|merges\.txt|tokenizer\.model|spiece\.model|.+\.tiktoken", "transformers"),
    Written(r"chat_template\.jinja", "transformers"),
    Written(r"additional_chat_templates", "transformers", kind="folder"),
    Written(r"(pre)?processor_config\.json", "transformers"),
    Written(r"(modeling|configuration|tokenization)_\w+\.py", "transformers"),
    # PEFT (`PeftModel.save_pretrained`; its model card in every adapter folder)
    Written(r"adapter_config\.json", "PEFT"),
    Written(r"adapter_model\.(safetensors|bin)", "PEFT"),
    Written(r"README\.md", "PEFT or occult_ft", kind="card"),
    # occult_ft (its model card: the README.md row above)
    Written(r"occult_config\.json|occult_similarity\.tables|occult_pruned_routing\.py", "occult_ft"),
    Written(
        r"occult_similarity\.safetensors", "occult_ft"
    ),  # occult_ft 0.1's tables file (vLLM read it as weights)
    Written(r"comm_complexity\.png", "occult_ft"),
    Written(r"optimizer_expert_shard_\d+_of_\d+\.pt", "occult_ft"),
    # Trainer: run state in every checkpoint-N, results and the checkpoint folders at the top
    Written(r"training_args\.bin|trainer_state\.json", "Trainer"),
    Written(r"optimizer(_\d+)?\.(pt|bin)|scheduler\.pt|scaler\.pt", "Trainer"),
    Written(r"rng_state(_\d+)?\.pth", "Trainer"),  # one per process under a launcher
    Written(r"pytorch_model_fsdp(_\d+)?(\.bin)?", "Trainer"),  # FSDP: a file per rank, or
    Written(r"pytorch_model_fsdp(_\d+)?|optimizer_\d+", "Trainer", kind="folder"),  # a sharded folder
    Written(r"(all|train|eval)_results\.json", "Trainer", top=True),
    Written(r"checkpoint-\d+", "Trainer", kind="checkpoint", top=True),
    Written(r"runs", "TensorBoard", kind="folder", top=True),  # logging_dir: runs/DATE_HOST
    # DeepSpeed (`engine.save_checkpoint`): the state folder, the tag of the latest one, the converter
    Written(r"global_step\d+", "DeepSpeed", kind="folder"),
    Written(r"latest|zero_to_(fp32|torch)\.py", "DeepSpeed"),  # engine._copy_recovery_script: both
)
_WRITTEN_NAME = re.compile("|".join(f"(?:{w.pattern})" for w in WRITTEN))
#: the key `occult_ft.checkpoint.convert` writes into the index metadata of a converted checkpoint
CONVERTED_MARK = "converted_by_occult_ft"
_CARD_TAG = "occult"  # the tag of occult_ft model cards (occult_ft.checkpoint.card.CARD_TAGS)
# files that only occult_ft writes, and the state files of a training run
_MARKS = (
    "occult_config.json",
    "occult_similarity.tables",
    "occult_similarity.safetensors",
    "occult_pruned_routing.py",
)
_RUN_MARKS = ("trainer_state.json", "training_args.bin")


def model_card_writer(path: str | os.PathLike) -> str | None:
    """The library that wrote the model card (README.md) at `path`, read from its YAML front matter:
    `occult_ft` (the `occult` tag), `PEFT` (`library_name: peft`, the card `PeftModel.save_pretrained`
    writes beside every adapter, checkpoint-N folders included), or None: not a card of theirs."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
    except (OSError, UnicodeDecodeError):
        return None
    if not head.startswith("---") or head.count("---") < 2:
        return None
    meta = [line.strip() for line in head.split("---", 2)[1].splitlines()]
    if f"- {_CARD_TAG}" in meta:
        return "occult_ft"
    if "library_name: peft" in meta:
        return "PEFT"
    return None


def _writer(directory: str, name: str, in_checkpoint: bool) -> Written | None:
    """The row of `WRITTEN` that accounts for the entry `name` of `directory`, or None: the user's."""
    path = os.path.join(directory, name)
    is_dir = os.path.isdir(path)
    for row in WRITTEN:
        if (in_checkpoint and row.top) or not re.fullmatch(row.pattern, name):
            continue
        if row.kind == "card":
            writer = None if is_dir else model_card_writer(path)
            # PEFT writes its card only beside an adapter; occult_ft's card is ours wherever it is
            if writer == "occult_ft" or (
                writer == "PEFT" and os.path.isfile(os.path.join(directory, "adapter_config.json"))
            ):
                return row
        elif is_dir == (row.kind != "file"):
            return row
    return None


def _listing(directory: str) -> list[str]:
    with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a checkpoint rotated away)
        return sorted(os.listdir(directory))
    return []


def foreign_entries(directory: str | os.PathLike, _in_checkpoint: bool = False) -> list[str]:
    """Entries of `directory` (relative paths, sorted; folders end in `/`) that no writer of `WRITTEN`
    put there: the files a user keeps there. `checkpoint-N` folders are looked into; a README.md is
    foreign unless it is occult_ft's model card, or PEFT's beside an adapter."""
    directory = os.fspath(directory)
    found = []
    for name in _listing(directory):
        row = _writer(directory, name, _in_checkpoint)
        if row is None:
            found.append(name + ("/" if os.path.isdir(os.path.join(directory, name)) else ""))
        elif row.kind == "checkpoint":
            found.extend(f"{name}/{inner}" for inner in foreign_entries(os.path.join(directory, name), True))
    return found


def _json_has(path: str, *keys: str) -> bool:
    """Whether the JSON object at `path` holds the nested key `keys` (False when unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for key in keys:
            data = data[key]
    except (OSError, ValueError, TypeError, KeyError):
        return False
    return True


def _marked(directory: str) -> bool:
    """A mark of this project in `directory` or one of its `checkpoint-N` folders: a file only occult_ft
    writes, a config.json with an `occult` block, an occult_ft model card, the index of a converted
    checkpoint, or a Trainer's state."""

    def marked(path: str) -> bool:
        names = _listing(path)
        return (
            any(n in names for n in _MARKS + _RUN_MARKS)
            or _json_has(os.path.join(path, "config.json"), "occult")  # the occult block
            or _json_has(os.path.join(path, "model.safetensors.index.json"), "metadata", CONVERTED_MARK)
            or model_card_writer(os.path.join(path, "README.md")) == "occult_ft"
        )

    return marked(directory) or any(
        marked(os.path.join(directory, n))
        for n in _listing(directory)
        if re.fullmatch(r"checkpoint-\d+", n) and os.path.isdir(os.path.join(directory, n))
    )


def is_artifact(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a checkpoint or training output of this project: nothing foreign in it
    (`foreign_entries`) and a mark of its own (`_marked`: occult_ft's files, a config.json with an
    `occult` block, an occult_ft card, a converted checkpoint's index, a Trainer's state)."""
    directory = os.fspath(directory)
    return os.path.isdir(directory) and not foreign_entries(directory) and _marked(directory)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


# Where outputs may go (`check_output_path`, used by every command and by the trainer). An output is
# refused, in one line naming it, when it is empty or would overwrite an input. Who owns an entry of an
# output directory is decided in one place, `WRITTEN`: every name transformers, PEFT, Trainer, DeepSpeed,
# TensorBoard and occult_ft write into a checkpoint or a run's `output_dir` (`checkpoint-N` folders are
# looked into; a README.md is ours only when it is occult_ft's model card, or PEFT's beside an adapter;
# `model_card_writer`); everything else is the user's (`foreign_entries`). A directory replaced whole (a
# checkpoint) must be missing, empty or an artifact of this project (`is_artifact`: nothing foreign, and a
# mark of occult_ft or of a training run), and is never the working directory; a directory written into
# (a training run's `output_dir`) must not hold files of the user's at the names the run writes (their
# README.md, a model occult_ft did not write). So a user's own files are never replaced.
def check_output_path(
    out: str | os.PathLike | None,
    *inputs: str | os.PathLike | None,
    what: str = "output",
    directory: bool = False,
    replace: bool = True,
) -> None:
    """Refuse (`OutputPathError`, one line naming `out` and the fix) an output that would lose something.

    Refused: an empty path; a file output that is a directory, a directory output that is a file;
    `out` equal to one of `inputs` or inside an input directory (Hub ids and missing inputs are
    ignored). For a directory (`directory=True`):

    - replaced whole (`replace=True`: a checkpoint, `atomic_directory`): an input inside it, the working
      directory or one above it, or a directory that is not empty and not an artifact of this project
      (`is_artifact`): every file of a user's would be lost;
    - written into (`replace=False`: a training run's `output_dir`): a directory holding files that the
      run would overwrite and that are not this project's (a user's README.md, a model occult_ft did
      not write, an input at such a name). Other files of the user's are left alone.
    """
    if out is None or not os.fspath(out).strip():
        kind = "directory" if directory else "file"
        raise OutputPathError(f"{what} is empty; pass the {kind} to write, e.g. {what} my-{kind}")
    out = os.fspath(out)
    for source in inputs:
        if source is not None and os.fspath(source) and os.path.exists(source):
            _check_not_input(out, os.fspath(source), what, written_into=directory and not replace)
    if not directory:
        if os.path.isdir(out):
            raise OutputPathError(f"{what} {out!r} is a directory; pass a file path inside it")
        return
    _check_directory_path(out, what, replace)
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if replace:
        _check_replaced_directory(out, what)
    else:
        _check_written_directory(out, what)


def _check_directory_path(out: str, what: str, replace: bool) -> None:
    """A directory output is not a file, nor (replaced whole) the working directory or one above it."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputPathError(f"{what} {out!r} is a file; pass a directory path")
    if replace and _inside(os.getcwd(), out):
        raise OutputPathError(
            f"{what} {out!r} is the working directory or holds it; pass a new directory, e.g. {what} out"
        )


def _check_not_input(out: str, source: str, what: str, written_into: bool) -> None:
    """Refuse `out` equal to the existing input `source`, inside it, or holding it (a directory written
    into holds it only at a name the run writes)."""
    contains = os.path.isdir(out) and _inside(source, out)
    if contains and written_into:  # written into: only an input at a written name is hit
        top = os.path.relpath(os.path.realpath(source), os.path.realpath(out)).split(os.sep)[0]
        contains = top == "." or bool(_WRITTEN_NAME.fullmatch(top))
    if _inside(out, source) or contains:
        raise OutputPathError(
            f"{what} {out!r} would overwrite the input {source!r}; write to a new path outside it"
        )


def _check_written_directory(out: str, what: str) -> None:
    """A training run's non-empty `output_dir`: refuse files the run would overwrite that are not this
    project's; the user's other files stay as they are."""
    foreign = [f for f in foreign_entries(out) if _WRITTEN_NAME.fullmatch(f.split("/")[0])]
    written = [  # files the run writes over (logs and checkpoint folders are checked above)
        n
        for n in sorted(os.listdir(out))
        if _WRITTEN_NAME.fullmatch(n) and os.path.isfile(os.path.join(out, n))
    ]
    if foreign:
        raise OutputPathError(
            f"{what} {out!r} holds files of yours that training would overwrite ({_shown(foreign)}); "
            "pass a new or empty directory"
        )
    if written and not _marked(out):
        raise OutputPathError(
            f"{what} {out!r} holds a model occult_ft did not write ({_shown(written)}), which training "
            "would overwrite; pass a new or empty directory"
        )


def _check_replaced_directory(out: str, what: str) -> None:
    """A non-empty directory replaced whole: only an artifact of this project may go."""
    if is_artifact(out):
        return
    foreign = foreign_entries(out)
    if foreign:
        raise OutputPathError(
            f"{what} {out!r} holds files occult_ft did not write ({_shown(foreign)}); they would be lost: "
            "pass a new or empty directory"
        )
    raise OutputPathError(
        f"{what} {out!r} is a model directory occult_ft did not write; pass a new or empty directory"
    )


def check_results_dir(out: str | os.PathLike | None, entries: str, what: str = "output_dir") -> None:
    """Refuse (`OutputPathError`, one line) the results folder of a command that writes a fixed set of
    entries into it (`occult-ft demo`, `occult-ft study`): it must be missing, empty, or hold only those
    entries (a previous run's) and the temporary siblings they are written through. A folder holding
    anything else is the user's: the command's files would be written among theirs, over theirs at a
    shared name. `entries` is a regular expression matched against each top-level name."""
    if out is None or not os.fspath(out).strip():
        raise OutputPathError(f"{what} is empty; pass the directory to write, e.g. {what}=my-results")
    out = os.fspath(out)
    _check_directory_path(out, what, replace=False)
    if not os.path.isdir(out):
        return
    ours = re.compile(rf"(?:{entries})|\.(?:{entries})\.(?:tmp-.*|new|old(?:-.*)?)")
    foreign = sorted(
        n + ("/" if os.path.isdir(os.path.join(out, n)) else "")
        for n in os.listdir(out)
        if not ours.fullmatch(n)
    )
    if foreign:
        raise OutputPathError(
            f"{what} {out!r} holds files occult_ft did not write ({_shown(foreign)}); pass a new or empty "
            "directory"
        )


# ---- reading ----------------------------------------------------------------------------------------
def _not_utf8(exc: UnicodeDecodeError) -> tuple[str, str]:
    byte = exc.object[exc.start : exc.start + 1].hex() if exc.object else "?"
    return (
        f"it is not UTF-8 text (byte 0x{byte} at offset {exc.start})",
        "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)",
    )


def _not_tensors(exc: pickle.UnpicklingError) -> tuple[str, str]:
    text = " ".join(str(exc).split())
    detail = next((part for part in text.split(". ") if "GLOBAL" in part or "global" in part), "")
    detail = detail.split("Unsupported global: ")[-1][:120] if detail else "non-tensor objects"
    return (
        f"it holds Python objects that are not tensors ({detail}), which weights_only loading refuses",
        "replace it with a file you trust; nothing in it was run",
    )


_REASONS: tuple[tuple[type[BaseException], Callable[[Any], tuple[str, str]]], ...] = (
    (UnicodeDecodeError, _not_utf8),
    (
        json.JSONDecodeError,
        lambda exc: (f"it is not valid JSON ({exc.msg} at line {exc.lineno})", "rewrite or remove it"),
    ),
    (pickle.UnpicklingError, _not_tensors),
    (FileNotFoundError, lambda exc: ("it does not exist", "check the path")),
    (IsADirectoryError, lambda exc: ("it is a directory", "pass a file")),
    (PermissionError, lambda exc: ("permission denied", "make it readable (chmod) or pass another copy")),
    (OSError, lambda exc: (exc.strerror or str(exc), "check the file")),
)
"""Exception type -> (what is wrong, how to fix it), the first match wins (subclasses before OSError)."""


def _reason(exc: BaseException) -> tuple[str, str]:
    """(what is wrong, how to fix it) of an exception raised while reading a file."""
    for kind, reason in _REASONS:
        if isinstance(exc, kind):
            return reason(exc)
    # the rest are told apart by their message: safetensors, a truncated file, a broken torch zip
    text = " ".join(str(exc).split()) or type(exc).__name__
    lowered = text.lower()
    if type(exc).__name__ == "SafetensorError" or "deserializ" in lowered or "header" in lowered:
        return (
            f"it is not a complete safetensors file ({text[:160]})",
            "it is truncated or not a safetensors file: write or download it again",
        )
    if isinstance(exc, EOFError):
        return f"it is incomplete ({text[:160]})", "it is truncated: write or download it again"
    if "zip" in lowered or "pickle" in lowered:
        return (
            f"it is not a complete torch file ({text.split('. ')[0][:160]})",
            "it is truncated: write it again",
        )
    return text[:200], "check the file"


def read_error(path: str | os.PathLike, exc: BaseException, fix: str | None = None) -> ReadError:
    """The one-line `ReadError` for `exc`, raised while reading `path` (`fix` overrides the default)."""
    reason, default_fix = _reason(exc)
    return ReadError(f"could not read {os.fspath(path)}: {reason}; {fix or default_fix}")


_READ_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    UnicodeDecodeError,
    ValueError,  # json.JSONDecodeError is one
    pickle.UnpicklingError,
    EOFError,
    RuntimeError,  # torch: "PytorchStreamReader failed reading zip archive"
)


def _read_errors() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:
        return _READ_ERRORS
    return (*_READ_ERRORS, SafetensorError)


@contextlib.contextmanager
def reading(path: str | os.PathLike, fix: str | None = None) -> Iterator[None]:
    """Within the context, an error reading `path` becomes one `ReadError` line naming it (errors that
    already name what is wrong, `ReadError` and other occult_ft errors raised inside, pass through)."""
    try:
        yield
    except ReadError:
        raise
    except _read_errors() as exc:
        if isinstance(exc, ValueError) and not isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
            if type(exc).__module__.startswith("occult_ft"):
                raise  # one of ours: it already names the value and the fix
        raise read_error(path, exc, fix) from None


def _first_unreadable(directory: str) -> tuple[str, BaseException] | None:
    """The first weights or state file in `directory` that cannot be read, with its error: safetensors
    headers are opened, torch files loaded with weights_only (nothing in them runs)."""
    import torch

    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or name == "training_args.bin":  # a pickled config, never loaded
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, framework="pt"):
                    pass
            elif name.endswith((".pt", ".pth", ".bin")):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except _read_errors() as exc:
            return path, exc
    return None


@contextlib.contextmanager
def reading_directory(directory: str | os.PathLike, fix: str | None = None) -> Iterator[None]:
    """`reading` for a library call that reads many files of a checkpoint `directory` (transformers'
    `from_pretrained`, Trainer's resume): an error reading one of them is one `ReadError` naming the
    file that cannot be read (found by opening each), or the directory when none can be singled out."""
    try:
        yield
    except ReadError:
        raise
    except _read_errors() as exc:
        is_safetensors = type(exc).__name__ == "SafetensorError"
        if not (is_safetensors or isinstance(exc, (pickle.UnpicklingError, EOFError, UnicodeDecodeError))):
            raise  # transformers' own errors (a missing file, a bad config) already say what is wrong
        directory = os.fspath(directory)
        found = _first_unreadable(directory) if os.path.isdir(directory) else None
        raise read_error(*(found or (directory, exc)), fix) from None


def read_text(path: str | os.PathLike, fix: str | None = None) -> str:
    """The UTF-8 text of `path` (`ReadError` when missing or not UTF-8)."""
    with reading(path, fix):
        with open(path, encoding="utf-8") as f:
            return f.read()


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object stored at `path`; a broken file or another JSON type is a one-line ReadError."""
    with reading(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    if not isinstance(data, dict):
        raise ReadError(
            f"could not read {os.fspath(path)}: it holds a JSON {type(data).__name__}, not an object; "
            "rewrite or remove it"
        )
    return data


def load_safetensors(path: str | os.PathLike, device: str = "cpu") -> dict:
    """All tensors of a safetensors file (`ReadError` naming it when it is truncated or not one)."""
    from safetensors.torch import load_file

    with reading(path):
        return load_file(os.fspath(path), device=device)


def torch_load(path: str | os.PathLike, **kwargs):
    """`torch.load(path, weights_only=True)`: tensors and plain containers only, never code; a file
    holding anything else is refused in one `ReadError` line naming it."""
    import torch

    kwargs["weights_only"] = True
    with reading(path):
        return torch.load(os.fspath(path), **kwargs)
