"""Single-device expert compute: the base case of dispatch (D = 1, no communication).

    local_experts_forward   received rows with K (local id, weight) slots -> one summed row each
    local_moe_forward       the single-device dispatcher (every expert local, one row per token)
    grouped_linear          one projection over contiguous per-expert blocks ("grouped_mm" / "loop")

Shape legend:
    R  rows (received rows, or tokens when D = 1)     K  slots per row (top-k)     H  hidden size
    P  local experts of the module                    N  non-sentinel (row, slot) pairs
    I/O  input/output width of one projection
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .plan import LOCAL_SENTINEL
from .reference import expert_activation, expert_weights

__all__ = ["BACKENDS", "local_experts_forward", "local_moe_forward", "grouped_linear", "num_local_experts"]

# "grouped_mm": torch.nn.functional.grouped_mm, one kernel per projection (CPU fp32/bf16 with 16-byte
# aligned strides; CUDA bf16 on sm80+). "loop": one torch.mm per active expert on its block (any device
# or dtype). "auto": grouped_mm where its constraints hold, else loop. All equal `reference_moe` to
# float rounding (tested at 1e-5 in fp32).
BACKENDS = ("auto", "grouped_mm", "loop")


def num_local_experts(experts: nn.Module) -> int:
    """P: experts held by this module (dim 0 of its fused up projection)."""
    return int(expert_weights(experts)["up_EIO"].shape[0])


def _aligned(t: torch.Tensor) -> bool:
    # grouped_mm's kernels need a 16-byte aligned base and 16-byte multiples for every non-unit stride
    # (size-1 dims have no stride to honour)
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    return all((st * size) % 16 == 0 for st, n in zip(t.stride(), t.shape) if st != 1 and n > 1)


def _grouped_mm_supported(w_EIO: torch.Tensor) -> bool:
    """grouped_mm runs on these weights (torch, device, dtype, alignment), whatever the rows."""
    if not hasattr(F, "grouped_mm"):
        return False
    if w_EIO.device.type == "cpu":
        ok_dtype = w_EIO.dtype in (torch.float32, torch.bfloat16)
    elif w_EIO.device.type == "cuda":
        ok_dtype = w_EIO.dtype == torch.bfloat16 and torch.cuda.get_device_capability(w_EIO.device) >= (8, 0)
    else:
        return False
    return ok_dtype and _aligned(w_EIO)


def _grouped_mm_usable(x_NI: torch.Tensor, w_EIO: torch.Tensor) -> bool:
    if x_NI.dtype != w_EIO.dtype or x_NI.shape[0] == 0:
        return False
    return _grouped_mm_supported(w_EIO) and _aligned(x_NI)


def grouped_linear(
    x_NI: torch.Tensor,
    w_EIO: torch.Tensor,
    counts: Sequence[int] | None,
    bias_NO: torch.Tensor | None = None,
    backend: str = "auto",
    offs_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[n] = x[n] @ w[e(n)] (+ bias_NO[n]) for rows sorted into contiguous per-expert blocks.

    Args:
        x_NI: (N, I) rows, the first counts[0] for expert 0, the next counts[1] for expert 1, ...
        w_EIO: (E, I, O) weights (any strides).
        counts: E Python ints summing to N; or None with `offs_E`.
        bias_NO: optional (N, O) per-row bias (already gathered per row's expert).
        backend: one of `BACKENDS`.
        offs_E: (E,) int32 block ends on the device instead of `counts` (grouped_mm only, no host
            synchronisation): rows from offs_E[-1] on belong to no expert and come back undefined, so
            the caller masks them (`local_experts_forward` does).

    Returns:
        (N, O), attached to the graph of x_NI and w_EIO even when N == 0.
    """
    if offs_E is not None:
        return (
            F.grouped_mm(x_NI, w_EIO, offs=offs_E)
            if bias_NO is None
            else (F.grouped_mm(x_NI, w_EIO, offs=offs_E) + bias_NO)
        )
    if counts is None:
        raise ValueError("grouped_linear needs counts (E ints) or offs_E (block ends on the device)")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "grouped_mm" and not hasattr(F, "grouped_mm"):
        raise ValueError(
            f"backend='grouped_mm' needs torch.nn.functional.grouped_mm (torch {torch.__version__} lacks it)"
        )
    use_grouped = backend == "grouped_mm" or (backend == "auto" and _grouped_mm_usable(x_NI, w_EIO))
    if use_grouped and x_NI.shape[0] > 0:
        # host ints -> device without a blocking copy (a blocking one waits for the queued kernels)
        # offs_E[e] = end of expert e's block = counts[0] + ... + counts[e] (grouped_mm's offsets are block ends)
        offs_E = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        offs_E = offs_E.to(x_NI.device, non_blocking=True)
        y_NO = F.grouped_mm(x_NI, w_EIO, offs=offs_E)
    else:
        pieces, start = [], 0
        for e, count in enumerate(counts):
            if count:
                pieces.append(x_NI[start : start + count] @ w_EIO[e])
            start += count
        # No active expert: a zero-size product keeps x and w in the graph (their gradients are zeros).
        y_NO = torch.cat(pieces) if pieces else x_NI[:0] @ w_EIO[0]
    return y_NO if bias_NO is None else y_NO + bias_NO


