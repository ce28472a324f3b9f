"""Loading training data: files, saved datasets, Hub ids and the embedded corpus, as rows of one layout.

Sources `load_text_dataset` accepts (`streaming=True`: a `datasets.IterableDataset`; Hub ids and .jsonl
files stream from their source, other files are read, then iterated):

    "embedded"              the shipped corpus (`split` = train / eval / instructions)
    path/to/file.txt        documents separated by blank lines (or fixed-size character chunks)
    path/to/file.jsonl      one JSON object per line
    path/to/file.json       a JSON list of objects (or an object holding one such list)
    path/to/saved_dir       a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
    owner/name              a Hub dataset id, through `datasets.load_dataset`

Layouts (the columns of the returned rows; `dataset_layout` names them), the shapes TRL users have:

    text                    `text` (or `content`, or the field named by `text_field`): plain text
    instruction             `instruction` + `output` (+ optional `input`): Alpaca rows
    prompt                  `prompt` + `completion`: strings, or lists of chat messages
    messages                `messages`: a list of {"role", "content"} (rendered by the chat template)

Every row is checked against the layout its source is read with (a file: that of its first row; a
dataset: that of its columns) by the one row validator of `occult_ft.data.rows`: blank rows are dropped
with a printed count; a row that does not fit (a text row in an Alpaca file, a missing `output`, a
number where text belongs) is a `DataError` naming the file, the row and the field, or, with
`skip_invalid_rows=True`, skipped with a printed count. Files that are not UTF-8 are one `ReadError`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

from datasets import Dataset, DatasetDict, IterableDataset, load_from_disk

from ..embedded import EMBEDDED_SPLITS, embedded_data_path
from ..fileio import read_text, reading
from .rows import LAYOUT_FIELDS, DataError, RowCheck, normalise_row

__all__ = [
    "DataError",
    "EMBEDDED",
    "IGNORE_INDEX",
    "LAYOUTS",
    "check_rows",
    "dataset_columns",
    "dataset_layout",
    "load_text_dataset",
]

EMBEDDED = "embedded"
IGNORE_INDEX = -100
LAYOUTS = ("text", "instruction", "prompt", "messages")

_FILE_SUFFIXES = (".txt", ".jsonl", ".json")
# suffixes that mark a source as a file path even when it does not exist (never a Hub id)
_PATH_LIKE_SUFFIXES = _FILE_SUFFIXES + (".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zip", ".md")
_TEXT_FIELDS = ("text", "content")
_SOURCE_HELP = "pass a .txt/.jsonl/.json file, a saved dataset directory or a Hub dataset id"


# ---- loading -----------------------------------------------------------------------------------
def _split_documents(text: str, chunk_chars: int | None) -> list[str]:
    if chunk_chars is not None:
        if chunk_chars < 1:
            raise DataError(f"chunk_chars={chunk_chars} must be a positive number of characters")
        return [
            text[i : i + chunk_chars]
            for i in range(0, len(text), chunk_chars)
            if text[i : i + chunk_chars].strip()
        ]
    # a document is a run of non-blank lines; keep its leading indentation (code), drop trailing spaces
    return [doc.strip("\n").rstrip() for doc in re.split(r"\n[ \t]*\n", text) if doc.strip()]


def _parse_jsonl_line(path: Path, number: int, line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            f"line {number} of '{path}' is not valid JSON ({err.msg}); a .jsonl file holds one JSON object per line"
        ) from None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row) of each non-blank line, read lazily (errors name the file)."""
    with reading(path), path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, _parse_jsonl_line(path, number, line)


