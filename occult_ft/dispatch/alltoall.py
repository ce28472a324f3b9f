"""The de-duplicated all-to-all MoE layer (Occult mechanism 1): layout -> dispatch -> local -> combine.

**A token is sent once per device however many of its experts live there.** Each rank:

1. `compute_layout`: the (token, device) rows it sends, device-major (see `layout.py`);
2. `dispatch`: exchanges the row counts, then, in one differentiable uneven `all_to_all_single`, the
   hidden rows with their K gate weights and K local expert ids as extra columns (the ids whenever
   they are exact in the hidden dtype: up to 256 experts per device in bf16; otherwise, and for
   weights of another dtype, a separate exchange). Gradients of the gate weights thus come back to
   the router through the reverse exchange;
3. `local_experts_forward`: runs its E/D local experts on the received rows, applies the gate weights
   there and sums the outputs of each row's local experts (one row per (token, device));
4. `combine`: the reverse exchange brings one row per (token, device) home; rows of one token are
   summed over devices.

Rows sent (and returned) per token = C_T, the number of distinct devices of its experts, against K
for per-expert dispatch; `DispatchLayout.rows_sent` counts them. The result equals the unsharded layer
(`reference_moe`) to float rounding, in outputs and in all gradients. Every rank must call the layer
(all ranks of the group, same number of MoE layers, same order), also when it has no tokens.

Collectives per layer: forward 1 (counts) + 1 (rows, weights and ids; +1 for ids that are not exact
in the hidden dtype, +1 if the gate weights' dtype differs from it) + 1 (combine), as many as a
per-expert all-to-all; backward 1 (rows) + 1 (combine), both reusing the forward's split sizes.

Shape legend:
    T  tokens on this rank    K  experts per token    H  hidden size    E  experts    D  devices
    S  rows this rank sends   R  rows this rank receives (from all ranks, grouped by source rank)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_to_all_rows, exchange_counts, exchange_rows, group_size_and_rank
from .layout import DispatchLayout, compute_layout
from .local import local_experts_forward, num_local_experts

__all__ = ["ReceivedRows", "dispatch", "combine", "dedup_moe_forward"]


@dataclass(frozen=True, eq=False)
class ReceivedRows:
    """Immutable handle returned by `dispatch` and consumed by `combine` (and their backward passes).

    Attributes:
        layout: this rank's `DispatchLayout` (what it sent).
        recv_splits: rows received from each rank, rank order (Python ints; sum R).
        recv_local_ids_RK: (R, K) int64 local expert id per received row and slot, `LOCAL_SENTINEL`
            (-1) for slots whose expert lives on another device.
    """

    layout: DispatchLayout
    recv_splits: tuple[int, ...]
    recv_local_ids_RK: torch.Tensor

    @property
    def rows_received(self) -> int:
        return sum(self.recv_splits)


def dispatch(
    hidden_TH: torch.Tensor, layout: DispatchLayout, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, ReceivedRows]:
    """Send each (token, device) row of `layout` to its device.

    Args:
        hidden_TH: (T, H) this rank's tokens.
        layout: from `compute_layout` on the same tokens.
        group: the expert-parallel process group (None: the default group, or no communication when
            torch.distributed is not initialised).

    Returns:
        recv_x_RH: (R, H) received rows, grouped by source rank (differentiable).
        recv_weights_RK: (R, K) their gate weights, 0 at sentinel slots (differentiable).
        received: the `ReceivedRows` handle for `combine`.
    """
    if hidden_TH.shape[0] != layout.num_tokens:
        raise ValueError(
            f"hidden has {hidden_TH.shape[0]} tokens; the layout was built for {layout.num_tokens}"
        )
    send_x_SH = hidden_TH[layout.send_token_idx_S]
    recv_splits = exchange_counts(layout.send_counts_D, group)
    if layout.experts_per_device <= _largest_exact_integer(send_x_SH.dtype):
        # local ids -1..P-1 are exact in the hidden dtype: they ride as extra columns of the row
        # exchange (no gradient, so the backward exchange leaves them out) and save a collective
        recv_x_RH, recv_weights_RK, recv_ids_RK = all_to_all_rows(
            [send_x_SH, layout.send_weights_SK, layout.send_local_ids_SK.to(send_x_SH.dtype)],
            layout.send_splits,
            recv_splits,
            group,
        )
        recv_local_ids_RK = recv_ids_RK.round().long()
    else:
        (recv_local_ids_RK,) = exchange_rows(
            [layout.send_local_ids_SK], layout.send_splits, recv_splits, group
        )
        recv_x_RH, recv_weights_RK = all_to_all_rows(
            [send_x_SH, layout.send_weights_SK], layout.send_splits, recv_splits, group
        )
    return recv_x_RH, recv_weights_RK, ReceivedRows(layout, recv_splits, recv_local_ids_RK)


def _largest_exact_integer(dtype: torch.dtype) -> int:
    """Largest n such that every integer in [-n, n] is exact in `dtype` (0 for non-float dtypes)."""
    if not dtype.is_floating_point:
        return 0
    mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))
    return 2 ** (mantissa_bits + 1)


def combine(
    out_RH: torch.Tensor,
    received: ReceivedRows,
    group: dist.ProcessGroup | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Return each received row to the rank it came from and sum a token's rows over devices.

    Args:
        out_RH: (R, H) per received row, the weighted sum of its local experts' outputs.
        received: the handle `dispatch` returned.
        group: the same group as `dispatch`.
        out_dtype: dtype of the result (default: out_RH's).

    Returns:
        (T, H): for each of this rank's tokens, the sum over the devices it reached. The sum over
        devices is accumulated in at least fp32.
    """
    layout = received.layout
    (back_SH,) = all_to_all_rows([out_RH], received.recv_splits, layout.send_splits, group)
    acc_dtype = torch.promote_types(back_SH.dtype, torch.float32)
    out_TH = back_SH.new_zeros(layout.num_tokens, back_SH.shape[-1], dtype=acc_dtype)
    out_TH = out_TH.index_add(0, layout.send_token_idx_S, back_SH.to(acc_dtype))
    return out_TH.to(out_dtype or out_RH.dtype)


