"""The dispatch layout: which rows a rank sends where, built once per forward, reused by backward.

The de-duplication rule (Occult, and DeepEP's `is_token_in_rank`): **a token is sent once per device
however many of its experts live there.** The receiving device fans that one copy out to the local
experts the token selected, applies the gate weights, and sums them, so one row also comes back. Rows
sent per token = number of distinct devices hosting its top-k experts = the paper's C_T
(`occult_ft.metrics.devices_per_token`), against K rows for per-expert dispatch (`per_expert_plan`,
one row per (token, expert), kept for side-by-side measurement).

Experts are contiguous per device (`occult_ft.layout.ExpertLayout`): with P = E / D experts per device,
expert e lives on device e // P and is local expert e - d * P there.

Worked example (E=4, D=2, so P=2; T=3 tokens, K=2):

    topk_ids_TK = [[0, 1], [1, 2], [3, 2]]      weights_TK = [[.6, .4], [.7, .3], [.5, .5]]
    devices     = [[0, 0], [0, 1], [1, 1]]      token 0 -> {0}, token 1 -> {0, 1}, token 2 -> {1}
    send order (device-major, tokens ascending):   row:  0      1      2      3
        send_token_idx_S  = [0, 1, 1, 2]
        send_device_S     = [0, 0, 1, 1]             send_counts_D = [2, 2]; rows_sent = 4 (naive: 6)
        send_local_ids_SK = [[0, 1], [1, -1], [-1, 0], [1, 0]]
        send_weights_SK   = [[.6, .4], [.7, 0], [0, .3], [.5, .5]]

Slots keep their position k (as DeepEP's `recv_topk_idx` does): slot k of a row is slot k of its
token, and slots whose expert lives on another device hold the sentinel id -1 and weight 0.

Building a layout is split in two so that a layer needs **one host synchronisation**:

1. `RowPlan` (`dedup_plan`, `per_expert_plan`): everything that needs no sizes, on the device: which
   (token, device) pairs exist, the rows and (row, slot) pairs per destination expert, a count of
   out-of-range ids. Its `meta_DC` is what the count exchange sends;
2. `layout_from_plan`: once the send counts are Python ints (read together with the received counts
   in the layer's one `.tolist()`), the index tensors are built by scatter into buffers of known size.

`compute_layout` does both for one rank alone (one `.tolist()`); `capacity_layout` builds the padded
layout of the capacity-bounded mode, which needs no sizes from the device at all.

Shape legend:
    T  tokens on this rank     K  experts per token     E  experts     D  devices (expert-parallel size)
    P  experts per device (E / D)   S  rows this rank sends   J  slots per row (K, or 1 per expert)
    C  columns of the count metadata per destination (1 + P + 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import ExpertLayout

__all__ = [
    "LOCAL_SENTINEL",
    "DispatchLayout",
    "RowPlan",
    "dedup_plan",
    "per_expert_plan",
    "layout_from_plan",
    "capacity_layout",
    "compute_layout",
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
        num_tokens: T, tokens on this rank (may be 0).
        top_k: K.
        num_experts: E, experts of the layer over all devices.
        num_devices: D.
        rank: this rank's device index in [0, D); its own rows (`rows_kept_local`) need no network.
        experts_per_device: P = E / D; expert e lives on device e // P as local expert e % P.
        send_token_idx_S: (S,) int64, token index (into this rank's T tokens) of each sent row. Rows
            are grouped by destination device in ascending order, tokens ascending within a device,
            so the first send_splits[0] rows go to device 0, and so on. In a padded (capacity) layout,
            pad rows hold the sentinel T (a zero row on the way out, dropped on the way back).
        send_device_S: (S,) int64, destination device of each row, non-decreasing.
        send_counts_D: (D,) int64, rows sent to each device (real rows; pads excluded).
        send_splits: rows of each destination block as Python ints (split sizes for
            `all_to_all_single`; in a padded layout every block is `capacity` rows).
        send_local_ids_SK: (S, J) int64, for each row and slot, the local id (in [0, P)) on the
            destination device of the slot's expert, or `LOCAL_SENTINEL` (-1) where that expert lives on
            another device (or the row is a pad). J = K (dedup) or 1 (per expert). Every real row has at
            least one non-sentinel slot.
        send_weights_SK: (S, J), dtype of the gate weights: the weight at non-sentinel slots, exactly
            0 at sentinel slots. Built by differentiable gather/where from the weights, so it carries
            the router's autograd graph.
        rows_sent: real rows sent = sum of send_counts_D (dedup: sum over tokens of C_T).
        kind: "dedup" or "per_expert".
        capacity: rows per destination of a padded (capacity-bounded) layout; None when exact.
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
    """The size-free half of a layout (device tensors only; see the module docstring).

    Attributes:
        layout: the experts' `ExpertLayout` over the D destinations.
        rank: this rank's index among them.
        kind: "dedup" or "per_expert".
        num_tokens / top_k: T and K of the routing.
        slot_device_TK: (T, K) int64 destination of every slot; D (a spare column) for slots that go
            nowhere (sentinel ids of a fan-out stage).
        slot_local_TK: (T, K) int64 local expert id of every slot on its destination.
        weights_TK: (T, K) the gate weights (graph kept).
        present_DT: (D, T) bool, dedup only: token t has a slot on device d.
        order_N: (T * K,) int64, per_expert only: (token, slot) pairs sorted by destination expert.
        meta_DC: (D, C) int64 what destination d must learn: [rows, pairs of each of its P experts,
            out-of-range ids on this rank]; C = P + 2.
        topk_ids_TK: the ids planned (for the error message when some are out of range).
        sentinel_in: whether -1 ids were allowed (a fan-out stage).
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