def local_experts_forward(
    x_RH: torch.Tensor,
    local_ids_RK: torch.Tensor,
    weights_RK: torch.Tensor,
    experts: nn.Module,
    backend: str = "auto",
    counts: Sequence[int] | str | None = None,
) -> torch.Tensor:
    """out[r] = sum over slots k with local_ids_RK[r, k] != -1 of weights_RK[r, k] * expert_k(x_RH[r]).

    Args:
        x_RH: (R, H) rows (R may be 0).
        local_ids_RK: (R, K) int64 local expert ids in [0, P), or `LOCAL_SENTINEL` (-1) to skip a slot.
        weights_RK: (R, K) gate weights (0 at sentinel slots by convention; they are ignored anyway).
        experts: a transformers fused experts module holding P experts (any layout of
            `reference.expert_weights`; its `_apply_gate`, biases and post-norm are honoured).
        backend: one of `BACKENDS` (see the comment above it).
        counts: the live (row, slot) pairs per local expert:
            None: counted here, with a range check of the ids (one host synchronisation);
            P Python ints: given by the exchange (it learnt them in its count exchange; no sync);
            "device": never read on the host (the capacity-bounded exchange): grouped_mm runs on
            device block offsets over every (row, slot) pair and the pairs beyond the live ones are
            masked; where grouped_mm cannot run (see `BACKENDS`), the counts are read after all (one
            host synchronisation).

    Returns:
        (R, H) in x_RH.dtype, summed over slots in the promoted dtype of expert outputs and weights.
    """
    num_rows, top_k = local_ids_RK.shape
    if x_RH.shape[0] != num_rows or weights_RK.shape != local_ids_RK.shape:
        raise ValueError(
            f"shapes disagree: rows {tuple(x_RH.shape)}, local_ids {tuple(local_ids_RK.shape)}, "
            f"weights {tuple(weights_RK.shape)}; expected (R, H), (R, K), (R, K)"
        )
    if isinstance(counts, str) and counts != "device":
        raise ValueError(f"counts={counts!r}: give None, P integers or 'device'")
    w = expert_weights(experts)
    num_local = int(w["up_EIO"].shape[0])
    # (row, slot) pairs flattened row-major: pair n is row n // K, slot n % K
    ids_N = local_ids_RK.reshape(-1).long()
    # Sort (row, slot) pairs by expert; the sentinel sorts last as key P and is cut off.
    key_N = torch.where(ids_N == LOCAL_SENTINEL, num_local, ids_N)
    if counts == "device" and backend != "loop":
        mats = (w["up_EIO"], w["down_EIO"])
        # the byte widths of every row of both weight matrices (I and O of up and down) must be 16-byte multiples
        row_bytes = [m.shape[i] * m.element_size() for m in mats for i in (1, 2)]
        usable = all(_grouped_mm_supported(m) for m in mats)
        if ids_N.numel() and usable and all(b % 16 == 0 for b in row_bytes):
            return _device_counted(x_RH, key_N, weights_RK, experts, w, num_local, top_k)
    if counts is None or counts == "device":
        # Out-of-range ids are counted in one extra bin (P + 1), so the per-expert counts and the range
        # check come back to the host together: one host synchronisation.
        bad_N = (ids_N >= num_local) | (ids_N < LOCAL_SENTINEL)
        key_N = torch.where(bad_N, num_local + 1, key_N)
        counts_all = torch.bincount(key_N, minlength=num_local + 2).tolist()
        if counts_all[num_local + 1]:
            bad = ids_N[bad_N].unique()[:8].tolist()
            raise ValueError(f"local expert ids {bad} are outside [0, {num_local}) and not the sentinel -1")
        counts = counts_all[:num_local]
    elif len(counts) != num_local:
        raise ValueError(f"counts has {len(counts)} entries for {num_local} local experts")
    counts = [int(c) for c in counts]
    # Stable sort by expert: the first counts[0] pairs are expert 0's, and so on; the live pairs are
    # the first sum(counts) (sentinels sort last as key P). Each live pair gathers its row's hidden
    # state: a row with j local slots is computed j times, once per expert, as in any grouped MoE.
    key_sorted, pair_order = torch.sort(key_N, stable=True)
    active = sum(counts)
    pair_g, expert_g = pair_order[:active], key_sorted[:active]
    # pair n belongs to row n // K: each live pair gathers its row's hidden state
    x_g = x_RH[pair_g // top_k].to(w["up_EIO"].dtype)

    up_bias = w["up_bias_EO"][expert_g] if w["up_bias_EO"] is not None else None
    up_g = grouped_linear(x_g, w["up_EIO"], counts, up_bias, backend)
    mid_g = expert_activation(experts, up_g)
    down_bias = w["down_bias_EO"][expert_g] if w["down_bias_EO"] is not None else None
    y_g = grouped_linear(mid_g, w["down_EIO"], counts, down_bias, backend)
    if getattr(experts, "has_post_expert_norm", False):
        y_g = experts.post_expert_norm(y_g)  # type: ignore[operator]
    # The gate weight multiplies the expert output on this device, then a row's slots are summed: one
    # row per (token, device) goes back, which is what de-duplication saves on the way home.
    # weights_RK.reshape(-1)[n] is the weight of pair n = (row n // K, slot n % K)
    weighted_g = y_g * weights_RK.reshape(-1)[pair_g].unsqueeze(-1)
    return _sum_slots(weighted_g, pair_g, num_rows, top_k).to(x_RH.dtype)


def _sum_slots(weighted_NH: torch.Tensor, pair_N: torch.Tensor, num_rows: int, top_k: int) -> torch.Tensor:
    """(R, H): the weighted outputs of each row's (row, slot) pairs summed per row.

    On CPU one index_add into (R, H) (deterministic there); elsewhere the pairs go back to (row, slot)
    order in an (R * K, H) buffer, sentinel slots zero, summed over K with a reshape (deterministic,
    unlike index_add on CUDA), as transformers' kernels do."""
    if weighted_NH.device.type == "cpu":
        out_RH = weighted_NH.new_zeros(num_rows, weighted_NH.shape[-1])
        # pair n adds into row n // K
        return out_RH.index_add(0, torch.div(pair_N, top_k, rounding_mode="floor"), weighted_NH)
    # pair n lands at position n = row * K + slot of an (R * K, H) buffer: view (R, K, H), sum over K
    pairs_NH = weighted_NH.new_zeros(num_rows * top_k, weighted_NH.shape[-1]).index_copy(
        0, pair_N, weighted_NH
    )
    return pairs_NH.view(num_rows, top_k, pairs_NH.shape[-1]).sum(dim=1)


def _device_counted(x_RH, key_N, weights_RK, experts, w, num_local: int, top_k: int) -> torch.Tensor:
    """`local_experts_forward` without host counts: grouped_mm over all (row, slot) pairs sorted by
    expert, block ends on the device; pairs past the live ones (sentinels, pads) are masked to zero
    before and after every grouped product, so undefined rows never reach a value or a gradient."""
    num_rows = x_RH.shape[0]
    key_sorted, pair_order = torch.sort(key_N, stable=True)
    live_N = (key_sorted < num_local).unsqueeze(-1)
    # counts by scatter_add: bincount's output size depends on the data, which a GPU reads on the host
    per_expert = torch.zeros(num_local + 1, dtype=torch.long, device=key_N.device)
    per_expert = per_expert.scatter_add_(0, key_N, torch.ones_like(key_N))[:num_local]
    offs_E = per_expert.cumsum(0).to(torch.int32)  # block ends; pairs past offs_E[-1] are dead
    # dead pairs borrow the last expert's bias only to keep the gather in range; they are masked
    expert_g = key_sorted.clamp_max(num_local - 1)
    dtype = w["up_EIO"].dtype
    # pair n of the sorted order is row pair_order[n] // K: dead pairs read a zero row
    x_g = torch.where(live_N, x_RH[pair_order // top_k].to(dtype), 0.0)
    up_bias = w["up_bias_EO"][expert_g] if w["up_bias_EO"] is not None else None
    up_g = torch.where(live_N, grouped_linear(x_g, w["up_EIO"], None, up_bias, offs_E=offs_E), 0.0)
    mid_g = torch.where(live_N, expert_activation(experts, up_g), 0.0)
    down_bias = w["down_bias_EO"][expert_g] if w["down_bias_EO"] is not None else None
    y_g = torch.where(live_N, grouped_linear(mid_g, w["down_EIO"], None, down_bias, offs_E=offs_E), 0.0)
    if getattr(experts, "has_post_expert_norm", False):
        y_g = torch.where(live_N, experts.post_expert_norm(y_g), 0.0)
    weighted_g = y_g * weights_RK.reshape(-1)[pair_order].unsqueeze(-1)
    return _sum_slots(weighted_g, pair_order, num_rows, top_k).to(x_RH.dtype)


def local_moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: nn.Module,
    backend: str = "auto",
) -> torch.Tensor:
    """The single-device dispatcher: every expert is local, each token is one row (C_T = 1).

    Args:
        hidden_TH: (T, H); topk_ids_TK: (T, K) int ids in [0, E); weights_TK: (T, K).
        experts: the module holding all E experts.

    Returns:
        (T, H), equal to `reference_moe(hidden_TH, topk_ids_TK, weights_TK, experts_module_fn(experts))`.
    """
    if hidden_TH.dim() != 2:
        raise ValueError(f"hidden_TH must be (T, H), got shape {tuple(hidden_TH.shape)}")
    return local_experts_forward(hidden_TH, topk_ids_TK, weights_TK, experts, backend)
