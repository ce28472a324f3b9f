"""Batching: occult_ft's one collator, the batch iterators of profiling and evaluation, the padding share.

A collated batch is a dict of (B, S) long tensors, in one of two forms:

    padded      rows with `input_ids` (+ `attention_mask`, `labels`): input_ids padded with the pad id,
                attention_mask 0 and labels -100 on padding, to the longest row of the batch.
    packed      rows with `position_ids` (`tokenize_dataset(packing=True)` on example rows): input_ids,
                labels, position_ids and `token_mask` (1 = real token, 0 = padding); no attention_mask.

Why packed batches keep their examples apart, exactly: with `attention_mask=None`, transformers
(`masking_utils.find_packed_sequence_indices`) reads every restart of `position_ids` as the start of a
new sequence and builds a block-diagonal causal mask (sdpa, eager and flex attention), for any batch
size; RoPE sees each example's own positions. Flash-attention kernels read packed sequences from
`position_ids` only for a batch of ONE row (`modeling_flash_attention_utils._is_packed_sequence`), so
for them `flatten=True` concatenates the micro-batch into a single row (and needs no padding at all).
Padding at the end of a row continues the last example's positions: under a causal mask no earlier
token attends to it. Two conditions for the forward: no `attention_mask` and `use_cache=False` (a
cache turns the packed-sequence mask off); `OccultTrainer` removes `token_mask` and sets `use_cache`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch

from ..checks import is_int
from ..models import unwrap_model
from .loading import IGNORE_INDEX, DataError
from .tokenize import tokenize_dataset

__all__ = [
    "make_collator",
    "pad_token_id",
    "flat_packing",
    "unpack_row",
    "iter_batches",
    "spread_order",
    "spread_rows",
    "profile_batches",
    "make_batches",
    "real_token_mask",
    "padding_share",
]


def pad_token_id(tokenizer=None, model=None) -> int:
    """Padding id: the tokenizer's pad token, else its eos token, else the model config's pad id.

    Raises:
        DataError: when none of them is set.
    """
    config = getattr(unwrap_model(model), "config", None)
    for owner, name in ((tokenizer, "pad_token_id"), (tokenizer, "eos_token_id"), (config, "pad_token_id")):
        value = getattr(owner, name, None) if owner is not None else None
        if is_int(value):
            return value
    if tokenizer is not None and model is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} has no eos_token; set tokenizer.eos_token first"
        )
    raise DataError("no padding id: pass a tokenizer with a pad or eos token (processing_class=tokenizer)")


def flat_packing(model) -> bool:
    """Whether packed batches for `model` must be one flat row: its attention is a flash-attention kernel."""
    config = getattr(unwrap_model(model), "config", None)
    return "flash" in str(getattr(config, "_attn_implementation", None) or "")


def _round_up(n: int, multiple: int | None) -> int:
    return -(-n // multiple) * multiple if multiple else n


def make_collator(
    tokenizer=None,
    pad_to_multiple_of: int | None = None,
    *,
    pad_token_id: int | None = None,
    flatten: bool = False,
) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """The collate function of occult_ft (training, profiling and evaluation all use it).

    Args:
        tokenizer: gives the pad id (pad token, else eos) unless `pad_token_id` is given.
        pad_to_multiple_of: round the padded width up to a multiple of this.
        pad_token_id: the pad id (overrides the tokenizer's).
        flatten: packed rows only: concatenate the batch into one row (flash-attention kernels).

    Returns:
        `collate(features) -> batch`: padded or packed (see the module docstring), chosen per batch by
        whether the rows carry `position_ids`.
    """
    pad = pad_token_id if pad_token_id is not None else _pad_id_of(tokenizer)

    def collate(features: list[dict]) -> dict[str, torch.Tensor]:
        if "position_ids" in features[0]:
            return _collate_packed(features, pad, pad_to_multiple_of, flatten)
        longest = _round_up(max(len(f["input_ids"]) for f in features), pad_to_multiple_of)
        batch: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
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


def _pad_id_of(tokenizer) -> int:
    if tokenizer is None:
        raise DataError("make_collator needs a tokenizer or pad_token_id=<int>")
    return pad_token_id(tokenizer)


def _collate_packed(features, pad: int, multiple: int | None, flatten: bool) -> dict[str, torch.Tensor]:
    rows: list[tuple[list, ...]] = [
        (list(f["input_ids"]), list(f.get("labels", f["input_ids"])), list(f["position_ids"]))
        for f in features
    ]
    if flatten:
        rows = [tuple(sum((list(r[k]) for r in rows), []) for k in range(3))]
    width = _round_up(max(len(ids) for ids, _, _ in rows), None if flatten else multiple)
    batch: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "token_mask": []}
    for ids, labels, positions in rows:
        n = width - len(ids)
        last = positions[-1] if positions else -1
        batch["input_ids"].append(ids + [pad] * n)
        batch["labels"].append(labels + [IGNORE_INDEX] * n)
        batch["position_ids"].append(positions + list(range(last + 1, last + 1 + n)))
        batch["token_mask"].append([1] * len(ids) + [0] * n)
    return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}


def unpack_row(row: dict) -> list[dict]:
    """The examples of one packed row (split where `position_ids` restart), each with `input_ids` and
    `labels`; a row without `position_ids` comes back as itself."""
    if "position_ids" not in row:
        return [row]
    ids, labels, positions = (
        list(row["input_ids"]),
        list(row.get("labels", row["input_ids"])),
        row["position_ids"],
    )
    starts = [i for i, p in enumerate(positions) if i == 0 or p != positions[i - 1] + 1] + [len(ids)]
    return [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(starts, starts[1:])]


def iter_batches(
    dataset: Iterable[dict],
    collate: Callable[[list[dict]], dict],
    batch_size: int,
    *,
    unpack: bool = False,
    columns: tuple[str, ...] | None = None,
) -> Iterator[dict]:
    """Collated batches of `batch_size` rows of `dataset` (a `Dataset`, `IterableDataset` or list), in order.

    Args:
        unpack: split packed rows into their examples first (batches of `batch_size` examples).
        columns: keep only these keys of each row (after unpacking).
    """
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size} must be at least 1")
    features: list[dict] = []
    for row in dataset:
        for example in unpack_row(row) if unpack else [row]:
            features.append({k: example[k] for k in columns if k in example} if columns else example)
            if len(features) == batch_size:
                yield collate(features)
                features = []
    if features:
        yield collate(features)


_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 1 / phi


def spread_order(n: int) -> Iterator[int]:
    """0, ..., n - 1, each once, in an order whose every prefix is spread evenly over the range.

    Profiles stop after a number of tokens, and corpora are often stored source after source (the
    embedded one: novel, dictionary, code, reference), so the first rows in file order describe one
    source only. Row i of the order is (i * a) mod n with a stride a near n / phi and coprime with n:
    a permutation (a has an inverse mod n) in which the first m rows fall into m nearly equal gaps of
    the range (the golden-ratio Weyl sequence, the most even one of its kind). Constant memory."""
    if n <= 0:
        return
    near = max(1, round(n * _GOLDEN))
    # the coprime stride nearest n / phi; n - 1 is coprime with n, so the search ends inside the range
    a = next(s for d in range(n) for s in (near + d, near - d) if 0 < s and math.gcd(s, n) == 1)
    for i in range(n):
        yield (i * a) % n


def spread_rows(dataset):
    """`dataset` with its rows in `spread_order`: a `Dataset` (an index mapping, nothing copied) or a list;
    a stream (`IterableDataset`, any other iterable) is returned as it is (sampling it would read it all)."""
    from datasets import Dataset

    if isinstance(dataset, Dataset):
        return dataset.select(list(spread_order(len(dataset))))
    if isinstance(dataset, list):
        return [dataset[j] for j in spread_order(len(dataset))]
    return dataset


def profile_batches(dataset, collate, batch_size: int) -> Iterator[dict]:
    """Batches of a tokenized dataset for `profile_model`: `input_ids` and `attention_mask`; packed rows
    are split into their examples, so every token is routed as in an unpacked forward. The rows come in
    `spread_order`, so a profile of the first N tokens samples the whole dataset, not its first source."""
    for batch in iter_batches(
        spread_rows(dataset), collate, batch_size, unpack=True, columns=("input_ids", "attention_mask")
    ):
        yield {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}


def make_batches(
    tokenizer,
    dataset,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    response_only: bool = True,
) -> list[dict]:
    """Tokenised `dataset` (rows of `load_text_dataset`) as padded batches with labels, enough of them for
    `max_tokens` real (unpadded) tokens: the last batch keeps only the rows that reach it (whole rows, so
    at most one row's tokens beyond it). `response_only=False` keeps prompts in the labels (and rows
    whose prompt fills `seq_len`): for routing statistics every token counts."""

    if tokenizer is None:
        raise DataError("the model has no tokenizer; save one beside the model (tokenizer.save_pretrained)")
    ds = tokenize_dataset(dataset, tokenizer, seq_len=seq_len, response_only=response_only)
    batches, tokens = [], 0
    for batch in iter_batches(ds, make_collator(tokenizer), batch_size):
        if max_tokens is not None and tokens >= max_tokens:
            break
        per_row = batch["attention_mask"].sum(dim=1)
        if max_tokens is not None and tokens + int(per_row.sum()) > max_tokens:
            # the rows up to the one that reaches max_tokens
            keep = int((torch.cumsum(per_row, 0) < max_tokens - tokens).sum()) + 1
            batch = {
                k: v[:keep] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()
            }
            per_row = per_row[:keep]
        batches.append(batch)
        tokens += int(per_row.sum())
    if not batches:
        raise DataError("the data gave no tokens; check the file is not empty")
    return batches


def real_token_mask(batch: dict) -> torch.Tensor | None:
    """(B, S) mask of the real (non-padding) tokens of a collated batch, None when it has no padding info."""
    for key in ("token_mask", "attention_mask"):
        mask = batch.get(key)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            return mask
    return None


def padding_share(batch: dict) -> float:
    """Share of the positions of a collated batch that are padding (0.0 when it has no padding info)."""
    mask = real_token_mask(batch)
    if mask is None or mask.numel() == 0:
        return 0.0
    return 1.0 - float(mask.bool().sum()) / mask.numel()
