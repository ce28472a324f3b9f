"""The one row validator: every loader checks each row against the layout its source is read with.

A source is read in one layout (`text`, `instruction`, `prompt`, `messages`; see
`occult_ft.data.loading`): a file in the layout of its first row, a dataset in that of its columns.
Each row then either fits it, is blank (nothing to learn: empty text, an empty instruction or
output), or does not fit it (a field missing, or of the wrong type):

    fits          kept, reduced to the layout's columns (`normalise_row`)
    blank         dropped; the count is printed once the source has been read
    does not fit  a `DataError` naming the source, the row (`line N` of a .jsonl file, `row N` = the
                  index in a .json list or a dataset) and the field; with `skip_invalid_rows` the row
                  is skipped instead and the count printed, with the first such row

so no row vanishes without a word. `RowCheck` does this for one source; `RowCheck.keep` is the
predicate every loader calls (directly on Python rows, through `Dataset.filter` on datasets).
"""

from __future__ import annotations

import logging

__all__ = ["LAYOUT_FIELDS", "DataError", "RowCheck", "row_problem", "normalise_row"]

logger = logging.getLogger("occult_ft.data")

#: layout -> (required fields, optional fields), as `normalise_row` returns them
LAYOUT_FIELDS = {
    "text": (("text",), ()),
    "instruction": (("instruction", "output"), ("input",)),
    "prompt": (("prompt", "completion"), ()),
    "messages": (("messages",), ()),
}
_DESCRIBED = {
    "text": "plain text rows (a 'text' field)",
    "instruction": "instruction rows ('instruction', 'output', optional 'input')",
    "prompt": "prompt/completion rows ('prompt', 'completion')",
    "messages": "conversation rows ('messages': a list of {'role', 'content'})",
}


class DataError(ValueError):
    """A data source or layout occult_ft cannot use; the message names the value and the fix."""


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _kind(value) -> str:
    """`an int (5)`: the type of a value, with the value."""
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({shown})"


_Problem = tuple[str, str] | None
"""None (the row fits), ("blank", why) or ("invalid", why)."""


def _text_problem(row: dict, field: str) -> _Problem:
    value = row.get(field)
    if field not in row or value is None:
        return "invalid", f"has no {field!r} field"
    if not isinstance(value, str):
        return "invalid", f"holds {_kind(value)} in {field!r}, not a string"
    return ("blank", f"{field!r} is blank") if not value.strip() else None


def _instruction_problem(row: dict, field: str) -> _Problem:
    for name in ("instruction", "output"):
        if row.get(name) is None:
            return "invalid", f"has no {name!r} field"
    for name in ("instruction", "output", "input"):
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            return "invalid", f"holds {_kind(value)} in {name!r}, not a string"
    if not row["instruction"].strip() or not row["output"].strip():
        return "blank", "its 'instruction' or 'output' is blank"
    return None


def _prompt_problem(row: dict, field: str) -> _Problem:
    values = [row.get("prompt"), row.get("completion")]
    for name, value in zip(("prompt", "completion"), values):
        if value is None:
            return "invalid", f"has no {name!r} field"
        if not isinstance(value, str) and not _is_messages(value):
            return "invalid", f"holds {_kind(value)} in {name!r}, not a string or a list of chat messages"
    # both strings or both conversations: a prompt of text and a completion of messages has no template
    if isinstance(values[0], str) != isinstance(values[1], str):
        return "invalid", "mixes a string and chat messages in 'prompt' and 'completion'"
    if any((v.strip() == "") if isinstance(v, str) else not v for v in values):
        return "blank", "its 'prompt' or 'completion' is blank"
    return None


def _messages_problem(row: dict, field: str) -> _Problem:
    value = row.get("messages")
    if value is None:
        return "invalid", "has no 'messages' field"
    if not _is_messages(value):
        return "invalid", f"holds {_kind(value)} in 'messages', not a list of {{'role', 'content'}} objects"
    return ("blank", "'messages' is empty") if not value else None


_PROBLEMS = {
    "text": _text_problem,
    "instruction": _instruction_problem,
    "prompt": _prompt_problem,
    "messages": _messages_problem,
}
"""layout -> its row check (`row_problem`)."""


def row_problem(row: dict, layout: str, field: str = "text") -> _Problem:
    """What is wrong with `row` read in `layout`: None when it fits, ("blank", why) when it holds
    nothing to learn, ("invalid", why) when it does not fit (`why` names the field).

    Args:
        row: one row (a dict of fields).
        layout: one of `LAYOUT_FIELDS`.
        field: the text layout's field (`text`, `content` or the `text_field` a user named).
    """
    return _PROBLEMS.get(layout, _messages_problem)(row, field)


def normalise_row(row: dict, layout: str, field: str = "text") -> dict:
    """The columns of `layout` of a row that fits it (`text` renamed from `field`; `input` "" when absent)."""
    if layout == "text":
        return {"text": row[field]}
    if layout == "instruction":
        return {"instruction": row["instruction"], "input": row.get("input") or "", "output": row["output"]}
    if layout == "prompt":
        return {"prompt": row["prompt"], "completion": row["completion"]}
    return {"messages": row["messages"]}


class RowCheck:
    """Checks the rows of one source read in one layout; counts what it drops.

    Args:
        source: the file or dataset name, for messages.
        layout / field: as in `row_problem`.
        skip_invalid_rows: skip rows that do not fit (counted) instead of raising.
        unit: "line" (a .jsonl file, 1-based line numbers) or "row" (the index in a list or dataset).
        why: how the layout was chosen, for messages (e.g. "as its first row").
    """

    def __init__(
        self,
        source: str,
        layout: str,
        field: str = "text",
        skip_invalid_rows: bool = False,
        unit: str = "row",
        why: str = "",
    ):
        self.source, self.layout, self.field = source, layout, field
        self.skip_invalid_rows, self.unit, self.why = skip_invalid_rows, unit, why
        self.blank = self.skipped = 0
        self.first_skipped: str | None = None

    def _where(self, number: int) -> str:
        return f"{self.unit} {number} of '{self.source}'"

    def keep(self, row: dict, number: int) -> bool:
        """True for a row that fits; False for a blank or (with `skip_invalid_rows`) an invalid one;
        a `DataError` for an invalid one otherwise."""
        problem = row_problem(row, self.layout, self.field)
        if problem is None:
            return True
        kind, why = problem
        if kind == "blank":
            self.blank += 1
            return False
        if not self.skip_invalid_rows:
            raise DataError(
                f"{self._where(number)} {why}, but the source is read as {_DESCRIBED[self.layout]}"
                f"{' ' + self.why if self.why else ''}; fix the row (every row one layout), or set "
                "skip_invalid_rows (--skip-invalid-rows) to skip such rows"
            )
        self.skipped += 1
        if self.first_skipped is None:
            self.first_skipped = f"{self.unit} {number}: {why}"
        return False

    def report(self) -> None:
        """Print (log at WARNING) how many rows were dropped, once the source has been read."""
        if self.blank:
            logger.warning(f"'{self.source}': dropped {self.blank} blank rows (nothing to learn in them)")
        if self.skipped:
            logger.warning(
                f"'{self.source}': skipped {self.skipped} rows that do not fit its {self.layout} layout, as "
                f"skip_invalid_rows asks (first: {self.first_skipped})"
            )
