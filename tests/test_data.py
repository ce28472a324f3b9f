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
    iter_batches,
    load_text_dataset,
    make_collator,
    pack_examples,
    padding_share,
    profile_batches,
    spread_order,
    spread_rows,
    tokenize_dataset,
    unpack_row,
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


# ---- packing of example rows -----------------------------------------------------------------------
def _example(tokenizer, row):
    prompt = tokenizer(format_prompt(row["instruction"], row["input"]), add_special_tokens=False)["input_ids"]
    response = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt, response


def test_best_fit_decreasing_fills_bins():
    # lengths 6 5 4 3 2 into bins of 8: 6 opens bin 0, 5 opens bin 1, 4 opens bin 2, 3 fits bin 1 (room 3,
    # the tightest), 2 fits bin 0 (room 2) -> [6+2, 5+3, 4]
    assert pack_examples([4, 6, 2, 5, 3], 8) == [[1, 2], [3, 4], [0]]
    assert pack_examples([], 8) == []
    with pytest.raises(DataError, match="does not fit seq_len=4"):
        pack_examples([5], 4)


def test_packed_instruction_rows_restart_positions_and_keep_response_only_labels(tokenizer):
    ds = tokenize_dataset(Dataset.from_list(ALPACA), tokenizer, seq_len=128, packing=True)
    assert len(ds) == 1  # both examples (well under 64 tokens each) share one row
    row = ds[0]
    assert "attention_mask" not in row and len(row["input_ids"]) == len(row["labels"]) == len(
        row["position_ids"]
    )
    (p0, r0), (p1, r1) = (_example(tokenizer, r) for r in ALPACA)
    # best-fit decreasing puts the longer example first
    first, second = ((p0, r0), (p1, r1)) if len(p0 + r0) >= len(p1 + r1) else ((p1, r1), (p0, r0))
    assert row["input_ids"] == first[0] + first[1] + second[0] + second[1]
    assert row["position_ids"] == list(range(len(first[0] + first[1]))) + list(
        range(len(second[0] + second[1]))
    )
    masked = [IGNORE_INDEX]
    assert row["labels"] == (masked * len(first[0]) + first[1] + masked * len(second[0]) + second[1])
    assert [e["input_ids"] for e in unpack_row(row)] == [first[0] + first[1], second[0] + second[1]]


def test_packed_example_starts_are_never_predicted(tokenizer):
    # without response_only, the first label of every packed example is -100: the previous example's
    # last token (its eos) must not learn to predict the next example's first token
    ds = tokenize_dataset(
        Dataset.from_list(ALPACA), tokenizer, seq_len=128, packing=True, response_only=False
    )
    row = ds[0]
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
    assert len(starts) == 2
    assert all(row["labels"][i] == IGNORE_INDEX for i in starts)
    others = [i for i in range(len(row["labels"])) if i not in starts]
    assert all(row["labels"][i] == row["input_ids"][i] for i in others)


