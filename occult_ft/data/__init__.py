"""Training data: load rows of the shapes TRL users have, tokenise and pack them, collate and batch them.

This package is the one owner of data handling in occult_ft; the trainer, profiling, evaluation, the
benchmarks and the demo all call it:

    loading     `load_text_dataset`: files, saved datasets, Hub ids, the embedded corpus (optionally
                streamed); rows of the text / instruction / prompt / messages layouts
    tokenize    `tokenize_dataset`: causal-LM examples, response-only labels, packing (text blocks, or
                several examples per row with restarting `position_ids`)
    batching    `make_collator` (padded or packed batches), `iter_batches`, `profile_batches`
                (rows in `spread_order`: `spread_rows`), `make_batches`, `padding_share`

`tokenize_dataset` returns `input_ids`, `labels` and `attention_mask` (lists of `seq_len` ints) or,
for packed example rows, `position_ids`; `labels` is -100 on padding and, with `response_only=True`,
on every prompt token, so the loss covers the responses only.
"""

from __future__ import annotations

from .batching import (
    flat_packing,
    iter_batches,
    make_batches,
    make_collator,
    pad_token_id,
    padding_share,
    profile_batches,
    real_token_mask,
    spread_order,
    spread_rows,
    unpack_row,
)
from .loading import (
    EMBEDDED,
    IGNORE_INDEX,
    LAYOUTS,
    DataError,
    dataset_columns,
    dataset_layout,
    load_text_dataset,
)
from .tokenize import (
    PROMPT_TEMPLATE,
    PROMPT_TEMPLATE_NO_INPUT,
    format_prompt,
    pack_examples,
    tokenize_dataset,
    tokenize_for_training,
)

__all__ = [
    "DataError",
    "EMBEDDED",
    "IGNORE_INDEX",
    "LAYOUTS",
    "PROMPT_TEMPLATE",
    "PROMPT_TEMPLATE_NO_INPUT",
    "dataset_columns",
    "dataset_layout",
    "flat_packing",
    "format_prompt",
    "iter_batches",
    "load_text_dataset",
    "make_batches",
    "make_collator",
    "pack_examples",
    "pad_token_id",
    "padding_share",
    "profile_batches",
    "spread_order",
    "spread_rows",
    "real_token_mask",
    "tokenize_dataset",
    "tokenize_for_training",
    "unpack_row",
]
