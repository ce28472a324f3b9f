"""The exchange primitive: uneven all-to-all of row blocks, with an autograd rule.

Row-block exchange is all the de-duplicated dispatch needs: rank i sends rows [o_j, o_j + send[j])
of its buffer to rank j, and receives recv[j] rows from rank j, concatenated in rank order. The
backward of such an exchange is the same exchange with the split sizes swapped (gradients of the
received rows go back to the ranks that sent them), so `all_to_all_rows` is a small
`torch.autograd.Function` around `torch.distributed.all_to_all_single` with explicit split sizes.
(gloo handles uneven splits, zeros included, with the flat `all_to_all_single`; its list form
`all_to_all` does not. `torch.distributed._functional_collectives.all_to_all_single_autograd` does
the same but is private API, so we keep our own few lines.)

Several tensors with the same row count travel together: tensors of one dtype are packed side by
side as columns of one buffer (hidden rows and fp32 gate weights in fp32 training: one collective
per direction); each further dtype costs one more collective. Split sizes are Python ints taken from
the layout, so no collective waits on a device-to-host copy.

All ranks of the group must call these functions in the same order with the same list of dtypes
and the same `requires_grad` pattern (true for replicas of one model running the same code).

Shape legend:
    S  rows this rank sends     R  rows this rank receives     C  columns (trailing dims flattened)
    D  ranks in the group
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "group_size_and_rank",
    "exchange_counts",
    "exchange_meta",
    "exchange_rows",
    "all_to_all_rows",
    "PendingRows",
    "start_exchange",
]


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(D, rank) of `group`; (1, 0) when torch.distributed is not initialised and `group` is None."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def exchange_counts(send_counts_D: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Tell every rank how many rows it will receive: returns recv[j] = rows rank j sends to us."""
    world, _ = group_size_and_rank(group)
    if world == 1:
        return tuple(int(c) for c in send_counts_D.tolist())
    if send_counts_D.numel() != world:
        raise ValueError(f"send_counts has {send_counts_D.numel()} entries for a group of {world} ranks")
    recv_D = torch.empty_like(send_counts_D)
    dist.all_to_all_single(recv_D, send_counts_D.contiguous(), group=group)
    return tuple(int(c) for c in recv_D.tolist())