def dedup_moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    local_experts_module: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int | None = None,
    backend: str = "auto",
    return_layout: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, DispatchLayout]:
    """One expert-parallel MoE layer with de-duplicated all-to-all.

    Args:
        hidden_TH: (T, H) this rank's tokens (T may be 0).
        topk_ids_TK: (T, K) int *global* expert ids in [0, E).
        weights_TK: (T, K) gate weights (the router's output; receives gradients).
        local_experts_module: a transformers fused experts module holding this rank's P = E / D
            contiguous experts [rank * P, (rank + 1) * P) (see `shard_experts`).
        group: expert-parallel group of D ranks (None: default group, or D = 1 without
            torch.distributed).
        num_experts: E, to cross-check against P * D (default: P * D).
        backend: grouped matmul backend of the local compute ("auto", "grouped_mm", "loop").
        return_layout: also return the `DispatchLayout` (rows_sent, send_counts_D, ...).

    Returns:
        out_TH: (T, H) in hidden_TH.dtype, equal to the unsharded layer on this rank's tokens;
        and the layout if `return_layout`.
    """
    if hidden_TH.dim() != 2:
        raise ValueError(f"hidden_TH must be (T, H), got shape {tuple(hidden_TH.shape)}")
    num_devices, rank = group_size_and_rank(group)
    per_device = num_local_experts(local_experts_module)
    if num_experts is not None and num_experts != per_device * num_devices:
        raise ValueError(
            f"num_experts={num_experts} but the module holds {per_device} experts on each of "
            f"{num_devices} devices ({per_device * num_devices}); shard with shard_experts(model, group)"
        )
    layout = compute_layout(topk_ids_TK, weights_TK, per_device * num_devices, num_devices, rank)
    recv_x_RH, recv_weights_RK, received = dispatch(hidden_TH, layout, group)
    out_RH = local_experts_forward(
        recv_x_RH, received.recv_local_ids_RK, recv_weights_RK, local_experts_module, backend
    )
    out_TH = combine(out_RH, received, group, out_dtype=hidden_TH.dtype)
    return (out_TH, layout) if return_layout else out_TH
