"""The exchange primitive: uneven all-to-all of row blocks, with an autograd rule.

    group_size_and_rank   (D, rank) of a group, (1, 0) without torch.distributed
    exchange_meta         equal-split all-to-all of the (D, C) count table
    start_exchange        row blocks of several tensors, asynchronous (`PendingRows.wait()` joins)
    all_to_all_rows       the same, waited for and differentiable: the backward is the reverse exchange
    close_process_group   leave torch.distributed cleanly (now, or at interpreter exit)
    group_cache           a dict for objects holding process groups, emptied by close_process_group
    exit_rank             end a rank process of a finished run without interpreter finalization

All ranks of the group call these in the same order with the same dtypes and `requires_grad` pattern.
Shape legend: S rows sent, R rows received, C columns (trailing dims flattened), D ranks in the group.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = [
    "group_size_and_rank",
    "exchange_meta",
    "all_to_all_rows",
    "PendingRows",
    "start_exchange",
    "close_process_group",
    "close_process_group_at_exit",
    "group_cache",
    "exit_rank",
]


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(D, rank) of `group`; (1, 0) when torch.distributed is not initialised and `group` is None."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


_GROUP_CACHES: list[dict] = []
_CLOSED_A_GROUP = False  # this process has left a process group (`exit_rank` then skips finalization)


def group_cache() -> dict:
    """A new module-level cache for objects that hold process groups (sub-groups are created once per
    process and kept); `close_process_group` empties every such cache."""
    cache: dict = {}
    _GROUP_CACHES.append(cache)
    return cache


def close_process_group(wait_for_others: bool = False) -> None:
    """Destroy the default process group and every sub-group, if there are any, and drop the caches that
    hold sub-groups, so that gloo's threads are joined now, while the interpreter is whole.

    A rank that reaches interpreter exit with a gloo group still alive can abort there (SIGABRT,
    "terminate called without an active exception") after a run that succeeded, and the launcher then
    reports the whole run as failed: the group's worker threads may still hold finished asynchronous works
    (`async_op=True`, as the exchange issues them) whose tensors are freed during interpreter finalization,
    when the GIL can no longer be taken (the cause given in pytorch/pytorch#179291, which proposed a
    close at exit for torch itself and was withdrawn). `destroy_process_group` alone does not end those
    threads: a group object still referenced (a cached sub-group) keeps them until finalization.
    `wait_for_others` first waits on a barrier (after a failure there is none: the other ranks may be
    inside another collective)."""
    global _CLOSED_A_GROUP
    if dist.is_available() and dist.is_initialized():
        if wait_for_others:
            dist.barrier()
        dist.destroy_process_group()
        _CLOSED_A_GROUP = True
    for cache in _GROUP_CACHES:
        cache.clear()
    # DeepSpeed keeps its expert-parallel groups in module globals (deepspeed.utils.groups); they die
    # with the default group, so drop them too when DeepSpeed is loaded.
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is not None:
        for name in _DEEPSPEED_GROUP_DICTS:
            held = getattr(ds_groups, name, None)
            if isinstance(held, dict):
                held.clear()
    # A model, trainer or work in a reference cycle can hold a sub-group too: collect them now, so that
    # the groups nothing else holds are destroyed (their threads joined) here rather than at finalization.
    gc.collect()


# The dicts of deepspeed.utils.groups (DeepSpeed 0.19) that map names to process groups.
_DEEPSPEED_GROUP_DICTS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP")


_CLOSE_AT_EXIT = False


def close_process_group_at_exit() -> None:
    """Register `close_process_group()` (no barrier) to run at interpreter exit, once per process, before
    Python tears its modules down: for a user's own script under torchrun, which ends without destroying
    the group its `Trainer` initialised. Called by the Occult trainers and sharded loading."""
    global _CLOSE_AT_EXIT
    if not _CLOSE_AT_EXIT:
        atexit.register(close_process_group)
        _CLOSE_AT_EXIT = True


def exit_rank(code: int = 0) -> NoReturn:
    """End the process of one rank of a distributed run that has finished: close the process group,
    run the interpreter's exit functions (logging, trackers, anything registered with `atexit`), flush
    stdout and stderr, and leave with `os._exit(code)`, skipping interpreter finalization.

    Closing the group does not end every gloo thread: DDP's reducer keeps the default group alive through
    a reference cycle in C++ that Python's collector cannot see, so its threads outlive the close, and a
    thread still holding a finished work when the interpreter tears down aborts the process (see
    `close_process_group`). Nothing of the run is lost by skipping that tear-down: results, checkpoints
    and logs are written, and the exit functions have run. A process that never joined a group exits
    normally (`sys.exit(code)`). For the entry points of launched ranks: `occult-ft train` under a
    launcher, the benchmark workers."""
    distributed = _CLOSED_A_GROUP or (dist.is_available() and dist.is_initialized())
    close_process_group()
    if not distributed:
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter would run first at exit, while it is still whole
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)


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
    # Equal blocks (the capacity-bounded exchange) need no size lists: the backend's plain all-to-all.
    if len(set(send_splits) | set(recv_splits)) == 1:
        return {}
    # Split sizes are Python ints from the layout: no collective waits on a device-to-host copy.
    # gloo handles uneven splits, zeros included, in this flat form; its list form `all_to_all` does not.
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
    # One collective per dtype: e.g. (S, H) hidden rows and (S, K) fp32 weights in fp32 training become
    # one (S, H + K) buffer; row s of every member travels to the same rank, so columns can share it.
    for members in by_dtype.values():
        # (S, ...) -> (S, prod(trailing)): a row's columns stay together, so row s of each member goes alike
        cols = [tensors[i].reshape(num_send, math.prod(tensors[i].shape[1:])) for i in members]
        send_SC = torch.cat(cols, dim=1).contiguous() if len(cols) > 1 else cols[0].contiguous()
        out.append((members, [c.shape[1] for c in cols], send_SC))
    return out


class PendingRows:
    """An exchange of row blocks in flight (`start_exchange`); `wait()` returns the received tensors."""

    def __init__(self, works, parts, shapes, num_recv: int):
        self._works, self._parts, self._shapes, self._num_recv = works, parts, shapes, num_recv

    def wait(self) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self._shapes)
        for work, (members, widths, recv_RC) in zip(self._works, self._parts):
            if work is not None:
                work.wait()
            # unpack the columns back into the members, each with its own trailing shape
            for i, piece in zip(members, recv_RC.split(widths, dim=1)):
                out[i] = piece.reshape(self._num_recv, *self._shapes[i])
        return out  # type: ignore[return-value]


def start_exchange(
    tensors: Sequence[torch.Tensor],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> PendingRows:
    """Send rows [o_j, o_j + send_splits[j]) of each (S, ...) tensor to rank j and receive recv_splits[j]
    rows from rank j, concatenated in rank order, asynchronously (`async_op=True`; no autograd).

    The collectives run on the process group's own worker (gloo) or stream (NCCL) while the caller
    computes; `wait()` joins them. Collectives on one group complete in the order they were issued."""
    world, _ = group_size_and_rank(group)
    num_recv = sum(recv_splits)
    works: list[dist.Work | None] = []
    parts = []
    for members, widths, send_SC in _packed(tensors, sum(send_splits)):
        recv_RC, work = send_SC, None  # one rank: the rows stay here, the send buffer is the received one
        if world > 1:
            # one receive buffer per dtype: R rows of the members' columns side by side, unpacked in wait()
            recv_RC = send_SC.new_empty(num_recv, sum(widths))
            kwargs = _split_kwargs(send_splits, recv_splits)
            work = dist.all_to_all_single(recv_RC, send_SC, **kwargs, group=group, async_op=True)
        works.append(work)
        parts.append((members, widths, recv_RC))
    return PendingRows(works, parts, [tuple(t.shape[1:]) for t in tensors], num_recv)


def _exchange_rows(tensors, send_splits, recv_splits, group) -> list[torch.Tensor]:
    # waited for; the unpacked columns are strided views of the packed buffer: give each its own storage
    return [t.contiguous() for t in start_exchange(tensors, send_splits, recv_splits, group).wait()]


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_splits, recv_splits, group, *tensors):
        ctx.send_splits, ctx.recv_splits, ctx.group = tuple(send_splits), tuple(recv_splits), group
        ctx.dtypes = [t.dtype for t in tensors]
        return tuple(_exchange_rows(tensors, send_splits, recv_splits, group))

    @staticmethod
    def backward(ctx, *grads):
        # Received row r came from some rank's sent row s; its gradient goes back the same way: the
        # reverse exchange with the splits swapped (no new counts, no host read). Only inputs that
        # need a gradient travel; that pattern is the same on every rank, so the collectives pair up.
        # Gradients are cast to the input's dtype so that dtype packing matches on every rank.
        # forward's inputs are (send_splits, recv_splits, group, *tensors): tensor i is input 3 + i
        wanted = [i for i in range(len(grads)) if ctx.needs_input_grad[3 + i]]
        moved = _exchange_rows(
            [grads[i].contiguous().to(ctx.dtypes[i]) for i in wanted],
            ctx.recv_splits,
            ctx.send_splits,
            ctx.group,
        )
        result: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(wanted, moved):
            result[i] = g
        return (None, None, None, *result)  # no gradient for the splits and the group


def all_to_all_rows(
    tensors: Sequence[torch.Tensor],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """`start_exchange`, waited for and differentiable: gradients of the received (R, ...) rows flow back
    to the (S, ...) rows that were sent, by the reverse exchange. With one rank it is the identity."""
    world, _ = group_size_and_rank(group)
    if world == 1:
        return list(tensors)
    return list(_AllToAllRows.apply(tuple(send_splits), tuple(recv_splits), group, *tensors))
