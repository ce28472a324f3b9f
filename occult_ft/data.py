"""Training data: load plain text or Alpaca-style instructions, and turn them into causal-LM examples.

Sources `load_text_dataset` accepts (rows come back as {"text"} or {"instruction", "input", "output"}):

    "embedded"              the shipped corpus (`split` = train / eval / instructions)
    path/to/file.txt        documents separated by blank lines (or fixed-size character chunks)
    path/to/file.jsonl      one JSON object per line
    path/to/file.json       a JSON list of objects (or an object holding one such list)
    path/to/saved_dir       a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
    owner/name              a Hub dataset id, through `datasets.load_dataset`

Field layouts: `text` (or `content`, or the field named by `text_field`) for plain text;
`instruction` + `output` (+ optional `input`) for Alpaca rows.

Prompt template of instruction rows (the Alpaca section headers without the preamble):

    ### Instruction:
    {instruction}

    ### Input:                      <- this section only when `input` is not empty
    {input}

    ### Response:
    {output}<eos>

`tokenize_dataset` returns `input_ids`, `attention_mask` and `labels` (lists of ints, length
`seq_len`); `labels` is -100 on padding and, with `response_only=True`, on every prompt token,
so the loss covers the response and its end-of-sequence token only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, load_from_disk

__all__ = [
    "DataError",
    "EMBEDDED",
    "IGNORE_INDEX",
    "PROMPT_TEMPLATE",
    "PROMPT_TEMPLATE_NO_INPUT",
    "format_prompt",
    "load_text_dataset",
    "tokenize_dataset",
    "make_collator",
]

EMBEDDED = "embedded"
IGNORE_INDEX = -100
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

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


def _load_hub(source: str, split: str | None) -> Dataset:
    from datasets import load_dataset

    offline = any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
    try:
        loaded = load_dataset(source, split=split or "train")
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
    if isinstance(loaded, DatasetDict):  # split=None is turned into "train" above; kept for safety
        loaded = loaded["train"]
    return loaded


def _normalise(ds: Dataset, source: str, text_field: str | None) -> Dataset:
    """Reduce `ds` to {"text"} or {"instruction", "input", "output"} string columns."""
    columns = list(ds.column_names)
    if text_field is not None:
        if text_field not in columns:
            raise DataError(
                f"text_field {text_field!r} is not a field of '{source}'; fields found: {columns}"
            )
        layout = "text"
        ds = ds.select_columns([text_field])
        if text_field != "text":
            ds = ds.rename_column(text_field, "text")
    elif "instruction" in columns and "output" in columns:
        layout = "instruction"
        ds = ds.select_columns([c for c in _INSTRUCTION_FIELDS if c in columns])
        if "input" not in columns:
            ds = ds.add_column("input", [""] * len(ds))
    elif any(name in columns for name in _TEXT_FIELDS):
        layout = "text"
        name = next(name for name in _TEXT_FIELDS if name in columns)
        ds = ds.select_columns([name])
        if name != "text":
            ds = ds.rename_column(name, "text")
    else:
        raise DataError(
            f"'{source}' has fields {columns}; expected 'text' (or 'content', or pass text_field=...) "
            "for plain text, or 'instruction' + 'output' (+ 'input') for instruction data"
        )
    if layout == "text":
        ds = ds.filter(lambda row: isinstance(row["text"], str) and row["text"].strip() != "")
    else:
        ds = ds.map(lambda row: {k: "" if row[k] is None else str(row[k]) for k in _INSTRUCTION_FIELDS})
        ds = ds.filter(lambda row: row["instruction"].strip() != "" and row["output"].strip() != "")
    if len(ds) == 0:
        raise DataError(f"dataset '{source}' is empty (no row with non-empty {layout} fields)")
    return ds


def load_text_dataset(
    source: str | os.PathLike,
    split: str | None = None,
    text_field: str | None = None,
    *,
    chunk_chars: int | None = None,
) -> Dataset:
    """Load plain text or instruction data from a local file, a saved dataset, the embedded corpus or the Hub.

    Args:
        source: `"embedded"`, a `.txt` / `.jsonl` / `.json` file, a `save_to_disk` directory, or a Hub id.
        split: the split to read: for `"embedded"` one of train / eval / instructions (default train);
            for a saved `DatasetDict` or a Hub id its split name (default train; Hub ids also accept
            slices such as `train[:1000]`). A single file is one split: only None or "train".
        text_field: the field holding plain text, when it is neither `text` nor `content`.
        chunk_chars: `.txt` only: cut the file into chunks of this many characters instead of
            splitting it into documents at blank lines.

    Returns:
        A `datasets.Dataset` with a `text` column, or `instruction`, `input` and `output` columns.

    Raises:
        DataError: for a missing file, an unsupported extension, an unknown field layout, an empty
            dataset or a Hub id that cannot be loaded (for example while offline).
    """
    source_str = os.fspath(source)
    if source_str == EMBEDDED:
        from occult_ft.embedded import EMBEDDED_SPLITS, embedded_data_path

        name = split or "train"
        if name not in EMBEDDED_SPLITS:
            raise DataError(
                f"embedded split {name!r} does not exist; use one of {', '.join(EMBEDDED_SPLITS)}"
            )
        return load_text_dataset(embedded_data_path(name), text_field=text_field, chunk_chars=chunk_chars)

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
        ds = _load_hub(source_str, split)
    return _normalise(ds, source_str, text_field)


# ---- tokenisation ------------------------------------------------------------------------------
def format_prompt(instruction: str, input: str = "") -> str:
    """The prompt of one instruction row (see the module docstring for the template)."""
    if input.strip():
        return PROMPT_TEMPLATE.format(instruction=instruction, input=input)
    return PROMPT_TEMPLATE_NO_INPUT.format(instruction=instruction)


def _special_ids(tokenizer) -> tuple[int, int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} has no eos_token; set tokenizer.eos_token first"
        )
    pad = tokenizer.pad_token_id
    return eos, eos if pad is None else pad


def _encode(tokenizer, texts: Sequence[str], eos: int, special: bool) -> list[list[int]]:
    """Token ids of each text (with the tokenizer's own special tokens if `special`), no trailing eos."""
    encoded = tokenizer(list(texts), add_special_tokens=special, verbose=False)["input_ids"]
    return [ids[:-1] if special and ids and ids[-1] == eos else ids for ids in encoded]


def _pad(ids: list[int], labels: list[int], seq_len: int, pad: int) -> dict[str, list[int]]:
    ids, labels = ids[:seq_len], labels[:seq_len]
    n = seq_len - len(ids)
    return {
        "input_ids": ids + [pad] * n,
        "attention_mask": [1] * len(ids) + [0] * n,
        "labels": labels + [IGNORE_INDEX] * n,
    }


def tokenize_dataset(
    ds: Dataset,
    tokenizer,
    seq_len: int,
    packing: bool | None = None,
    response_only: bool = True,
    *,
    num_proc: int | None = None,
) -> Dataset:
    """Turn the rows of `load_text_dataset` into fixed-length causal-LM examples.

    Args:
        ds: a dataset with a `text` column, or `instruction` / `input` / `output` columns.
        tokenizer: a transformers tokenizer with an `eos_token` (padding uses `pad_token`, else eos).
        seq_len: length of every example.
        packing: text rows only (default True): concatenate the documents, each followed by eos, and
            cut the stream into full `seq_len` blocks (the remainder of each 1000-document batch is
            dropped). False: one example per document, truncated and padded. Instruction rows are
            always one example per row; packing=True is an error for them.
        response_only: instruction rows only: labels are -100 on the prompt, so the loss covers the
            response and its eos; False trains on the prompt too.
        num_proc: processes for `Dataset.map`.

    Returns:
        A dataset with `input_ids`, `attention_mask` and `labels` (lists of `seq_len` ints; labels are
        -100 on padding). Instruction rows whose prompt fills `seq_len` (no label left) are dropped.

    Raises:
        DataError: for an unknown layout, a tokenizer without eos, seq_len < 2, packing of instruction
            rows, or no example left (text shorter than one block, every prompt too long).
    """
    if seq_len < 2:
        raise DataError(f"seq_len={seq_len} is too short; use at least 2 tokens (typically 128-4096)")
    eos, pad = _special_ids(tokenizer)
    columns = list(ds.column_names)
    if "text" in columns:
        if packing is None or packing:

            def pack(batch):
                stream = [t for ids in _encode(tokenizer, batch["text"], eos, True) for t in ids + [eos]]
                blocks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
                return {
                    "input_ids": blocks,
                    "attention_mask": [[1] * seq_len for _ in blocks],
                    "labels": [list(b) for b in blocks],
                }

            out = ds.map(pack, batched=True, batch_size=1000, remove_columns=columns, num_proc=num_proc)
            if len(out) == 0:
                raise DataError(
                    f"the text of this dataset is shorter than one block of seq_len={seq_len} tokens; "
                    "lower seq_len, add text or pass packing=False"
                )
            return out

        def one_per_doc(batch):
            rows = [
                _pad(ids + [eos], ids + [eos], seq_len, pad)
                for ids in _encode(tokenizer, batch["text"], eos, True)
            ]
            return {key: [row[key] for row in rows] for key in ("input_ids", "attention_mask", "labels")}

        return ds.map(one_per_doc, batched=True, remove_columns=columns, num_proc=num_proc)

    if not {"instruction", "output"} <= set(columns):
        raise DataError(
            f"tokenize_dataset needs a 'text' column or 'instruction'/'output' columns; found {columns}"
        )
    if packing:
        raise DataError(
            "packing=True is not supported for instruction rows (one example per row); "
            "pass packing=None or False"
        )

    def instruct(batch):
        inputs = batch["input"] if "input" in batch else [""] * len(batch["instruction"])
        prompts = [format_prompt(i, x) for i, x in zip(batch["instruction"], inputs)]
        prompt_ids = _encode(tokenizer, prompts, eos, True)
        output_ids = _encode(tokenizer, batch["output"], eos, False)
        rows = []
        for p, o in zip(prompt_ids, output_ids):
            ids = p + o + [eos]
            labels = ([IGNORE_INDEX] * len(p) if response_only else list(p)) + o + [eos]
            rows.append(_pad(ids, labels, seq_len, pad))
        return {key: [row[key] for row in rows] for key in ("input_ids", "attention_mask", "labels")}

    out = ds.map(instruct, batched=True, remove_columns=columns, num_proc=num_proc)
    out = out.filter(lambda row: any(label != IGNORE_INDEX for label in row["labels"]), num_proc=num_proc)
    if len(out) == 0:
        raise DataError(
            f"every prompt fills seq_len={seq_len} tokens, leaving no response to train on; raise seq_len"
        )
    return out


def make_collator(
    tokenizer, pad_to_multiple_of: int | None = None
) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """A collate function: pads `input_ids` (pad token, else eos), `attention_mask` (0) and `labels` (-100)
    to the longest example of the batch (rounded up to `pad_to_multiple_of`) and stacks them as tensors.
    """
    _, pad = _special_ids(tokenizer)

    def collate(features: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        if pad_to_multiple_of:
            longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        batch = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in features:
            ids = list(f["input_ids"])
            n = longest - len(ids)
            mask = list(f.get("attention_mask", [1] * len(ids)))
            labels = list(f.get("labels", ids))
            batch["input_ids"].append(ids + [pad] * n)
            batch["attention_mask"].append(mask + [0] * n)
            batch["labels"].append(labels + [IGNORE_INDEX] * n)
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}

    return collate
