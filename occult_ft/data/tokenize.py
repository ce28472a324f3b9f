"""Tokenising and packing: rows of every layout -> causal-LM examples (`input_ids`, `labels`, ...).

Prompt template of instruction rows (the Alpaca section headers without the preamble):

    ### Instruction:
    {instruction}

    ### Input:                      <- this section only when `input` is not empty
    {input}

    ### Response:
    {output}<eos>

`prompt` / `completion` strings are encoded the same way: prompt (with the tokenizer's own special
tokens), completion, eos. `messages` rows and conversational prompt / completion rows are rendered by
the tokenizer's chat template; the response is what the template writes for each assistant turn (its
end-of-turn token included).

Labels are -100 on padding and, with `response_only=True`, on every prompt token, so the loss covers
the responses only.

Packing (`packing=True`): text rows are concatenated (eos after each) and cut into full `seq_len`
blocks, as in pre-training; example rows are grouped by best-fit decreasing (`pack_examples`, see
`_pack_rows` for what keeps them apart).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import cast

from .loading import IGNORE_INDEX, DataError, check_rows, dataset_columns, dataset_layout

__all__ = [
    "PROMPT_TEMPLATE",
    "PROMPT_TEMPLATE_NO_INPUT",
    "PACKING_CHUNK",
    "format_prompt",
    "pack_examples",
    "tokenize_dataset",
    "tokenize_for_training",
]

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
PACKING_CHUNK = 1000  # examples packed together (best-fit decreasing looks at one chunk at a time)
_KEYS = ("input_ids", "attention_mask", "labels")


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


# ---- chat templates ------------------------------------------------------------------------------
def _check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no chat "
            "template, so 'messages' rows cannot be formatted; set tokenizer.chat_template (for example the "
            "one of the model's instruct version) or give 'prompt'/'completion' or 'text' rows"
        )


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def _chat_example(tokenizer, prompt: list[dict], completion: list[dict] | None, response_only: bool):
    """(ids, labels) of a conversation; the trained characters are each assistant reply as rendered.

    `completion=None`: `prompt` is a whole `messages` list and every assistant turn is trained;
    otherwise only `completion` is (TRL's conversational prompt-completion rows)."""
    turns = list(prompt) + list(completion or [])
    full = _render(tokenizer, turns, generation_prompt=False)
    if not response_only:
        ids = tokenizer(full, add_special_tokens=False, verbose=False)["input_ids"]
        return ids, list(ids)
    spans = []  # character spans of trained text
    starts = range(len(prompt), len(turns)) if completion is not None else range(len(turns))
    for i in starts:
        if completion is None and turns[i].get("role") != "assistant":
            continue
        before = _render(tokenizer, turns[:i], generation_prompt=True)
        through = _render(tokenizer, turns[: i + 1] if completion is None else turns, generation_prompt=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError(
                f"the chat template renders turn {i} ({turns[i].get('role')!r}) differently once later turns "
                "follow, so its reply cannot be located for response-only loss; pass response_only=False"
            )
        spans.append((len(before), len(through)))
        if completion is not None:
            break
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    # a token is trained when its characters overlap a reply (one straddling the boundary included)
    labels = [
        t if not response_only or any(start < b and a < end for a, b in spans) else IGNORE_INDEX
        for t, (start, end) in zip(ids, offsets)
    ]
    return ids, labels


# ---- examples of every layout ----------------------------------------------------------------------
def _examples(batch: dict, layout: str, tokenizer, eos: int, response_only: bool) -> list[tuple[list, list]]:
    """(input_ids, labels) of each row of a batch of instruction / prompt / messages rows."""
    if layout == "messages":
        return [_chat_example(tokenizer, m, None, response_only) for m in batch["messages"]]
    if layout == "instruction":
        inputs = batch["input"] if "input" in batch else [""] * len(batch["instruction"])
        prompts = [format_prompt(i, x) for i, x in zip(batch["instruction"], inputs)]
        completions = batch["output"]
    else:
        prompts, completions = batch["prompt"], batch["completion"]
    out: list[tuple[list, list] | None] = [None] * len(prompts)
    plain = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            if isinstance(completions[i], str):
                raise DataError(
                    "a 'prompt' of chat messages needs a 'completion' of chat messages too (got a string); "
                    "make both strings or both message lists"
                )
            out[i] = _chat_example(tokenizer, p, completions[i], response_only)
    if plain:
        prompt_ids = _encode(tokenizer, [prompts[i] for i in plain], eos, True)
        output_ids = _encode(tokenizer, [str(completions[i]) for i in plain], eos, False)
        for i, p_ids, o in zip(plain, prompt_ids, output_ids):
            labels = ([IGNORE_INDEX] * len(p_ids) if response_only else list(p_ids)) + o + [eos]
            out[i] = (p_ids + o + [eos], labels)
    return cast("list[tuple[list, list]]", out)  # every row is filled: chat rows above, plain ones here


def pack_examples(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: indices of `lengths` grouped into bins of at most `capacity` tokens.

    Longest first, each example goes to the bin with the least free room that still fits it (a new
    bin when none does). Bins come back in the order they were opened; indices within a bin in the
    order they were placed.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free room, bin index), sorted
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise DataError(f"an example of {n} tokens does not fit seq_len={capacity}; truncate it first")
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= n
        bisect.insort(free, (room, b))
    return bins


# Example rows (instruction, prompt/completion, messages) are grouped into rows of at most `seq_len`
# tokens over chunks of PACKING_CHUNK examples. Each row carries `position_ids` that restart at 0 for every
# example, which is what keeps examples apart in attention (`occult_ft.data.batching`); the first label
# of every example is -100, so no example learns to predict the next one's start.
def _pack_rows(examples: list[tuple[list, list]], seq_len: int) -> dict[str, list]:
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for members in pack_examples([len(ids) for ids, _ in examples], seq_len):
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for i in members:
            e_ids, e_labels = examples[i]
            ids += e_ids
            labels += [IGNORE_INDEX] + e_labels[1:]
            positions += range(len(e_ids))
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["position_ids"].append(positions)
    return rows


# ---- the dataset -----------------------------------------------------------------------------------
def tokenize_dataset(
    ds,
    tokenizer,
    seq_len: int,
    packing: bool | None = None,
    response_only: bool = True,
    *,
    num_proc: int | None = None,
    text_field: str | None = None,
    skip_invalid_rows: bool = False,
    name: str = "the dataset",
):
    """Turn the rows of `load_text_dataset` (or rows of those layouts built by hand) into causal-LM
    examples, after the row check every loader shares (`occult_ft.data.loading.check_rows`).

    Args:
        ds: a `Dataset` or `IterableDataset` of one layout: `text`; `instruction` / `input` / `output`;
            `prompt` / `completion` (strings or chat messages); `messages` (chat messages).
        tokenizer: a transformers tokenizer with an `eos_token` (padding uses `pad_token`, else eos);
            `messages` rows need its chat template.
        seq_len: length of every example (the most tokens of a packed row).
        packing: text rows (default True): concatenate the documents, each followed by eos, and cut the
            stream into full `seq_len` blocks (the remainder of each 1000-document batch is dropped);
            False: one example per document, truncated and padded. Other rows (default False): True
            packs several examples into each row with `position_ids` restarting at every example
            (rows of at most `seq_len` tokens, unpadded, no `attention_mask`: `make_collator` pads and
            keeps the examples apart); False gives one padded example per row.
        response_only: all but text rows: labels are -100 on the prompt, so the loss covers the
            responses; False trains on the prompt too.
        num_proc: processes for `Dataset.map` (ignored for an `IterableDataset`).
        text_field / skip_invalid_rows / name: the row check's (`check_rows`): the plain-text field when
            it is neither `text` nor `content`, skip rows that do not fit the layout (counted), and the
            name its messages give the rows.

    Returns:
        A dataset of the same kind with `input_ids`, `labels` and either `attention_mask` (padded to
        `seq_len`, labels -100 on padding) or `position_ids` (packed example rows). Examples longer
        than `seq_len` are cut; examples whose prompt fills `seq_len` (no label left) are dropped.

    Raises:
        DataError: for an unknown layout, a tokenizer without eos (or without a chat template for
            messages), seq_len < 2, or no example left (text shorter than one block, every prompt too long).
    """
    from datasets import IterableDataset

    if seq_len < 2:
        raise DataError(f"seq_len={seq_len} is too short; use at least 2 tokens (typically 128-4096)")
    eos, pad = _special_ids(tokenizer)
    columns = dataset_columns(ds)
    try:
        layout = dataset_layout(columns, text_field)
    except DataError:
        raise DataError(
            "tokenize_dataset needs a 'text' column, 'instruction'/'output' or 'prompt'/'completion' columns, "
            f"or a 'messages' column; found {columns}"
        ) from None
    if layout == "tokenized":
        return ds
    ds = check_rows(ds, name, text_field, skip_invalid_rows)  # every row fits the layout, or is counted
    columns = dataset_columns(ds)
    extra = {} if isinstance(ds, IterableDataset) else {"num_proc": num_proc}
    if layout == "text":
        return _tokenize_text(ds, columns, tokenizer, (eos, pad), seq_len, packing is None or packing, extra)
    return _tokenize_examples(
        ds, columns, layout, tokenizer, (eos, pad), seq_len, bool(packing), response_only, extra
    )


def _tokenize_text(
    ds, columns: list[str], tokenizer, specials: tuple[int, int], seq_len: int, packing: bool, extra: dict
):
    """Text rows: packed into full `seq_len` blocks of the document stream, or one padded example per
    document (`tokenize_dataset`)."""
    from datasets import IterableDataset

    eos, pad = specials
    if "text" not in columns:  # a `content` column straight from the user
        ds = ds.rename_column("content", "text")
        columns = ["text" if c == "content" else c for c in columns]
    if packing:

        def pack(batch):
            stream = [t for ids in _encode(tokenizer, batch["text"], eos, True) for t in ids + [eos]]
            blocks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
            return {
                "input_ids": blocks,
                "attention_mask": [[1] * seq_len for _ in blocks],
                "labels": [list(b) for b in blocks],
            }

        out = ds.map(pack, batched=True, batch_size=PACKING_CHUNK, remove_columns=columns, **extra)
        if not isinstance(out, IterableDataset) and len(out) == 0:
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
        return {key: [row[key] for row in rows] for key in _KEYS}

    return ds.map(one_per_doc, batched=True, remove_columns=columns, **extra)


def _tokenize_examples(
    ds,
    columns: list[str],
    layout: str,
    tokenizer,
    specials: tuple[int, int],
    seq_len: int,
    packing: bool,
    response_only: bool,
    extra: dict,
):
    """Instruction, prompt and messages rows: one example per row, labels -100 on the prompt when
    `response_only`, padded or packed (`tokenize_dataset`)."""
    from datasets import IterableDataset

    eos, pad = specials
    if layout == "messages":
        _check_chat_template(tokenizer)

    def examples(batch):
        kept = []
        for ids, labels in _examples(batch, layout, tokenizer, eos, response_only):
            ids, labels = ids[:seq_len], labels[:seq_len]
            if any(label != IGNORE_INDEX for label in labels[1:]):  # the first label never counts
                kept.append((ids, labels))
        if packing:
            return _pack_rows(kept, seq_len)
        rows = [_pad(ids, labels, seq_len, pad) for ids, labels in kept]
        return {key: [row[key] for row in rows] for key in _KEYS}

    out = ds.map(examples, batched=True, batch_size=PACKING_CHUNK, remove_columns=columns, **extra)
    if not isinstance(out, IterableDataset) and len(out) == 0:
        raise DataError(
            f"every prompt fills seq_len={seq_len} tokens, leaving no response to train on; raise seq_len"
        )
    return out


def tokenize_for_training(dataset, tokenizer, args, name: str = "the dataset given to OccultTrainer"):
    """Tokenize raw rows (any layout of `occult_ft.data.load_text_dataset`: text, instruction, prompt /
    completion, messages; a `Dataset` or a streamed `IterableDataset`) as `args` (an `OccultConfig`) says
    (`seq_len`, `packing`, `response_only`, and the row check's `text_field` / `skip_invalid_rows`;
    `name` names the rows in its messages); tokenized data (an `input_ids` column) and non-`datasets`
    objects are returned unchanged."""
    from datasets import Dataset, IterableDataset

    if not isinstance(dataset, (Dataset, IterableDataset)):
        return dataset

    columns = dataset_columns(dataset)
    if not columns:  # a stream that yields nothing
        raise DataError(f"{name} yields no rows; check the data source (a streamed dataset that is empty)")
    if dataset_layout(columns) == "tokenized":
        return dataset
    if tokenizer is None:
        raise ValueError(
            "the dataset holds raw text; pass processing_class=<tokenizer> so it can be tokenized"
        )
    text_field = getattr(args, "text_field", None)  # loaded rows carry it renamed to `text` already
    with args.main_process_first(desc="tokenizing"):
        return tokenize_dataset(
            dataset,
            tokenizer,
            args.seq_len,
            packing=args.packing,
            response_only=args.response_only,
            text_field=text_field if text_field in columns else None,
            skip_invalid_rows=getattr(args, "skip_invalid_rows", False),
            name=name,
        )
