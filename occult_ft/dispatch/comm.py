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

__all__ = ["group_size_and_rank", "exchange_counts", "exchange_rows", "all_to_all_rows"]


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
    for t in tensors:
        if t.shape[0] != num_send:
            raise ValueError(
                f"tensor of shape {tuple(t.shape)} has {t.shape[0]} rows; the splits send {num_send}"
            )
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for members in by_dtype.values():
        cols = [tensors[i].reshape(num_send, math.prod(tensors[i].shape[1:])) for i in members]
        widths = [c.shape[1] for c in cols]
        send_SC = torch.cat(cols, dim=1).contiguous() if len(cols) > 1 else cols[0].contiguous()
        recv_RC = send_SC.new_empty(num_recv, sum(widths))
        dist.all_to_all_single(
            recv_RC,
            send_SC,
            output_split_sizes=list(recv_splits),
            input_split_sizes=list(send_splits),
            group=group,
        )
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
