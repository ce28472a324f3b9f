"""Row plans: which rows a rank sends where, built once per forward and reused by backward.

    DispatchLayout   the frozen handle: rows per destination, their tokens, slots and weights
    RowPlan          its size-free half, planned on the device (`row_plan`)
    layout_from_plan the exact layout once the send counts are host ints (after the count exchange)
    capacity_layout  the padded layout of the capacity-bounded mode (no host read at all)

Worked example (E=4, D=2, so P=2; T=3 tokens, K=2), the de-duplicated plan:

    topk_ids_TK = [[0, 1], [1, 2], [3, 2]]      weights_TK = [[.6, .4], [.7, .3], [.5, .5]]
    devices     = [[0, 0], [0, 1], [1, 1]]      token 0 -> {0}, token 1 -> {0, 1}, token 2 -> {1}
    send_token_idx_S  = [0, 1, 1, 2]            send_device_S = [0, 0, 1, 1]   (naive: 6 rows)
    send_local_ids_SK = [[0, 1], [1, -1], [-1, 0], [1, 0]]
    send_weights_SK   = [[.6, .4], [.7, 0], [0, .3], [.5, .5]]

Shape legend:
    T  tokens on this rank     K  experts per token     E  experts     D  devices (expert-parallel size)
    P  experts per device (E / D)   S  rows this rank sends   J  slots per row (K, or 1 per expert)
    C  columns of the count metadata per destination (1 + P + 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import choice_error
from ..layout import ExpertLayout

__all__ = [
    "LOCAL_SENTINEL",
    "DispatchLayout",
    "RowPlan",
    "row_plan",
    "layout_from_plan",
    "capacity_layout",
    "check_routing",
    "raise_bad_ids",
]

LOCAL_SENTINEL = -1
"""Local expert id of a slot whose expert lives on another device (its weight is 0 there)."""


@dataclass(frozen=True, eq=False)
class DispatchLayout:
    """Immutable handle: where each of this rank's tokens goes, for dispatch, combine and their backward.

    **A token is sent once per device however many of its experts live there** (`kind="dedup"`); the
    per-expert layout (`kind="per_expert"`) sends one row per (token, expert) instead.

    Attributes:
        num_tokens, top_k, num_experts, num_devices: T, K, E, D. rank: this rank's device in [0, D).
        experts_per_device: P = E / D; expert e lives on device e // P as local expert e % P.
        send_token_idx_S: (S,) int64 token (into this rank's T) of each sent row, grouped by destination
            in ascending order, tokens ascending within one; a padded (capacity) layout's pad rows hold T.
        send_device_S: (S,) int64, destination device of each row, non-decreasing.
        send_counts_D: (D,) int64, rows sent to each device (real rows; pads excluded).
        send_splits: rows of each destination block as Python ints (the `all_to_all_single` split sizes;
            every block is `capacity` rows in a padded layout).
        send_local_ids_SK: (S, J) int64 local id (in [0, P)) of each slot's expert on the row's
            destination, or `LOCAL_SENTINEL` (-1) where it lives elsewhere (or the row is a pad).
        send_weights_SK: (S, J) gate weights, exactly 0 at sentinel slots (the router's graph kept).
        rows_sent: real rows sent = sum of send_counts_D (dedup: sum over tokens of C_T).
        kind: "dedup" or "per_expert". capacity: rows per destination when padded; None when exact.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    num_devices: int
    rank: int
    experts_per_device: int
    send_token_idx_S: torch.Tensor
    send_device_S: torch.Tensor
    send_counts_D: torch.Tensor
    send_splits: tuple[int, ...]
    send_local_ids_SK: torch.Tensor
    send_weights_SK: torch.Tensor
    rows_sent: int
    kind: str = "dedup"
    capacity: int | None = None

    @property
    def naive_rows(self) -> int:
        """Rows a per-(token, expert) dispatch would send: T * K."""
        return self.num_tokens * self.top_k

    @property
    def comm_complexity(self) -> float:
        """Mean rows per token: rows_sent / T (C_T for dedup; 0.0 without tokens)."""
        return self.rows_sent / self.num_tokens if self.num_tokens else 0.0

    @property
    def rows_kept_local(self) -> int:
        """Rows whose destination is this rank itself (no network traffic)."""
        return self.send_splits[self.rank]

    @property
    def padded(self) -> bool:
        return self.capacity is not None


@dataclass(frozen=True, eq=False)
class RowPlan:
    """The size-free half of a layout: device tensors only, so planning needs no host read.

    Attributes:
        layout: the destinations' `ExpertLayout`. rank: this rank's index. kind: "dedup" or "per_expert".
        slot_device_TK / slot_local_TK: (T, K) int64 destination and local expert id of every slot;
            destination D (a spare column) for slots that go nowhere (a fan-out stage's sentinels).
        present_DT: (D, T) bool, dedup only: token t has a slot on device d.
        order_N: (T * K,) int64, per_expert only: (token, slot) pairs sorted by destination expert.
        meta_DC: (D, P + 2) int64, what destination d learns: [rows, pairs per each of its P experts,
            out-of-range ids here]. topk_ids_TK / sentinel_in: the planned ids, for the bad-id error.
    """

    layout: ExpertLayout
    rank: int
    kind: str
    num_tokens: int
    top_k: int
    slot_device_TK: torch.Tensor
    slot_local_TK: torch.Tensor
    weights_TK: torch.Tensor
    present_DT: torch.Tensor | None
    order_N: torch.Tensor | None
    meta_DC: torch.Tensor
    topk_ids_TK: torch.Tensor
    sentinel_in: bool = False


def check_routing(topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> None:
    """Host-side checks (no device sync): (T, K) integer ids and (T, K) weights."""
    if topk_ids_TK.dim() != 2 or weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids_TK.shape)} and weights {tuple(weights_TK.shape)} must both be (T, K)"
        )
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got dtype {topk_ids_TK.dtype}")