def test_packed_collator_pads_rows_and_marks_real_tokens(tokenizer):
    collate = make_collator(tokenizer)
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [9, 10], "labels": [-100, 10], "position_ids": [0, 1]},
    ]
    batch = collate(rows)
    pad = tokenizer.pad_token_id
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, pad, pad]]
    assert batch["labels"].tolist() == [[-100, 6, -100, 8], [-100, 10, -100, -100]]
    # padding continues the last example's positions (no later token exists to see it)
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 3]]
    assert batch["token_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert padding_share(batch) == 2 / 8
    flat = make_collator(tokenizer, flatten=True)(rows)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert flat["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1]]
    assert padding_share(flat) == 0.0


@pytest.mark.parametrize("model_type", ["olmoe", "mixtral"])
@pytest.mark.parametrize("attn, flatten", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_a_packed_batch_gives_the_per_token_losses_of_separate_examples(model_type, attn, flatten):
    from helpers import build_tokenizer
    from transformers import AutoModelForCausalLM

    from occult_ft.models import tiny_config

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = tiny_config(model_type, vocab_size=len(tok))
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."},
        {"instruction": "Say hello.", "input": "", "output": "Hello there, friend of the river."},
        {"instruction": "Name a fox.", "input": "", "output": "The quick brown fox."},
    ]
    # 83, 77 and 65 tokens: best-fit decreasing packs [83 + 77] and [65] (the second row padded by 95)
    packed = tokenize_dataset(Dataset.from_list(rows), tok, seq_len=160, packing=True)
    single = tokenize_dataset(Dataset.from_list(rows), tok, seq_len=160, packing=False)

    def token_losses(batch, **extra):
        with torch.no_grad():
            logits = model(**batch, **extra).logits.float()
        # logits at t predict labels at t + 1; a -100 label gives loss 0 (reduction none)
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="none"
        )
        keep = batch["labels"][:, 1:].flatten() != IGNORE_INDEX
        return losses[keep]

    batch = make_collator(tok, flatten=flatten)(list(packed))
    assert batch["input_ids"].shape[0] == (1 if flatten else len(packed)) and len(packed) < len(rows)
    batch.pop("token_mask")
    got = token_losses(batch, use_cache=False)
    # reference: each example alone, padded; tokens in packing order (unpack_row gives it)
    order = [e["input_ids"] for row in packed for e in unpack_row(row)]
    by_ids = {tuple(r["input_ids"][: sum(r["attention_mask"])]): r for r in single}
    want = torch.cat([token_losses(make_collator(tok)([by_ids[tuple(ids)]])) for ids in order])
    assert got.shape == want.shape and got.numel() == 14 + 34 + 21  # every response token
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the packing matters: with attention across the examples the later ones' losses change
    crossed = token_losses({"input_ids": batch["input_ids"], "labels": batch["labels"]}, use_cache=False)
    assert not torch.allclose(crossed, want, atol=1e-3)


def test_instruction_packing_cuts_padding_on_alpaca_shaped_data(tokenizer):
    # the shipped 420 Alpaca-style rows at seq_len 512, micro-batches of 8: one example per row pads
    # ~73% of the positions; packed rows pad under 5%
    ds = load_text_dataset("embedded", split="instructions")

    def share(tokenized):
        masks = [
            b.get("token_mask", b.get("attention_mask"))
            for b in iter_batches(tokenized, make_collator(tokenizer), 8)
        ]
        return sum(int((m == 0).sum()) for m in masks) / sum(m.numel() for m in masks)

    assert share(tokenize_dataset(ds, tokenizer, 512, packing=False)) > 0.6
    assert share(tokenize_dataset(ds, tokenizer, 512, packing=True)) <= 0.05


# ---- the shapes TRL users have: prompt / completion, messages, streaming -----------------------------
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def chat_tokenizer(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_prompt_completion_strings_are_encoded_like_instruction_rows(tmp_path, tokenizer):
    rows = [
        {"prompt": format_prompt(r["instruction"], r["input"]), "completion": r["output"]} for r in ALPACA
    ]
    ds = load_text_dataset(_write_jsonl(tmp_path / "pc.jsonl", rows))
    assert ds.column_names == ["prompt", "completion"]
    got = tokenize_dataset(ds, tokenizer, seq_len=64)
    want = tokenize_dataset(Dataset.from_list(ALPACA), tokenizer, seq_len=64)
    assert got["input_ids"] == want["input_ids"] and got["labels"] == want["labels"]


def test_messages_train_every_assistant_reply_and_nothing_else(tmp_path, chat_tokenizer):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 and 4?"},
        {"role": "assistant", "content": "8"},
    ]
    ds = load_text_dataset(_write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat, "id": 1}]))
    assert ds.column_names == ["messages"]
    row = tokenize_dataset(ds, chat_tokenizer, seq_len=128)[0]
    n = sum(row["attention_mask"])
    text = chat_tokenizer.apply_chat_template(chat, tokenize=False)
    assert chat_tokenizer.decode(row["input_ids"][:n]) == text
    # the trained spans are the two replies as the template writes each assistant turn: content, the
    # end-of-turn token and the newline after it
    trained, spans, current = row["labels"][:n], [], []
    for t, label in zip(row["input_ids"][:n], trained):
        if label != IGNORE_INDEX:
            current.append(t)
        elif current:
            spans.append(chat_tokenizer.decode(current))
            current = []
    spans += [chat_tokenizer.decode(current)] if current else []
    assert spans == ["5<|endoftext|>\n", "8<|endoftext|>\n"]
    full = tokenize_dataset(ds, chat_tokenizer, seq_len=128, response_only=False)[0]
    assert full["input_ids"] == row["input_ids"] and full["labels"][:n] == full["input_ids"][:n]


