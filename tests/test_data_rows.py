"""The one row validator (`occult_ft.data.rows`) behind every loader: no row vanishes without a word.

Each source is read in one layout; a row that does not fit it is an error naming the file, the row and
the field, or, with `skip_invalid_rows`, skipped with a printed count; blank rows are dropped with a
printed count. The same holds streamed or not, for files, saved datasets and rows given to the trainer."""

from __future__ import annotations

import json
import logging

import pytest
from datasets import Dataset

from occult_ft.data import DataError, load_text_dataset, tokenize_for_training
from occult_ft.fileio import ReadError

ALPACA = {"instruction": "Say hi", "input": "", "output": "hi"}


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _rows(ds) -> list[dict]:
    return list(ds)


@pytest.mark.parametrize("streaming", [False, True])
def test_text_rows_in_an_alpaca_file_are_an_error_naming_the_line(tmp_path, streaming):
    path = _jsonl(tmp_path / "mixed.jsonl", [ALPACA, {"text": "plain"}, ALPACA, {"text": "more"}])
    with pytest.raises(DataError) as err:
        _rows(load_text_dataset(path, streaming=streaming))
    message = str(err.value)
    assert message.startswith(f"line 2 of '{path}' has no 'instruction' field")
    assert "read as instruction rows" in message and "skip_invalid_rows" in message


@pytest.mark.parametrize("streaming", [False, True])
def test_alpaca_rows_without_output_are_an_error_or_skipped_with_a_count(tmp_path, streaming, caplog):
    rows = [dict(ALPACA, output=f"hi {i}") for i in range(5)] + [{"instruction": f"q{i}"} for i in range(5)]
    path = _jsonl(tmp_path / "alpaca.jsonl", rows)
    with pytest.raises(DataError, match=rf"line 6 of '{path}' has no 'output' field"):
        _rows(load_text_dataset(path, streaming=streaming))
    with caplog.at_level(logging.WARNING, logger="occult_ft.data"):
        kept = _rows(load_text_dataset(path, streaming=streaming, skip_invalid_rows=True))
    assert [r["output"] for r in kept] == [f"hi {i}" for i in range(5)]
    assert "skipped 5 rows that do not fit its instruction layout" in caplog.text
    assert "first: line 6: has no 'output' field" in caplog.text


@pytest.mark.parametrize("streaming", [False, True])
def test_a_number_in_the_text_field_names_the_row_and_the_field(tmp_path, streaming):
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "a string"}, {"text": 5}])
    with pytest.raises(DataError, match=r"line 2 of .* holds an int \(5\) in 'text', not a string"):
        _rows(load_text_dataset(path, streaming=streaming))
    listed = tmp_path / "t.json"
    listed.write_text(json.dumps([{"text": "a"}, {"text": "b"}, {"text": [1]}]), encoding="utf-8")
    with pytest.raises(DataError, match=r"row 2 of .* holds a list \(\[1\]\) in 'text'"):
        load_text_dataset(listed)


@pytest.mark.parametrize("streaming", [False, True])
def test_blank_rows_are_dropped_with_a_count_and_all_blank_is_empty(tmp_path, streaming, caplog):
    path = _jsonl(tmp_path / "b.jsonl", [{"text": "a"}, {"text": "  "}, {"text": "b"}])
    with caplog.at_level(logging.WARNING, logger="occult_ft.data"):
        assert [r["text"] for r in _rows(load_text_dataset(path, streaming=streaming))] == ["a", "b"]
    assert f"'{path}': dropped 1 blank rows" in caplog.text
    blank = _jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": "   "}])
    with pytest.raises(DataError, match=rf"dataset '{blank}' is empty \(no row with non-empty text fields"):
        load_text_dataset(blank, streaming=streaming)


@pytest.mark.parametrize("streaming", [False, True])
def test_an_empty_jsonl_is_one_line_naming_it(tmp_path, streaming):
    path = tmp_path / "empty.jsonl"
    path.write_text("", encoding="utf-8")
    with pytest.raises(DataError, match=rf"dataset '{path}' is empty \(the file holds no rows\)"):
        load_text_dataset(str(path), streaming=streaming)


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.txt"])
@pytest.mark.parametrize("streaming", [False, True])
def test_latin1_and_binary_files_name_the_file(tmp_path, name, streaming):
    for content in ('{"text": "caf\xe9"}\n'.encode("latin-1"), bytes(range(256))):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ReadError, match=rf"could not read {path}: it is not UTF-8 text \(byte 0x"):
            _rows(load_text_dataset(str(path), streaming=streaming))


def test_a_saved_dataset_with_a_missing_value_is_checked_row_by_row(tmp_path, caplog):
    Dataset.from_list([ALPACA, {"instruction": "q", "input": "", "output": None}, ALPACA]).save_to_disk(
        str(tmp_path / "saved")
    )
    with pytest.raises(DataError, match=r"row 1 of .*saved' has no 'output' field"):
        load_text_dataset(tmp_path / "saved")
    with caplog.at_level(logging.WARNING, logger="occult_ft.data"):
        assert len(load_text_dataset(tmp_path / "saved", skip_invalid_rows=True)) == 2
    assert "skipped 1 rows" in caplog.text
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == sorted(
        ["data-00000-of-00001.arrow", "dataset_info.json", "state.json"]
    )  # the check writes no cache file into the user's dataset


def test_instruction_rows_without_input_get_it_in_the_canonical_column_order(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"instruction": "q", "output": "a"}])
    ds = load_text_dataset(path)
    assert ds.column_names == ["instruction", "input", "output"] and ds[0]["input"] == ""


def test_rows_given_to_the_trainer_go_through_the_same_check(tiny_tokenizer):
    from occult_ft.trainer import OccultConfig

    args = OccultConfig(output_dir="unused", use_cpu=True, report_to="none", seq_len=8)
    rows = Dataset.from_list([{"text": "hello there"}, {"text": None}])
    with pytest.raises(DataError, match=r"row 1 of 'the dataset given to OccultTrainer' has no 'text' field"):
        tokenize_for_training(rows, tiny_tokenizer, args)
    args.skip_invalid_rows = True
    assert len(tokenize_for_training(rows, tiny_tokenizer, args)) >= 1


def test_rows_given_to_make_batches_are_checked_too(tiny_tokenizer):
    from occult_ft.data import make_batches

    rows = Dataset.from_list([ALPACA, {"instruction": "q", "input": "", "output": None}])
    with pytest.raises(DataError, match=r"row 1 of 'the dataset' has no 'output' field"):
        make_batches(tiny_tokenizer, rows, seq_len=32, batch_size=2)
