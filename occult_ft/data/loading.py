"""Loading training data: files, saved datasets, Hub ids and the embedded corpus, as rows of one layout.

Sources `load_text_dataset` accepts:

    "embedded"              the shipped corpus (`split` = train / eval / instructions)
    path/to/file.txt        documents separated by blank lines (or fixed-size character chunks)
    path/to/file.jsonl      one JSON object per line
    path/to/file.json       a JSON list of objects (or an object holding one such list)
    path/to/saved_dir       a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
    owner/name              a Hub dataset id, through `datasets.load_dataset`

With `streaming=True` the result is a `datasets.IterableDataset` read lazily (Hub ids and .jsonl files
stream from their source; other files are read, then iterated).

Layouts (the columns of the returned rows; `dataset_layout` names them), the shapes TRL users have:

    text                    `text` (or `content`, or the field named by `text_field`): plain text
    instruction             `instruction` + `output` (+ optional `input`): Alpaca rows
    prompt                  `prompt` + `completion`: strings, or lists of chat messages
    messages                `messages`: a list of {"role", "content"} (rendered by the chat template)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from datasets import Dataset, DatasetDict, IterableDataset, load_from_disk

from ..embedded import EMBEDDED_SPLITS, embedded_data_path

__all__ = [
    "DataError",
    "EMBEDDED",
    "IGNORE_INDEX",
    "LAYOUTS",
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
_INSTRUCTION_FIELDS = ("instruction", "input", "output")
_TEXT_FIELDS = ("text", "content")
_SOURCE_HELP = "pass a .txt/.jsonl/.json file, a saved dataset directory or a Hub dataset id"


class DataError(ValueError):
    """A data source or layout occult_ft cannot use; the message names the value and the fix."""


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


def _read_json_rows(path: Path) -> list[dict]:
    if path.suffix.lower() == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"line {number} of '{path}' is not valid JSON ({err.msg}); "
                        "a .jsonl file holds one JSON object per line"
                    ) from None
    else:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
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
        rows = data
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise DataError(
            f"row {bad} of '{path}' is a {type(rows[bad]).__name__}, not a JSON object with fields"
        )
    return rows


def _load_saved(path: Path, split: str | None) -> Dataset:
    if not any(
        (path / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")
    ):
        raise DataError(f"directory '{path}' is not a dataset saved with save_to_disk; {_SOURCE_HELP}")
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


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _normalise(ds, source: str, text_field: str | None):
    """Reduce `ds` to the columns of its layout (see the module docstring), dropping empty rows."""
    columns = dataset_columns(ds)
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
    streamed = isinstance(ds, IterableDataset)
    if layout == "text":
        name = text_field or next(name for name in _TEXT_FIELDS if name in columns)
        ds = ds.select_columns([name])
        if name != "text":
            ds = ds.rename_column(name, "text")
        ds = ds.filter(lambda row: isinstance(row["text"], str) and row["text"].strip() != "")
    elif layout == "instruction":
        ds = ds.select_columns([c for c in _INSTRUCTION_FIELDS if c in columns])
        ds = ds.map(lambda row: {k: "" if row.get(k) is None else str(row[k]) for k in _INSTRUCTION_FIELDS})
        ds = ds.filter(lambda row: row["instruction"].strip() != "" and row["output"].strip() != "")
    elif layout == "prompt":
        ds = ds.select_columns(["prompt", "completion"])
        ds = ds.filter(
            lambda row: all(
                (isinstance(row[k], str) and row[k].strip() != "") or (_is_messages(row[k]) and row[k])
                for k in ("prompt", "completion")
            )
        )
    else:
        ds = ds.select_columns(["messages"])
        ds = ds.filter(lambda row: _is_messages(row["messages"]) and len(row["messages"]) > 0)
    if not streamed and len(ds) == 0:
        raise DataError(f"dataset '{source}' is empty (no row with non-empty {layout} fields)")
    return ds


def load_text_dataset(
    source: str | os.PathLike,
    split: str | None = None,
    text_field: str | None = None,
    *,
    chunk_chars: int | None = None,
    streaming: bool = False,
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

    Returns:
        A `datasets.Dataset` (or `IterableDataset`) with the columns of one layout: `text`;
        `instruction`, `input`, `output`; `prompt`, `completion`; or `messages`.

    Raises:
        DataError: for a missing file, an unsupported extension, an unknown field layout, an empty
            dataset or a Hub id that cannot be loaded (for example while offline).
    """
    source_str = os.fspath(source)
    if source_str == EMBEDDED:
        name = split or "train"
        if name not in EMBEDDED_SPLITS:
            raise DataError(
                f"embedded split {name!r} does not exist; use one of {', '.join(EMBEDDED_SPLITS)}"
            )
        return load_text_dataset(
            embedded_data_path(name), text_field=text_field, chunk_chars=chunk_chars, streaming=streaming
        )

    path = Path(source_str).expanduser()
    if path.is_dir():
        ds = _load_saved(path, split)
    elif path.is_file():
        suffix = path.suffix.lower()
        if suffix not in _FILE_SUFFIXES:
            raise DataError(
                f"data file '{source_str}' has unsupported extension {suffix or '(none)'!r}; "
                f"use .txt, .jsonl or .json, or convert it with datasets and save_to_disk"
            )
        if split not in (None, "train"):
            raise DataError(
                f"split={split!r} does not apply to the single file '{source_str}'; pass split=None"
            )
        if suffix == ".txt":
            if text_field not in (None, "text"):
                raise DataError(
                    f"text_field={text_field!r} does not apply to the plain-text file '{source_str}'"
                )
            docs = _split_documents(path.read_text(encoding="utf-8"), chunk_chars)
            ds = Dataset.from_dict({"text": docs})
        elif suffix == ".jsonl" and streaming:
            from datasets import load_dataset

            ds = load_dataset("json", data_files=str(path), split="train", streaming=True)
            return _normalise(ds, source_str, text_field)
        else:
            rows = _read_json_rows(path)
            if not rows:
                raise DataError(f"dataset '{source_str}' is empty (the file holds no rows)")
            # columns from the union of all rows' keys (Dataset.from_list would take the first row's only)
            keys = list(dict.fromkeys(key for row in rows for key in row))
            ds = Dataset.from_dict({key: [row.get(key) for row in rows] for key in keys})
    elif (
        path.suffix.lower() in _PATH_LIKE_SUFFIXES
        or source_str.startswith((".", "/", "~", "\\"))
        or source_str.count("/") > 1
    ):  # a Hub id is "name" or "owner/name"
        raise DataError(f"data file '{source_str}' does not exist; {_SOURCE_HELP}")
    else:
        return _normalise(_load_hub(source_str, split, streaming), source_str, text_field)
    ds = _normalise(ds, source_str, text_field)
    return ds.to_iterable_dataset() if streaming else ds
