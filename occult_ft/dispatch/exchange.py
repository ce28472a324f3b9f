"""The exchange contract of an expert-parallel MoE layer, and its one-stage exchanges.

    Exchange           dispatch / combine joined by an immutable handle; `pipelinable` capability
    ReceivedRows       the handle of a one-stage dispatch (what this rank sent and received)
    FlatExchange       de-duplicated: one row per (token, device), exact or capacity-bounded
    PerExpertExchange  one row per (token, expert), sorted by expert (for side-by-side measurement)
    moe_forward        dispatch, local experts, combine: one layer through any exchange
    read_counts / send_rows / return_rows   the steps the exchanges (and the pipeline) share

How they work, their host reads and collectives per layer: docs/expert-parallel.md.

Shape legend: T tokens on this rank, K experts per token, H hidden size, E experts, D devices,
P experts per device, S rows sent, R rows received (grouped by source rank), J slots per row (K or 1).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..checks import is_positive_int
from ..layout import ExpertLayout
from .comm import all_to_all_rows, exchange_meta, group_size_and_rank
from .local import local_experts_forward, num_local_experts
from .plan import DispatchLayout, RowPlan, capacity_layout, layout_from_plan, raise_bad_ids, row_plan

__all__ = [
    "Exchange",
    "ReceivedRows",
    "ExchangeHandle",
    "FlatExchange",
    "PerExpertExchange",
    "moe_forward",
    "read_counts",
    "largest_exact_integer",
    "check_hidden",
    "send_rows",
    "return_rows",
]


class ExchangeHandle(Protocol):
    """What the local experts read from a dispatch handle (`ReceivedRows`, `TwoStageHandle`)."""

    @property
    def recv_local_ids_RJ(self) -> torch.Tensor: ...

    @property
    def expert_counts(self) -> tuple[int, ...] | str | None: ...


@dataclass(frozen=True, eq=False)
class ReceivedRows:
    """Immutable handle of a one-stage dispatch, consumed by its combine (and their backward passes):
    this rank's `layout` (what it sent), `recv_splits` (rows from each rank, Python ints, sum R),
    `recv_local_ids_RJ` ((R, J) int64 local expert ids, -1 where the expert lives elsewhere or the row is a
    pad) and `expert_counts` ((P,) received (row, slot) pairs per local expert as Python ints; "device"
    when never read on the host (capacity mode); None when unknown)."""

    layout: DispatchLayout
    recv_splits: tuple[int, ...]
    recv_local_ids_RJ: torch.Tensor
    expert_counts: tuple[int, ...] | str | None = None

    @property
    def rows_sent(self) -> int:
        """Real rows this rank sent (its own included; pads excluded)."""
        return self.layout.rows_sent


class Exchange(ABC):
    """The dispatch / combine contract of one MoE layer's token exchange on this rank: its `name` ("flat",
    "per_expert" or "two_stage"), `layout` (the layer's `ExpertLayout`: E experts on the D ranks of the
    exchange) and `group` (the expert-parallel process group; None: the default group, or none for D = 1)."""

    name: str = ""

    def __init__(self, layout: ExpertLayout, group: dist.ProcessGroup | None = None):
        world, rank = group_size_and_rank(group)
        if world != layout.num_devices:
            raise ValueError(
                f"the process group has {world} ranks but the layout spreads the experts over "
                f"{layout.num_devices} devices; build the exchange for the group that holds the experts"
            )
        self.layout, self.group, self.rank = layout, group, rank

    @abstractmethod
    def dispatch(
        self, hidden_TH: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExchangeHandle]:
        """Send this rank's tokens (`hidden_TH` (T, H); `topk_ids_TK` (T, K) global expert ids in [0, E);
        `weights_TK` (T, K) gate weights, differentiable) to the devices of their experts.

        Returns (recv_x_RH, recv_weights_RJ, handle): (R, H) rows for this rank's experts and (R, J) their
        gate weights, 0 at sentinel slots (both differentiable); the immutable handle holds
        `recv_local_ids_RJ` (R, J) local ids and `expert_counts`."""

    @abstractmethod
    def combine(self, out_RH: torch.Tensor, handle, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Bring each row's result home and sum a token's rows. Returns (T, H) in `out_dtype`
        (default out_RH's), accumulated in at least fp32."""

    @property
    def pipelinable(self) -> bool:
        """Whether `pipelined_moe_forward` can run it in chunks: one stage with exact counts, so that
        `plan` gives each chunk's rows and one count exchange serves all chunks."""
        return False

    def plan(self, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> RowPlan:
        """The size-free row plan of this rank's tokens (exchanges with `pipelinable` only)."""
        raise NotImplementedError(f"the {self.name} exchange has no one-stage row plan")


def check_hidden(hidden_TH: torch.Tensor, topk_ids_TK: torch.Tensor) -> None:
    if hidden_TH.dim() != 2:
        raise ValueError(f"hidden_TH must be (T, H), got shape {tuple(hidden_TH.shape)}")
    if hidden_TH.shape[0] != topk_ids_TK.shape[0]:
        raise ValueError(
            f"hidden has {hidden_TH.shape[0]} tokens but topk_ids has {topk_ids_TK.shape[0]}; they must match"
        )


def read_counts(
    plans: list[RowPlan], recv_meta_DC: torch.Tensor
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The layer's one host synchronisation: per plan, (send splits, recv splits, expert counts), from
    `recv_meta_DC`, the exchanged metadata of all `plans` side by side ((D, n * (P + 2)) for n plans).
    Raises the same one-line ValueError on every rank when any rank saw ids outside [0, E)."""
    experts = plans[0].layout
    # the plans' tables side by side: n plans -> (D, n * C), in the column order they were exchanged
    sent = torch.cat([p.meta_DC for p in plans], dim=1)
    # Both tables are (D, n * C): row d of `sent` is what this rank tells destination d, row d of
    # `recv` what source rank d told us. One .tolist() of both is the layer's only host read.
    sent_rows, recv_rows = torch.stack([sent, recv_meta_DC.reshape(sent.shape)]).tolist()
    width = plans[0].meta_DC.shape[1]  # C = P + 2 columns per plan: [rows, P expert pairs, bad ids]
    sends, recvs, counts = [], [], []
    for c, plan in enumerate(plans):
        rows, bad = c * width, c * width + width - 1  # this plan's first and last column
        # Every rank sees every rank's bad-id count (it rides in each row; its own arrives from itself),
        # so all raise together: the rank that holds the bad ids names them, the others point at it.
        ranks = [j for j, row in enumerate(recv_rows) if row[bad]]
        if ranks:
            if sent_rows[0][bad]:
                raise_bad_ids(plan.topk_ids_TK, experts.num_experts, plan.sentinel_in)
            raise ValueError(
                f"ranks {ranks} routed tokens to expert ids outside [0, num_experts={experts.num_experts}); "
                "see the error on those ranks"
            )
        # column `rows` of row j: rows this rank sends to rank j (sent) / receives from rank j (recv)
        sends.append(tuple(int(row[rows]) for row in sent_rows))
        recvs.append(tuple(int(row[rows]) for row in recv_rows))
        # Pairs for local expert j: column rows + 1 + j of what each source rank sent us, summed.
        counts.append(tuple(int(sum(row[rows + 1 + j] for row in recv_rows)) for j in range(width - 2)))
    return sends, recvs, counts


def largest_exact_integer(dtype: torch.dtype) -> int:
    """Largest n such that every integer in [-n, n] is exact in `dtype` (0 for non-float dtypes)."""
    if not dtype.is_floating_point:
        return 0
    # eps = 2^-m for m stored mantissa bits; with the implicit leading bit every integer up to 2^(m+1)
    # is exact: 256 in bf16 (m = 7), 2048 in fp16, 2^24 in fp32.
    mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))
    return 2 ** (mantissa_bits + 1)


def send_rows(
    hidden_TH: torch.Tensor,
    layout: DispatchLayout,
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row exchange of a dispatch (differentiable): (recv_x_RH, recv_weights_RJ, recv_local_ids_RJ)."""
    if layout.padded:  # pad rows hold token index T: give them a zero row to gather
        hidden_TH = torch.cat([hidden_TH, hidden_TH.new_zeros(1, hidden_TH.shape[1])])
    # row s = token send_token_idx_S[s]; rows are already grouped by destination, as the splits expect
    send_x_SH = hidden_TH[layout.send_token_idx_S]
    # Bit-packing: the local ids (in [-1, P)) ride as J extra columns of the hidden rows, cast to the
    # hidden dtype, so rows, weights (when of the same dtype) and ids go in one collective
    # (`all_to_all_rows` packs same-dtype tensors side by side). The cast is lossless only while every
    # id is an exact float there: P <= 256 in bf16. Beyond that the int64 ids take a collective of their
    # own (integers take no gradient, so the backward leaves them out).
    exact = layout.experts_per_device <= largest_exact_integer(send_x_SH.dtype)
    ids_SJ = layout.send_local_ids_SK.to(send_x_SH.dtype) if exact else layout.send_local_ids_SK
    recv_x_RH, recv_weights_RJ, recv_ids_RJ = all_to_all_rows(
        [send_x_SH, layout.send_weights_SK, ids_SJ], layout.send_splits, recv_splits, group
    )
    # exact floats round-trip exactly; round() only guards the conversion back to int64
    return recv_x_RH, recv_weights_RJ, recv_ids_RJ.round().long() if exact else recv_ids_RJ


def return_rows(
    out_RH: torch.Tensor,
    received: ReceivedRows,
    group: dist.ProcessGroup | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The combine of a one-stage exchange: reverse exchange, then a sum per token in at least fp32."""
    layout = received.layout
    # The reverse exchange: the splits swap roles, so row s comes back to where it left (position s).
    (back_SH,) = all_to_all_rows([out_RH], received.recv_splits, layout.send_splits, group)
    # A token's rows (one per device it reached) are summed in at least fp32, then rounded once.
    acc_dtype = torch.promote_types(back_SH.dtype, torch.float32)
    rows = layout.num_tokens + (1 if layout.padded else 0)  # pad rows land on a spare row T
    out_TH = back_SH.new_zeros(rows, back_SH.shape[-1], dtype=acc_dtype)
    # backward of the per-token sum: each returned row gets its token's gradient (a gather by index)
    out_TH = out_TH.index_add(0, layout.send_token_idx_S, back_SH.to(acc_dtype))
    return out_TH[: layout.num_tokens].to(out_dtype or out_RH.dtype)


class FlatExchange(Exchange):
    """The de-duplicated all-to-all: one row per (token, device), summed on the device, one row back.

    Args:
        layout / group: E experts on the D ranks of `group` (None: the default group; D = 1 without
            torch.distributed).
        capacity: None (exact: one host synchronisation per layer) or C rows per destination (the
            capacity-bounded mode: no synchronisation; every rank sends D x C rows, padded; a rank with
            more than C tokens raises before sending, since only C >= T is a proven bound).
    """

    name, kind = "flat", "dedup"  # kind: the rows `plan` sends (`row_plan`)

    def __init__(
        self, layout: ExpertLayout, group: dist.ProcessGroup | None = None, capacity: int | None = None
    ):
        super().__init__(layout, group)
        if capacity is not None and not is_positive_int(capacity):
            raise ValueError(f"capacity={capacity!r} must be a positive number of rows per device, or None")
        self.capacity = capacity

    @property
    def pipelinable(self) -> bool:
        # padded buffers need no host read to hide, and their pads do not split into chunks
        return self.capacity is None

    def plan(self, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> RowPlan:
        return row_plan(topk_ids_TK, weights_TK, self.layout, self.rank, self.kind)

    def dispatch(self, hidden_TH, topk_ids_TK, weights_TK):
        check_hidden(hidden_TH, topk_ids_TK)
        plan = self.plan(topk_ids_TK, weights_TK)
        if self.capacity is not None:
            # No host read at all: every block is C rows (C >= T is checked in capacity_layout), and the
            # local experts find their per-expert blocks on the device ("device" counts).
            layout = capacity_layout(plan, self.capacity)
            # ids outside [0, E) would be sent nowhere: stop the run on the device, no host read
            torch._assert_async(plan.meta_DC[0, -1] == 0, "topk_ids hold expert ids outside [0, num_experts)")
            # every rank sends C rows to every rank, so the receive splits are known without a count exchange
            recv_splits = (self.capacity,) * self.layout.num_devices
            counts: tuple[int, ...] | str = "device"
        else:
            # Exact: one equal-split all-to-all of the (D, P + 2) count table, one host read of it;
            # the row exchange, the grouped matmuls and the backward then reuse these ints.
            sends, recvs, all_counts = read_counts([plan], exchange_meta(plan.meta_DC, self.group))
            layout = layout_from_plan(plan, sends[0])
            recv_splits, counts = recvs[0], all_counts[0]
        recv_x_RH, recv_w_RJ, recv_ids_RJ = send_rows(hidden_TH, layout, recv_splits, self.group)
        return recv_x_RH, recv_w_RJ, ReceivedRows(layout, recv_splits, recv_ids_RJ, counts)

    def combine(self, out_RH, handle, out_dtype=None):
        return return_rows(out_RH, handle, self.group, out_dtype)


class PerExpertExchange(FlatExchange):
    """One row per (token, expert), rows sorted by expert; weights applied on the expert's device and the
    K rows of a token summed at home (exact, like the others). Exact mode only."""

    name, kind = "per_expert", "per_expert"

    def __init__(self, layout: ExpertLayout, group: dist.ProcessGroup | None = None):
        super().__init__(layout, group, capacity=None)


def moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: nn.Module,
    exchange: Exchange,
    backend: str = "auto",
) -> torch.Tensor:
    """One expert-parallel MoE layer through `exchange`: dispatch, local experts, combine.

    Args:
        hidden_TH: (T, H) this rank's tokens (T may be 0); topk_ids_TK: (T, K) global expert ids;
        weights_TK: (T, K) gate weights. experts: this rank's P contiguous experts (`shard_experts`).
        exchange: any `Exchange` of the experts' layout. backend: grouped matmul backend of the local
            compute ("auto", "grouped_mm", "loop").

    Returns (T, H) in hidden_TH.dtype, equal to the unsharded layer on this rank's tokens.
    """
    check_hidden(hidden_TH, topk_ids_TK)
    per_device = num_local_experts(experts)
    if per_device != exchange.layout.experts_per_device:
        raise ValueError(
            f"num_experts={exchange.layout.num_experts} but the module holds {per_device} experts on each of "
            f"{exchange.layout.num_devices} devices ({per_device * exchange.layout.num_devices}); shard with "
            "shard_experts(model, group)"
        )
    recv_x_RH, recv_w_RJ, handle = exchange.dispatch(hidden_TH, topk_ids_TK, weights_TK)
    out_RH = local_experts_forward(
        recv_x_RH, handle.recv_local_ids_RJ, recv_w_RJ, experts, backend, counts=handle.expert_counts
    )
    return exchange.combine(out_RH, handle, out_dtype=hidden_TH.dtype)