def raise_bad_ids(topk_ids_TK: torch.Tensor, num_experts: int, sentinel_in: bool = False) -> None:
    """The one-line error for ids outside [0, E) on this rank (only called once a count says so)."""
    ids = topk_ids_TK.long()
    low = LOCAL_SENTINEL if sentinel_in else 0
    bad = ids[(ids < low) | (ids >= num_experts)].unique()[:8].tolist()
    raise ValueError(f"topk_ids hold expert ids {bad} outside [0, num_experts={num_experts})")


def row_plan(
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    layout: ExpertLayout,
    rank: int,
    kind: str = "dedup",
    sentinel_in: bool = False,
) -> RowPlan:
    """The size-free half of a layout (no host synchronisation): `kind="dedup"`, one row per (token,
    device), or "per_expert", one row per (token, expert) sorted by expert (what transformers' native EP,
    DeepSpeed AutoEP, Tutel and MegaBlocks send). `topk_ids_TK` (T, K) holds ids in [0, E), and with
    `sentinel_in` also -1: a slot that goes nowhere (the rows a two-stage gateway fans out)."""
    check_routing(topk_ids_TK, weights_TK)
    layout.check_rank(rank)
    if kind not in ("dedup", "per_expert"):
        raise choice_error("kind", kind, ("dedup", "per_expert"))
    (t, k), ids_TK = topk_ids_TK.shape, topk_ids_TK.long()
    e, p, d = layout.num_experts, layout.experts_per_device, layout.num_devices
    # valid: a real expert id; -1 (a fan-out stage's "served elsewhere") and out-of-range ids are not
    valid_TK = (ids_TK >= 0) & (ids_TK < e)
    # `bad` stays a 0-dim device tensor: it rides in the count exchange and is read with the counts.
    # A fan-out stage (sentinel_in) receives -1 for slots served on another node: those are not bad.
    bad = ((ids_TK < (LOCAL_SENTINEL if sentinel_in else 0)) | (ids_TK >= e)).sum()
    # Contiguous experts: expert e lives on device e // P as local expert e % P. Invalid slots are
    # mapped to expert 0 for the arithmetic, then sent to the spare destination D (dropped later).
    safe_TK = torch.where(valid_TK, ids_TK, 0)
    device_TK, local_TK = torch.where(valid_TK, safe_TK // p, d), safe_TK % p
    # Pairs per expert by scatter_add (bincount's output size depends on data: a host read on GPU).
    # Invalid slots add 0 to bin 0, so they count nowhere.
    pairs_E = torch.zeros(e, dtype=torch.long, device=ids_TK.device)
    pairs_E.scatter_add_(0, safe_TK.reshape(-1), valid_TK.reshape(-1).long())
    present_DT: torch.Tensor | None = None
    order_N: torch.Tensor | None = None
    if kind == "dedup":
        # present[t, d]: token t has at least one slot on device d. Scatter into D + 1 columns so the
        # spare column D absorbs the slots that go nowhere, then drop it. One row per True = C_T per token.
        present_TD = torch.zeros(t, d + 1, dtype=torch.bool, device=ids_TK.device)
        present_TD.scatter_(1, device_TK, True)
        # (T, D) -> (D, T): destination-major, the order rows are sent in (device 0's tokens first)
        present_DT = present_TD[:, :d].t()
        rows_D = present_DT.sum(dim=1)  # rows to d = tokens with a slot there (summed over d: sum of C_T)
    else:
        # Global expert of each (token, slot) pair, E for invalid ones so that they sort last and are cut.
        # A stable sort keeps pairs of one expert in (token, slot) order: rows are expert-major, hence
        # device-major, which is the block order all_to_all_single expects.
        order_N = torch.argsort(torch.where(valid_TK, safe_TK, e).reshape(-1), stable=True)
        rows_D = pairs_E.view(d, p).sum(dim=1)  # one row per pair: rows = pairs of d's P experts
    # meta_DC[d] = [rows to d, pairs for each of d's P experts, bad ids here]: pairs_E is expert-major and
    # experts are contiguous per device, so (E,) -> (D, P) is a view; `bad` repeats so every d learns it.
    meta_DC = torch.cat([rows_D[:, None], pairs_E.view(d, p), bad.expand(d, 1)], dim=1).long()
    return RowPlan(
        layout, rank, kind, t, k, device_TK, local_TK, weights_TK, present_DT, order_N, meta_DC, topk_ids_TK,
        sentinel_in,
    )  # fmt: skip


def _layout(plan: RowPlan, token_S, device_S, ids_SJ, weights_SJ, splits, rows_sent, capacity=None):
    e, d, p = plan.layout.num_experts, plan.layout.num_devices, plan.layout.experts_per_device
    # send_counts_D stays the device tensor of the plan (column 0 of the count table): no host read
    return DispatchLayout(
        plan.num_tokens, plan.top_k, e, d, plan.rank, p, token_S, device_S, plan.meta_DC[:, 0], tuple(splits),
        ids_SJ, weights_SJ, rows_sent, plan.kind, capacity,
    )  # fmt: skip


def _dedup_slots(device_TK, local_TK, weights_TK, token_S, device_S):
    """(ids_SK, weights_SK) of rows (token, destination): each row keeps all K slots in place (slot k of a
    row is slot k of its token, as DeepEP's `recv_topk_idx`); slots served elsewhere become the
    sentinel with weight exactly 0 (`where`, not a product, so the router's gradient there is 0)."""
    # here_SK[s, k]: slot k of row s's token is served on the row's destination device
    here_SK = device_TK[token_S] == device_S[:, None]
    ids_SK = torch.where(here_SK, local_TK[token_S], LOCAL_SENTINEL)
    gathered_SK = weights_TK[token_S]
    return ids_SK, torch.where(here_SK, gathered_SK, torch.zeros_like(gathered_SK))


def layout_from_plan(plan: RowPlan, send_splits: tuple[int, ...]) -> DispatchLayout:
    """The exact layout once the rows per destination (`plan.meta_DC[:, 0]`) are host ints (no sync)."""
    t, k, num_rows = plan.num_tokens, plan.top_k, sum(send_splits)
    if plan.present_DT is not None:  # dedup
        # Flattening (D, T) device-major enumerates (device, token) pairs in send order. A stable sort
        # of "not present" moves the present pairs to the front in that order; their count is known
        # (num_rows), so the slice has a fixed size and nothing is read back (unlike nonzero()).
        pairs_S = torch.argsort((~plan.present_DT.reshape(-1)).to(torch.int8), stable=True)[:num_rows]
        # pair index x = d * T + t; max(t, 1) keeps the division defined when T = 0 (then S = 0 too)
        device_S, token_S = pairs_S // max(t, 1), pairs_S % max(t, 1)
        ids_SJ, weights_SJ = _dedup_slots(
            plan.slot_device_TK, plan.slot_local_TK, plan.weights_TK, token_S, device_S
        )
    else:
        assert plan.order_N is not None  # a per-expert plan has it
        # The first num_rows pairs of the expert-sorted order are the valid ones; pair n = t * K + k,
        # so the token is n // K; its destination was planned per slot.
        pair_S = plan.order_N[:num_rows]
        token_S, device_S = pair_S // k, plan.slot_device_TK.reshape(-1)[pair_S]
        ids_SJ = plan.slot_local_TK.reshape(-1)[pair_S].unsqueeze(1)  # J = 1: one slot per row
        weights_SJ = plan.weights_TK.reshape(-1)[pair_S].unsqueeze(1)
    return _layout(plan, token_S, device_S, ids_SJ, weights_SJ, send_splits, num_rows)


def capacity_layout(plan: RowPlan, capacity: int) -> DispatchLayout:
    """The padded layout of the capacity-bounded mode: `capacity` rows to every destination, no sizes
    read from the device. Rows for device d fill block [d * capacity, (d + 1) * capacity) in token order;
    the rest are pad rows (token index T, every slot the sentinel, weight 0). A token is sent at most once
    per device, so `capacity >= T` can never overflow; that is checked here on the host (T is a shape).
    Only a dedup plan has such a bound (the per-expert rows have none below T * K)."""
    if plan.present_DT is None:
        raise ValueError("the capacity-bounded layout is for the de-duplicated exchange (kind='dedup')")
    t, k, d = plan.num_tokens, plan.top_k, plan.layout.num_devices
    if capacity < t:
        raise ValueError(
            f"exchange capacity {capacity} rows per device is below this rank's {t} tokens: rows could be "
            f"lost; raise the capacity to at least {t} (tokens per rank per forward)"
        )
    # Row c of device d's block: widen (D, T) to (D, C) with absent columns (C >= T), then a stable sort
    # of "absent" per destination puts its present tokens first, in token order; the rest become pads (T).
    present_DC = torch.cat([plan.present_DT, plan.present_DT.new_zeros(d, capacity - t)], dim=1)
    order_DC = torch.argsort((~present_DC).to(torch.int8), dim=1, stable=True)
    token_S = torch.where(present_DC.gather(1, order_DC), order_DC, t).reshape(-1)
    # block d of the buffer is destination d: every row s in [d * C, (d + 1) * C) goes to device d
    device_S = torch.arange(d, device=token_S.device).repeat_interleave(capacity)
    # One extra token row T for the pads: its slots go to the spare device D, so no real destination
    # matches them and they become sentinels with weight 0.
    device_TK = torch.cat([plan.slot_device_TK, plan.slot_device_TK.new_full((1, k), d)])
    local_TK = torch.cat([plan.slot_local_TK, plan.slot_local_TK.new_zeros(1, k)])
    weights_TK = torch.cat([plan.weights_TK, plan.weights_TK.new_zeros(1, k)])
    ids_SK, weights_SK = _dedup_slots(device_TK, local_TK, weights_TK, token_S, device_S)
    return _layout(plan, token_S, device_S, ids_SK, weights_SK, (capacity,) * d, -1, capacity)