def exchange_meta(meta_DC: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Equal-split all-to-all of a (D, C) int64 tensor: row j goes to rank j, and row j of the result
    came from rank j. Device tensors in and out: the caller reads what it needs in one `.tolist()`."""
    world, _ = group_size_and_rank(group)
    if world == 1:
        return meta_DC
    if meta_DC.shape[0] != world:
        raise ValueError(f"count metadata has {meta_DC.shape[0]} rows for a group of {world} ranks")
    recv_DC = torch.empty_like(meta_DC)
    dist.all_to_all_single(recv_DC, meta_DC.contiguous(), group=group)
    return recv_DC


def _split_kwargs(send_splits: Sequence[int], recv_splits: Sequence[int]) -> dict:
    """Split sizes for `all_to_all_single`; none when every block has the same size (the capacity-bounded
    exchange): the backend then runs its plain all-to-all instead of the uneven variant."""
    sizes = set(send_splits) | set(recv_splits)
    if len(sizes) == 1:
        return {}
    return {"output_split_sizes": list(recv_splits), "input_split_sizes": list(send_splits)}


def _packed(
    tensors: Sequence[torch.Tensor], num_send: int
) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Per dtype: (member indices, column widths, (S, C) send buffer of the members side by side)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.shape[0] != num_send:
            raise ValueError(
                f"tensor of shape {tuple(t.shape)} has {t.shape[0]} rows; the splits send {num_send}"
            )
        by_dtype.setdefault(t.dtype, []).append(i)
    out = []
    for members in by_dtype.values():
        cols = [tensors[i].reshape(num_send, math.prod(tensors[i].shape[1:])) for i in members]
        send_SC = torch.cat(cols, dim=1).contiguous() if len(cols) > 1 else cols[0].contiguous()
        out.append((members, [c.shape[1] for c in cols], send_SC))
    return out


class PendingRows:
    """An exchange of row blocks in flight (`start_exchange`); `wait()` returns the received tensors."""

    def __init__(self, works, parts, shapes, num_recv: int, count: int):
        self._works, self._parts, self._shapes = works, parts, shapes
        self._num_recv, self._count = num_recv, count

    def wait(self) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * self._count
        for work, (members, widths, recv_RC) in zip(self._works, self._parts):
            if work is not None:
                work.wait()
            for i, piece in zip(members, recv_RC.split(widths, dim=1)):
                out[i] = piece.reshape(self._num_recv, *self._shapes[i])
        return out  # type: ignore[return-value]


def start_exchange(
    tensors: Sequence[torch.Tensor],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> PendingRows:
    """`exchange_rows` issued asynchronously (`async_op=True`; no autograd): the collectives run on the
    process group's own worker (gloo) or stream (NCCL) while the caller computes; `wait()` joins them.
    Collectives on one group complete in the order they were issued."""
    world, _ = group_size_and_rank(group)
    num_send, num_recv = sum(send_splits), sum(recv_splits)
    shapes = [tuple(t.shape[1:]) for t in tensors]
    if world == 1:
        parts = [(members, widths, send_SC) for members, widths, send_SC in _packed(tensors, num_send)]
        return PendingRows([None] * len(parts), parts, shapes, num_recv, len(tensors))
    works, parts = [], []
    for members, widths, send_SC in _packed(tensors, num_send):
        recv_RC = send_SC.new_empty(num_recv, sum(widths))
        works.append(
            dist.all_to_all_single(
                recv_RC, send_SC, **_split_kwargs(send_splits, recv_splits), group=group, async_op=True
            )
        )
        parts.append((members, widths, recv_RC))
    return PendingRows(works, parts, shapes, num_recv, len(tensors))


def exchange_rows(
    tensors: Sequence[torch.Tensor],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """Exchange row blocks of several (S, ...) tensors (no autograd). Returns (R, ...) tensors.

    Tensors of one dtype are packed as columns of one buffer and exchanged with one
    `all_to_all_single`; the results keep each input's dtype and trailing shape.
    """
    world, _ = group_size_and_rank(group)
    if world == 1:
        return list(tensors)
    num_send, num_recv = sum(send_splits), sum(recv_splits)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for members, widths, send_SC in _packed(tensors, num_send):
        recv_RC = send_SC.new_empty(num_recv, sum(widths))
        dist.all_to_all_single(recv_RC, send_SC, **_split_kwargs(send_splits, recv_splits), group=group)
        for i, piece in zip(members, recv_RC.split(widths, dim=1)):
            out[i] = piece.contiguous().reshape(num_recv, *tensors[i].shape[1:])
    return out  # type: ignore[return-value]


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_splits, recv_splits, group, *tensors):
        ctx.send_splits, ctx.recv_splits, ctx.group = tuple(send_splits), tuple(recv_splits), group
        ctx.shapes = [t.shape for t in tensors]
        ctx.dtypes = [t.dtype for t in tensors]
        return tuple(exchange_rows(tensors, send_splits, recv_splits, group))

    @staticmethod
    def backward(ctx, *grads):
        # Reverse exchange, reusing the forward's split sizes (the layout): only for inputs that need
        # a gradient; that pattern is the same on every rank, so the collectives still pair up.
        wanted = [i for i in range(len(grads)) if ctx.needs_input_grad[3 + i]]
        moved = exchange_rows(
            [grads[i].contiguous().to(ctx.dtypes[i]) for i in wanted],
            ctx.recv_splits,
            ctx.send_splits,
            ctx.group,
        )
        result: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(wanted, moved):
            result[i] = g
        return (None, None, None, *result)


def all_to_all_rows(
    tensors: Sequence[torch.Tensor],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """Differentiable `exchange_rows`: gradients of the received (R, ...) rows flow back to the (S, ...)
    rows that were sent, by the reverse exchange. With one rank it is the identity."""
    world, _ = group_size_and_rank(group)
    if world == 1:
        return list(tensors)
    return list(_AllToAllRows.apply(tuple(send_splits), tuple(recv_splits), group, *tensors))
