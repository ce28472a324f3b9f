"""occult_ft.data: every source format, the tokenised layouts, and each DataError, on tiny files.

The tokenizer is the embedded one (byte-level BPE, eos `<|endoftext|>`, pad `<|pad|>`).
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, DatasetDict

from occult_ft.data import (
    IGNORE_INDEX,
    DataError,
    format_prompt,
    load_text_dataset,
    make_collator,
    tokenize_dataset,
)
from occult_ft.embedded import embedded_data_path, embedded_model_path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_path())


ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hello.", "input": "", "output": "Hello there, friend."},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---- loading -------------------------------------------------------------------------------------
def test_txt_splits_on_blank_lines_and_keeps_indentation(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(
        "First paragraph,\nstill first.\n\n   \n\ndef f():\n    return 1\n\n\nlast  \n", encoding="utf-8"
    )
    ds = load_text_dataset(path)
    # three documents: the whitespace-only line counts as blank, trailing spaces are dropped
    assert ds["text"] == ["First paragraph,\nstill first.", "def f():\n    return 1", "last"]


def test_txt_fixed_size_chunks(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("abcdefghij", encoding="utf-8")
    assert load_text_dataset(path, chunk_chars=4)["text"] == ["abcd", "efgh", "ij"]


@pytest.mark.parametrize("field", ["text", "content"])
def test_jsonl_text_fields(tmp_path, field):
    path = _write_jsonl(tmp_path / "d.jsonl", [{field: "one", "id": 1}, {field: "two", "id": 2}])
    ds = load_text_dataset(path)
    assert ds.column_names == ["text"] and ds["text"] == ["one", "two"]


def test_jsonl_custom_text_field(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"body": "x y"}, {"body": "z"}])
    assert load_text_dataset(path, text_field="body")["text"] == ["x y", "z"]


def test_json_alpaca_list_and_missing_input(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"instruction": "Hi.", "output": "Hello."}] + ALPACA), encoding="utf-8")
    ds = load_text_dataset(path)
    assert sorted(ds.column_names) == ["input", "instruction", "output"]
    assert ds[0] == {"instruction": "Hi.", "output": "Hello.", "input": ""}
    assert ds[1]["input"] == "2 and 3"


def test_json_object_holding_one_list(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"data": [{"text": "t"}], "version": 1}), encoding="utf-8")
    assert load_text_dataset(path)["text"] == ["t"]


def test_saved_dataset_and_dataset_dict(tmp_path):
    Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    assert load_text_dataset(tmp_path / "ds")["text"] == ["a", "b"]
    DatasetDict(
        {"train": Dataset.from_list(ALPACA), "test": Dataset.from_dict({"text": ["c"]})}
    ).save_to_disk(str(tmp_path / "dd"))
    assert load_text_dataset(tmp_path / "dd").column_names == ["instruction", "input", "output"]
    assert load_text_dataset(tmp_path / "dd", split="test")["text"] == ["c"]


def test_embedded_splits():
    train = load_text_dataset("embedded")
    assert len(train) > 1000 and train.column_names == ["text"]
    assert len(load_text_dataset("embedded", split="eval")) > 50
    instructions = load_text_dataset("embedded", split="instructions")
    assert len(instructions) >= 300 and set(instructions.column_names) == {"instruction", "input", "output"}
    assert embedded_data_path("eval").endswith("eval.txt")
    with pytest.raises(
        ValueError, match="embedded split 'dev' does not exist; use one of train, eval, instructions"
    ):
        embedded_data_path("dev")


def test_embedded_model_files():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(embedded_model_path())
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("olmoe", 32, 4)


# ---- errors --------------------------------------------------------------------------------------
def test_missing_file_message(tmp_path):
    with pytest.raises(DataError) as err:
        load_text_dataset("x.jsonl")
    assert str(err.value) == (
        "data file 'x.jsonl' does not exist; pass a .txt/.jsonl/.json file, "
        "a saved dataset directory or a Hub dataset id"
    )
    with pytest.raises(DataError, match="does not exist"):
        load_text_dataset(str(tmp_path / "nested" / "dir" / "data"))


def test_unsupported_extension(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("text\na\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.csv' has unsupported extension '\.csv'"):
        load_text_dataset(path)


def test_unknown_field_layout_names_fields(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError) as err:
        load_text_dataset(path)
    message = str(err.value)
    assert (
        "['question', 'answer']" in message and "'text'" in message and "'instruction' + 'output'" in message
    )
    with pytest.raises(DataError, match="text_field 'body' is not a field"):
        load_text_dataset(path, text_field="body")


@pytest.mark.parametrize("content", ["", "\n\n  \n", None])
def test_empty_dataset(tmp_path, content):
    if content is None:
        path = _write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": "   "}])
    else:
        path = tmp_path / "e.txt"
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=f"dataset '{path}' is empty"):
        load_text_dataset(path)


def test_bad_json_rows(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"text": "a"}\n{not json}\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2 of"):
        load_text_dataset(path)
    path = tmp_path / "b.json"
    path.write_text('["just a string"]', encoding="utf-8")
    with pytest.raises(DataError, match="row 0 of .* is a str"):
        load_text_dataset(path)


def test_not_a_saved_dataset_directory(tmp_path):
    with pytest.raises(DataError, match=f"directory '{tmp_path}' is not a dataset saved with save_to_disk"):
        load_text_dataset(tmp_path)


def test_split_errors(tmp_path):
    with pytest.raises(DataError, match="embedded split 'valid' does not exist"):
        load_text_dataset("embedded", split="valid")
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match="split='test' does not apply"):
        load_text_dataset(path, split="test")


def test_offline_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(
        DataError, match="cannot load Hub dataset 'occult-ft-test/no-such-dataset' while offline"
    ):
        load_text_dataset("occult-ft-test/no-such-dataset")


# ---- tokenisation --------------------------------------------------------------------------------
def test_response_only_labels_mask_the_prompt_exactly(tokenizer):
    ds = tokenize_dataset(Dataset.from_list(ALPACA), tokenizer, seq_len=64)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for row, example in zip(ALPACA, ds):
        prompt = tokenizer(format_prompt(row["instruction"], row["input"]), add_special_tokens=False)[
            "input_ids"
        ]
        response = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [eos]
        n, m = len(prompt), len(response)
        assert example["input_ids"][: n + m] == prompt + response
        assert example["labels"] == [IGNORE_INDEX] * n + response + [IGNORE_INDEX] * (64 - n - m)
        assert example["attention_mask"] == [1] * (n + m) + [0] * (64 - n - m)
        assert example["input_ids"][n + m :] == [pad] * (64 - n - m)
        # the masked part is exactly the documented prompt (byte-level BPE decodes losslessly)
        assert tokenizer.decode(example["input_ids"][:n]) == format_prompt(row["instruction"], row["input"])


def test_prompt_template():
    assert (
        format_prompt("Do it.", "data") == "### Instruction:\nDo it.\n\n### Input:\ndata\n\n### Response:\n"
    )
    assert format_prompt("Do it.") == "### Instruction:\nDo it.\n\n### Response:\n"


def test_full_labels_without_response_only(tokenizer):
    ds = tokenize_dataset(Dataset.from_list(ALPACA), tokenizer, seq_len=64, response_only=False)
    example = ds[0]
    length = sum(example["attention_mask"])
    assert example["labels"][:length] == example["input_ids"][:length]


def test_truncation_and_dropped_rows(tokenizer):
    long_prompt = {"instruction": "word " * 200, "input": "", "output": "x"}
    long_output = {"instruction": "Say hello.", "input": "", "output": "hello " * 100}
    ds = tokenize_dataset(Dataset.from_list([long_prompt, long_output]), tokenizer, seq_len=32)
    # the prompt-only row had no label left and is dropped; the long response is cut at seq_len (no eos)
    assert len(ds) == 1
    example = ds[0]
    assert len(example["input_ids"]) == 32 and example["attention_mask"] == [1] * 32
    n = len(tokenizer(format_prompt("Say hello."), add_special_tokens=False)["input_ids"])
    assert example["labels"][:n] == [IGNORE_INDEX] * n and example["labels"][n:] == example["input_ids"][n:]
    assert tokenizer.eos_token_id not in example["input_ids"]
    with pytest.raises(DataError, match="every prompt fills seq_len=16"):
        tokenize_dataset(Dataset.from_list([long_prompt]), tokenizer, seq_len=16)


def test_packing_makes_full_blocks(tokenizer):
    docs = [f"Document number {i} says something about experts." for i in range(40)]
    ds = tokenize_dataset(Dataset.from_dict({"text": docs}), tokenizer, seq_len=32, packing=True)
    stream = [
        t
        for d in docs
        for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert len(ds) == len(stream) // 32  # the remainder is dropped
    for i, block in enumerate(ds):
        assert block["input_ids"] == stream[i * 32 : (i + 1) * 32]
        assert block["labels"] == block["input_ids"] and block["attention_mask"] == [1] * 32


def test_unpacked_text_is_padded(tokenizer):
    ds = tokenize_dataset(Dataset.from_dict({"text": ["short text"]}), tokenizer, seq_len=16, packing=False)
    ids = tokenizer("short text", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids)
    assert ds[0]["input_ids"] == ids + [tokenizer.pad_token_id] * (16 - n)
    assert ds[0]["labels"] == ids + [IGNORE_INDEX] * (16 - n)


def test_tokenize_errors(tokenizer):
    with pytest.raises(DataError, match="shorter than one block of seq_len=512"):
        tokenize_dataset(Dataset.from_dict({"text": ["tiny"]}), tokenizer, seq_len=512)
    with pytest.raises(DataError, match="packing=True is not supported for instruction rows"):
        tokenize_dataset(Dataset.from_list(ALPACA), tokenizer, seq_len=64, packing=True)
    with pytest.raises(DataError, match=r"found \['question'\]"):
        tokenize_dataset(Dataset.from_dict({"question": ["q"]}), tokenizer, seq_len=64)
    with pytest.raises(DataError, match="seq_len=1 is too short"):
        tokenize_dataset(Dataset.from_dict({"text": ["a"]}), tokenizer, seq_len=1)


def test_collator_pads_to_longest(tokenizer):
    collate = make_collator(tokenizer)
    batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8]}])
    pad = tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["input_ids"].dtype == torch.long
    assert make_collator(tokenizer, pad_to_multiple_of=4)([{"input_ids": [1]}])["input_ids"].shape == (1, 4)