def _json_rows(path: Path) -> list[tuple[int, object]]:
    """(index, row) of a .json file holding a list of rows (or an object holding exactly one list)."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"'{path}' is not valid JSON ({err.msg} at line {err.lineno})") from None
    if isinstance(data, dict):
        lists = [value for value in data.values() if isinstance(value, list)]
        if len(lists) != 1:
            raise DataError(
                f"'{path}' holds a JSON object with {len(lists)} lists; "
                "expected a list of rows or an object with exactly one list of rows"
            )
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"'{path}' holds a JSON {type(data).__name__}; expected a list of rows")
    return list(enumerate(data))


def _check_object(path: Path, unit: str, number: int, row) -> dict:
    if not isinstance(row, dict):
        raise DataError(
            f"{unit} {number} of '{path}' is a {type(row).__name__}, not a JSON object with fields"
        )
    return row


def _layout_of(columns, source: str, text_field: str | None) -> tuple[str, str]:
    """(layout, text field) of a source with these columns; DataError naming the source otherwise."""
    columns = list(columns)
    if text_field is not None and text_field not in columns:
        raise DataError(f"text_field {text_field!r} is not a field of '{source}'; fields found: {columns}")
    try:
        layout = dataset_layout(columns, text_field)
    except DataError:
        raise DataError(
            f"'{source}' has fields {columns}; expected 'text' (or 'content', or pass text_field=...) "
            "for plain text, 'instruction' + 'output' (+ 'input') or 'prompt' + 'completion' for "
            "instruction data, or 'messages' for conversations"
        ) from None
    if layout == "tokenized":
        raise DataError(
            f"'{source}' is already tokenized (it has input_ids); pass it to OccultTrainer directly"
        )
    field = text_field or next((name for name in _TEXT_FIELDS if name in columns), "text")
    return layout, field


def _empty_dataset(source, why: str) -> DataError:
    """The one 'dataset ... is empty' error: what was found (`why`) and what data to give instead."""
    return DataError(
        f"dataset '{source}' is empty ({why}); point it at data with text: a .txt of paragraphs, or .jsonl / "
        ".json rows (or a Hub dataset) with a text, prompt + completion or messages field"
    )


def _empty(source: str, check: RowCheck | None = None) -> DataError:
    detail = ""
    if check is not None and (check.blank or check.skipped):
        detail = f": {check.blank} blank rows, {check.skipped} skipped"
    layout = check.layout if check is not None else "usable"
    return _empty_dataset(source, f"no row with non-empty {layout} fields{detail}")


def _rows_dataset(
    path: Path, rows: Iterable[tuple[int, object]], unit: str, text_field, skip_invalid_rows: bool
) -> Dataset:
    """A `Dataset` of the rows that fit the layout of the first row (the others: `RowCheck`)."""
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        raise _empty_dataset(path, "the file holds no rows")
    first_row = _check_object(path, unit, *first)
    layout, field = _layout_of(list(first_row), str(path), text_field)
    check = RowCheck(str(path), layout, field, skip_invalid_rows, unit, why=f"as its first {unit} is")
    kept = []
    for number, row in itertools.chain([first], rows):
        row = _check_object(path, unit, number, row)
        if check.keep(row, number):
            kept.append(normalise_row(row, layout, field))
    check.report()
    if not kept:
        raise _empty(str(path), check)
    return Dataset.from_list(kept)


def _streamed_jsonl(path: Path, text_field, skip_invalid_rows: bool) -> IterableDataset:
    """A .jsonl file as a stream: its first row fixes the layout, every row is checked as it is read."""
    first = next(_jsonl_rows(path), None)
    if first is None:
        raise _empty_dataset(path, "the file holds no rows")
    layout, field = _layout_of(list(_check_object(path, "line", *first)), str(path), text_field)
    stream = IterableDataset.from_generator(
        _checked_stream,
        gen_kwargs={"path": str(path), "layout": layout, "field": field, "skip": skip_invalid_rows},
    )
    if next(iter(stream), None) is None:  # reads up to the first usable row (all of it when none)
        raise _empty_dataset(path, f"no row with non-empty {layout} fields")
    return stream


def _checked_stream(path: str, layout: str, field: str, skip: bool) -> Iterator[dict]:
    check = RowCheck(path, layout, field, skip, "line", why="as its first line is")
    for number, row in _jsonl_rows(Path(path)):
        if check.keep(_check_object(Path(path), "line", number, row), number):
            yield normalise_row(cast(dict, row), layout, field)  # _check_object checked it
    check.report()


def _load_saved(path: Path, split: str | None) -> Dataset:
    if not any(
        (path / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")
    ):
        raise DataError(f"directory '{path}' is not a dataset saved with save_to_disk; {_SOURCE_HELP}")
    with reading(path, fix="save it again with save_to_disk"):
        loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        name = split or "train"
        if name not in loaded:
            raise DataError(f"saved dataset '{path}' has no split {name!r}; splits: {', '.join(loaded)}")
        return loaded[name]
    return loaded


def _load_hub(source: str, split: str | None, streaming: bool = False) -> Dataset | IterableDataset:
    from datasets import IterableDatasetDict, load_dataset

    offline = any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
    try:
        loaded = load_dataset(source, split=split or "train", streaming=streaming)
    except Exception as err:  # the datasets/hub error types vary across versions; keep the cause chained
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if offline:
            raise DataError(
                f"cannot load Hub dataset '{source}' while offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE "
                f"is set): {reason}; {_SOURCE_HELP} available locally"
            ) from err
        raise DataError(
            f"could not load Hub dataset '{source}': {reason}; check the id, or {_SOURCE_HELP}"
        ) from err
    if isinstance(loaded, (DatasetDict, IterableDatasetDict)):  # split=None becomes "train" above
        loaded = loaded["train"]
    return loaded


def dataset_columns(ds) -> list[str]:
    """Column names of a `Dataset` or `IterableDataset` (a streamed one without known features is peeked)."""
    columns = getattr(ds, "column_names", None)
    if columns is None and isinstance(ds, IterableDataset):
        first = next(iter(ds), None)
        columns = list(first) if first is not None else []
    return list(columns or [])


def dataset_layout(columns, text_field: str | None = None) -> str:
    """The layout (one of `LAYOUTS`) that `columns` hold, or "tokenized" for rows with `input_ids`.

    Raises:
        DataError: naming the columns and the layouts occult_ft reads.
    """
    columns = list(columns)
    if "input_ids" in columns:
        return "tokenized"
    if text_field is not None:
        return "text"
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt"
    if "instruction" in columns and "output" in columns:
        return "instruction"
    if any(name in columns for name in _TEXT_FIELDS):
        return "text"
    raise DataError(
        f"rows have fields {columns}; expected 'text' (or 'content', or pass text_field=...) for plain text, "
        "'instruction' + 'output' (+ 'input') or 'prompt' + 'completion' for instruction data, or 'messages' "
        "for conversations"
    )


def check_rows(ds, source: str, text_field: str | None = None, skip_invalid_rows: bool = False):
    """A dataset (saved, Hub, streamed or not, or rows a user built) reduced to the columns of its
    layout, every row checked by `occult_ft.data.rows.RowCheck` (blank rows dropped and counted, rows
    that do not fit an error naming `source`, the row and the field, or skipped and counted).

    Raises:
        DataError: no known layout, a row that does not fit it, or no row left.
    """
    streamed = isinstance(ds, IterableDataset)
    columns = dataset_columns(ds)
    if streamed and not columns:
        raise _empty_dataset(source, "the stream holds no rows")
    layout, field = _layout_of(columns, source, text_field)
    check = RowCheck(source, layout, field, skip_invalid_rows, "row", why="as its columns are")
    order = ("instruction", "input", "output") if layout == "instruction" else LAYOUT_FIELDS[layout][0]
    wanted = [field] if layout == "text" else [c for c in order if c in columns]
    ds = ds.select_columns(wanted)
    if streamed:
        ds = ds.filter(check.keep, with_indices=True)
        ds = ds.map(lambda row: normalise_row(row, layout, field), remove_columns=wanted)
        if next(iter(ds), None) is None:
            raise _empty(source, check)
        return ds
    # in memory and never from a cache: the check must see every row (and write nothing beside the data)
    ds = ds.filter(check.keep, with_indices=True, keep_in_memory=True, load_from_cache_file=False)
    check.report()
    if len(ds) == 0:
        raise _empty(source, check)
    return ds.map(
        lambda row: normalise_row(row, layout, field),
        remove_columns=wanted,
        keep_in_memory=True,
        load_from_cache_file=False,
    )


def load_text_dataset(
    source: str | os.PathLike,
    split: str | None = None,
    text_field: str | None = None,
    *,
    chunk_chars: int | None = None,
    streaming: bool = False,
    skip_invalid_rows: bool = False,
) -> Dataset | IterableDataset:
    """Load text, instruction or conversation data from a file, a saved dataset, the embedded corpus or the Hub.

    Args:
        source: `"embedded"`, a `.txt` / `.jsonl` / `.json` file, a `save_to_disk` directory, or a Hub id.
        split: the split to read: for `"embedded"` one of train / eval / instructions (default train);
            for a saved `DatasetDict` or a Hub id its split name (default train; Hub ids also accept
            slices such as `train[:1000]`). A single file is one split: only None or "train".
        text_field: the field holding plain text, when it is neither `text` nor `content`.
        chunk_chars: `.txt` only: cut the file into chunks of this many characters instead of
            splitting it into documents at blank lines.
        streaming: return a `datasets.IterableDataset` (rows are read as they are used).
        skip_invalid_rows: skip rows that do not fit the source's layout (a missing field, a number
            where text belongs), printing how many, instead of raising (`occult_ft.data.rows`).

    Returns:
        A `datasets.Dataset` (or `IterableDataset`) with the columns of one layout: `text`;
        `instruction`, `input`, `output`; `prompt`, `completion`; or `messages`.

    Raises:
        DataError: for a missing file, an unsupported extension, an unknown field layout, a row that
            does not fit the layout (naming the file, the row and the field), an empty dataset or a Hub
            id that cannot be loaded (for example while offline).
        ReadError: a file that is not UTF-8 text (`occult_ft.fileio`).
    """
    source_str = os.fspath(source)
    if source_str == EMBEDDED:
        name = split or "train"
        if name not in EMBEDDED_SPLITS:
            raise DataError(
                f"embedded split {name!r} does not exist; use one of {', '.join(EMBEDDED_SPLITS)}"
            )
        return load_text_dataset(
            embedded_data_path(name),
            text_field=text_field,
            chunk_chars=chunk_chars,
            streaming=streaming,
            skip_invalid_rows=skip_invalid_rows,
        )

    path = Path(source_str).expanduser()
    if path.is_dir():
        ds = check_rows(_load_saved(path, split), source_str, text_field, skip_invalid_rows)
        return ds.to_iterable_dataset() if streaming else ds
    if path.is_file():
        return _load_file(path, source_str, split, text_field, chunk_chars, streaming, skip_invalid_rows)
    if (
        path.suffix.lower() in _PATH_LIKE_SUFFIXES
        or source_str.startswith((".", "/", "~", "\\"))
        or source_str.count("/") > 1
    ):  # a Hub id is "name" or "owner/name"
        raise DataError(f"data file '{source_str}' does not exist; {_SOURCE_HELP}")
    return check_rows(_load_hub(source_str, split, streaming), source_str, text_field, skip_invalid_rows)


def _load_file(
    path: Path,
    source_str: str,
    split: str | None,
    text_field: str | None,
    chunk_chars: int | None,
    streaming: bool,
    skip_invalid_rows: bool,
) -> Dataset | IterableDataset:
    """One .txt / .jsonl / .json file as a dataset (`load_text_dataset`)."""
    suffix = path.suffix.lower()
    if suffix not in _FILE_SUFFIXES:
        raise DataError(
            f"data file '{source_str}' has unsupported extension {suffix or '(none)'!r}; "
            f"use .txt, .jsonl or .json, or convert it with datasets and save_to_disk"
        )
    if split not in (None, "train"):
        raise DataError(f"split={split!r} does not apply to the single file '{source_str}'; pass split=None")
    if suffix == ".txt":
        if text_field not in (None, "text"):
            raise DataError(f"text_field={text_field!r} does not apply to the plain-text file '{source_str}'")
        docs = _split_documents(read_text(path), chunk_chars)
        if not docs:
            raise _empty_dataset(source_str, "the file holds no text")
        ds = Dataset.from_dict({"text": docs})
        return ds.to_iterable_dataset() if streaming else ds
    if suffix == ".jsonl" and streaming:
        return _streamed_jsonl(path, text_field, skip_invalid_rows)
    rows, unit = (_jsonl_rows(path), "line") if suffix == ".jsonl" else (_json_rows(path), "row")
    ds = _rows_dataset(path, rows, unit, text_field, skip_invalid_rows)
    return ds.to_iterable_dataset() if streaming else ds