def test_conversational_prompt_completion_trains_the_completion(chat_tokenizer):
    prompt = [{"role": "user", "content": "Say hello."}]
    completion = [{"role": "assistant", "content": "Hello there."}]
    row = tokenize_dataset(
        Dataset.from_list([{"prompt": prompt, "completion": completion}]), chat_tokenizer, seq_len=64
    )[0]
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
    assert chat_tokenizer.decode(trained) == "Hello there.<|endoftext|>\n"


def test_messages_without_a_chat_template_is_one_clear_error(tokenizer):
    rows = Dataset.from_list(
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    )
    with pytest.raises(DataError, match="has no chat template, so 'messages' rows cannot be formatted"):
        tokenize_dataset(rows, tokenizer, seq_len=64)


def test_streamed_files_give_the_rows_of_the_loaded_ones(tmp_path, tokenizer):
    from datasets import IterableDataset

    path = _write_jsonl(tmp_path / "a.jsonl", ALPACA * 3)
    streamed = load_text_dataset(path, streaming=True)
    assert isinstance(streamed, IterableDataset)
    assert list(streamed) == list(load_text_dataset(path))
    text = load_text_dataset("embedded", split="eval", streaming=True)
    assert isinstance(text, IterableDataset) and next(iter(text))["text"]
    got = tokenize_dataset(streamed, tokenizer, seq_len=128, packing=True)
    want = tokenize_dataset(load_text_dataset(path), tokenizer, seq_len=128, packing=True)
    assert list(got) == list(want)
    # the profiler's batches unpack packed rows into their examples, padded with an attention mask
    batches = list(profile_batches(got, make_collator(tokenizer), 4))
    assert sum(b["input_ids"].shape[0] for b in batches) == len(ALPACA) * 3
    assert all(b["attention_mask"] is not None for b in batches)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 40, 97, 4603])
def test_spread_order_visits_every_row_once(n):
    assert sorted(spread_order(n)) == list(range(n))


def test_every_prefix_of_the_spread_order_covers_the_range_evenly():
    for n in (101, 400, 4603, 65536):
        order = list(spread_order(n))
        for m in (4, 8, 16, 100):
            if m > n // 4:
                continue
            quarters = [0, 0, 0, 0]
            for j in order[:m]:
                quarters[4 * j // n] += 1
            assert max(abs(c - m / 4) for c in quarters) <= 2, (n, m, quarters)


def test_profile_batches_sample_every_source_of_an_ordered_dataset(tokenizer):
    # two sources stored one after the other, as corpora often are: a profile that stops after a few
    # rows must still see both (in file order its first 50 rows are all "alpha")
    rows = [{"text": f"alpha {i} " * 8} for i in range(50)] + [{"text": f"omega {i} " * 8} for i in range(50)]
    ds = tokenize_dataset(Dataset.from_list(rows), tokenizer, seq_len=64)
    batches = list(profile_batches(ds, make_collator(tokenizer), 4))
    first = tokenizer.batch_decode(batches[0]["input_ids"], skip_special_tokens=True)
    assert any("alpha" in t for t in first) and any("omega" in t for t in first)
    # every row exactly once, nothing dropped or repeated
    seen = sorted(
        tuple(ids[mask.bool()].tolist())
        for b in batches
        for ids, mask in zip(b["input_ids"], b["attention_mask"])
    )
    assert seen == sorted(tuple(r) for r in ds["input_ids"])


def test_spread_rows_reorders_in_memory_data_and_leaves_streams_alone(tmp_path):
    from datasets import IterableDataset

    rows = [{"text": str(i)} for i in range(10)]
    want = [rows[j] for j in spread_order(10)]
    assert spread_rows(rows) == want
    assert list(spread_rows(Dataset.from_list(rows))) == want
    stream = load_text_dataset(_write_jsonl(tmp_path / "a.jsonl", ALPACA), streaming=True)
    assert isinstance(stream, IterableDataset) and spread_rows(stream) is stream