def _meta(
    layout: ExpertLayout, rows_D: torch.Tensor, pairs_E: torch.Tensor, bad: torch.Tensor
) -> torch.Tensor:
    """(D, P + 2) int64: [rows to d, (row, slot) pairs for each of d's P experts, bad ids here]."""
    d, p = layout.num_devices, layout.experts_per_device
    bad_D1 = bad.reshape(1, 1).expand(d, 1)
    return torch.cat([rows_D.reshape(d, 1), pairs_E.reshape(d, p), bad_D1], dim=1).long()


def _slots(topk_ids_TK: torch.Tensor, layout: ExpertLayout, sentinel_in: bool):
    """(slot_device_TK, slot_local_TK, valid_TK, bad): invalid slots go to the spare destination D.

    `bad` counts ids outside [0, E) (and, with `sentinel_in`, other than -1): a (0-dim) device tensor,
    read with the layer's counts, never on its own.
    """
    ids_TK = topk_ids_TK.long()
    e, p = layout.num_experts, layout.experts_per_device
    valid_TK = (ids_TK >= 0) & (ids_TK < e)
    if sentinel_in:  # the rows a two-stage gateway fans out: -1 marks a slot for another node
        bad = ((ids_TK < LOCAL_SENTINEL) | (ids_TK >= e)).sum()
    else:
        bad = (~valid_TK).sum()
    safe_TK = torch.where(valid_TK, ids_TK, 0)
    device_TK = torch.where(valid_TK, safe_TK // p, layout.num_devices)
    return device_TK, safe_TK % p, valid_TK, bad


def _pairs_per_expert(device_TK, local_TK, valid_TK, layout: ExpertLayout) -> torch.Tensor:
    """(E,) int64 valid (token, slot) pairs per expert (global expert index d * P + local)."""
    flat_N = torch.where(valid_TK, device_TK * layout.experts_per_device + local_TK, 0).reshape(-1)
    pairs_E = torch.zeros(layout.num_experts, dtype=torch.long, device=flat_N.device)
    return pairs_E.scatter_add_(0, flat_N, valid_TK.reshape(-1).long())


def dedup_plan(
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    layout: ExpertLayout,
    rank: int,
    sentinel_in: bool = False,
) -> RowPlan:
    """The size-free half of the de-duplicated layout (no host synchronisation).

    Args:
        topk_ids_TK: (T, K) int expert ids in [0, E); with `sentinel_in` also -1, a slot that goes
            nowhere (the rows a two-stage gateway fans out).
        weights_TK: (T, K) gate weights.
        layout: the destinations' `ExpertLayout`. rank: this rank's index in [0, D).
    """
    check_routing(topk_ids_TK, weights_TK)
    layout.check_rank(rank)
    t, d = topk_ids_TK.shape[0], layout.num_devices
    device_TK, local_TK, valid_TK, bad = _slots(topk_ids_TK, layout, sentinel_in)
    present_TD = torch.zeros(t, d + 1, dtype=torch.bool, device=device_TK.device)
    present_TD.scatter_(1, device_TK, True)
    present_DT = present_TD[:, :d].t()
    pairs_E = _pairs_per_expert(device_TK, local_TK, valid_TK, layout)
    meta_DC = _meta(layout, present_DT.sum(dim=1), pairs_E, bad)
    return RowPlan(
        layout,
        rank,
        "dedup",
        t,
        topk_ids_TK.shape[1],
        device_TK,
        local_TK,
        weights_TK,
        present_DT,
        None,
        meta_DC,
        topk_ids_TK,
        sentinel_in,
    )


def per_expert_plan(
    topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor, layout: ExpertLayout, rank: int
) -> RowPlan:
    """The size-free half of the per-expert layout: one row per (token, expert), rows sorted by expert
    (what transformers' native EP, DeepSpeed AutoEP, Tutel and MegaBlocks send)."""
    check_routing(topk_ids_TK, weights_TK)
    layout.check_rank(rank)
    t, k = topk_ids_TK.shape
    device_TK, local_TK, valid_TK, bad = _slots(topk_ids_TK, layout, False)
    flat_N = torch.where(valid_TK, device_TK * layout.experts_per_device + local_TK, layout.num_experts)
    order_N = torch.argsort(flat_N.reshape(-1), stable=True)  # by expert; pairs ascending within one
    pairs_E = _pairs_per_expert(device_TK, local_TK, valid_TK, layout)
    rows_D = pairs_E.view(layout.num_devices, -1).sum(dim=1)
    meta_DC = _meta(layout, rows_D, pairs_E, bad)
    return RowPlan(
        layout, rank, "per_expert", t, k, device_TK, local_TK, weights_TK, None, order_N, meta_DC, topk_ids_TK
    )


def layout_from_plan(plan: RowPlan, send_splits: tuple[int, ...]) -> DispatchLayout:
    """The exact layout once the rows per destination are Python ints (no host synchronisation).

    Args:
        plan: from `dedup_plan` / `per_expert_plan`.
        send_splits: rows to each destination (`plan.meta_DC[:, 0]`, read on the host).
    """
    layout, t, k = plan.layout, plan.num_tokens, plan.top_k
    d, p = layout.num_devices, layout.experts_per_device
    num_rows = sum(send_splits)
    if plan.kind == "dedup":
        assert plan.present_DT is not None  # a dedup plan has it
        flat_X = plan.present_DT.reshape(-1)  # (D * T): device-major, tokens ascending = the send order
        pairs_S = torch.argsort((~flat_X).to(torch.int8), stable=True)[:num_rows]
        send_device_S, send_token_S = pairs_S // max(t, 1), pairs_S % max(t, 1)
        local_SK = plan.slot_device_TK[send_token_S] == send_device_S[:, None]
        send_local_ids_SK = torch.where(local_SK, plan.slot_local_TK[send_token_S], LOCAL_SENTINEL)
        gathered_SK = plan.weights_TK[send_token_S]
        send_weights_SK = torch.where(local_SK, gathered_SK, torch.zeros_like(gathered_SK))
    else:
        assert plan.order_N is not None  # a per-expert plan has it
        pair_S = plan.order_N[:num_rows]
        send_token_S = pair_S // k
        send_device_S = plan.slot_device_TK.reshape(-1)[pair_S]
        send_local_ids_SK = plan.slot_local_TK.reshape(-1)[pair_S].unsqueeze(1)
        send_weights_SK = plan.weights_TK.reshape(-1)[pair_S].unsqueeze(1)
    return DispatchLayout(
        num_tokens=t,
        top_k=k,
        num_experts=layout.num_experts,
        num_devices=d,
        rank=plan.rank,
        experts_per_device=p,
        send_token_idx_S=send_token_S,
        send_device_S=send_device_S,
        send_counts_D=plan.meta_DC[:, 0],
        send_splits=tuple(send_splits),
        send_local_ids_SK=send_local_ids_SK,
        send_weights_SK=send_weights_SK,
        rows_sent=num_rows,
        kind=plan.kind,
    )


def capacity_layout(plan: RowPlan, capacity: int) -> DispatchLayout:
    """The padded layout of the capacity-bounded mode: `capacity` rows to every destination, no sizes
    read from the device.

    Rows for device d fill block [d * capacity, (d + 1) * capacity) in token order; the rest of the
    block are pad rows (token index T, every slot the sentinel, weight 0). A token is sent at most once
    per device, so `capacity >= T` can never overflow: callers check that on the host (T is a shape)
    before calling, which is why no row can be lost.

    Args:
        plan: a `dedup_plan` (the per-expert layout has no such bound below T * K).
        capacity: rows per destination, at least T.
    """
    if plan.kind != "dedup":
        raise ValueError("the capacity-bounded layout is for the de-duplicated exchange (kind='dedup')")
    t, k, layout = plan.num_tokens, plan.top_k, plan.layout
    if capacity < t:
        raise ValueError(
            f"exchange capacity {capacity} rows per device is below this rank's {t} tokens: rows could be "
            f"lost; raise the capacity to at least {t} (tokens per rank per forward)"
        )
    d, dev = layout.num_devices, plan.slot_device_TK.device
    assert plan.present_DT is not None  # a dedup plan has it
    pos_DT = plan.present_DT.long().cumsum(dim=1) - 1
    slot_DT = torch.arange(d, device=dev)[:, None] * capacity + pos_DT
    target_X = torch.where(plan.present_DT, slot_DT, d * capacity).reshape(-1)
    token_X = torch.arange(t, device=dev).expand(d, t).reshape(-1)
    # every non-present pair writes the same value T into the spare slot: the result is deterministic
    token_S = torch.full((d * capacity + 1,), t, dtype=torch.long, device=dev)
    token_S = token_S.scatter_(0, target_X, torch.where(plan.present_DT.reshape(-1), token_X, t))[:-1]
    send_device_S = torch.arange(d, device=dev).repeat_interleave(capacity)
    pad_S = token_S == t
    device_TK = torch.cat([plan.slot_device_TK, plan.slot_device_TK.new_full((1, k), d)])
    local_TK = torch.cat([plan.slot_local_TK, plan.slot_local_TK.new_zeros(1, k)])
    weights_TK = torch.cat([plan.weights_TK, plan.weights_TK.new_zeros(1, k)])
    local_SK = (device_TK[token_S] == send_device_S[:, None]) & ~pad_S[:, None]
    gathered_SK = weights_TK[token_S]
    return DispatchLayout(
        num_tokens=t,
        top_k=k,
        num_experts=layout.num_experts,
        num_devices=d,
        rank=plan.rank,
        experts_per_device=layout.experts_per_device,
        send_token_idx_S=token_S,
        send_device_S=send_device_S,
        send_counts_D=plan.meta_DC[:, 0],
        send_splits=(capacity,) * d,
        send_local_ids_SK=torch.where(local_SK, local_TK[token_S], LOCAL_SENTINEL),
        send_weights_SK=torch.where(local_SK, gathered_SK, torch.zeros_like(gathered_SK)),
        rows_sent=-1,
        kind="dedup",
        capacity=capacity,
    )


def raise_bad_ids(topk_ids_TK: torch.Tensor, num_experts: int, sentinel_in: bool = False) -> None:
    """The one-line error for ids outside [0, E) on this rank (only called once a count says so)."""
    ids = topk_ids_TK.long()
    low = LOCAL_SENTINEL if sentinel_in else 0
    bad = ids[(ids < low) | (ids >= num_experts)].unique()[:8].tolist()
    raise ValueError(f"topk_ids hold expert ids {bad} outside [0, num_experts={num_experts})")


def compute_layout(
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    rank: int,
) -> DispatchLayout:
    """Build the de-duplicated `DispatchLayout` of one rank's tokens (pure, local: no communication).

    One host synchronisation (the send counts and the range check, read together). Inside a layer the
    exchanges fold this read into the count exchange (`FlatExchange`), so the layer still needs one.

    Args:
        topk_ids_TK: (T, K) int expert ids in [0, E) (T may be 0).
        weights_TK: (T, K) float gate weights; gradients flow back to them through `send_weights_SK`.
        num_experts: E; num_devices: D, dividing E; rank: this rank's device index in [0, D).

    Returns:
        The layout handle (see `DispatchLayout` for every field's shape, dtype and sentinel).

    Raises:
        ValueError: for D not dividing E, a rank out of range, mismatched shapes, non-integer ids
            or ids outside [0, E); the message quotes the offending values.
    """
    plan = dedup_plan(topk_ids_TK, weights_TK, ExpertLayout(num_experts, num_devices), rank)
    counts = plan.meta_DC[:, [0, -1]].tolist()  # the one host synchronisation
    if counts[0][1]:
        raise_bad_ids(topk_ids_TK, num_experts)
    return layout_from_plan(plan, tuple(int(c[0]) for c in counts))
