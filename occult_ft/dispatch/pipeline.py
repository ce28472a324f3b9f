"""Overlap: a MoE layer's tokens in chunks, the exchange of one chunk hidden behind another's experts,
and this rank's own rows (no network) computed while the exchanges of the other rows travel.

    pipelined_moe_forward   `moe_forward` in n chunks, for exchanges whose `pipelinable` is true
    _PipelinedMoE           the layer as one autograd function (forward and backward pipelined)
    _Chunk / _OwnRows       one chunk's state; the own rows of every chunk, computed as one piece

The chunk count is `ExpertShard.chunks` (`OccultConfig.exchange_chunks`); the kernel runs one chunk
here too when `ExpertShard.overlap_local` is set (the own rows alone overlap the exchange).

Shape legend: T tokens, K top-k, H hidden, J slots per row, S rows sent to other ranks, R rows received
from other ranks, L own rows (this rank's tokens for its own experts), P local experts, n chunks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import overload

import torch
from torch import nn

from .comm import exchange_meta, start_exchange
from .exchange import Exchange, largest_exact_integer, moe_forward, read_counts
from .local import local_experts_forward, num_local_experts
from .plan import DispatchLayout, RowPlan, layout_from_plan
from .reference import expert_weights

__all__ = ["pipelined_moe_forward"]


class _Chunk:
    """One chunk's state between forward and backward; fields are filled as the schedule reaches them."""

    __slots__ = (
        "lo",
        "hi",
        "layout",
        "send_splits",
        "recv",
        "counts",
        "own_counts",
        "send_idx",
        "own_idx",
        "own_ids",
        "own_w",
        "h_leaf",
        "w_leaf",
        "send_x",
        "send_w",
        "send_ids",
        "x_leaf",
        "rw_leaf",
        "out",
    )
    lo: int  # the chunk's tokens are [lo, hi) of the layer's T
    hi: int
    layout: DispatchLayout  # every row the chunk routes, its own rows included
    send_splits: tuple[int, ...]  # rows to each rank, 0 for this rank (its own rows never travel)
    recv: tuple[int, ...]  # rows received from each source rank, 0 from this rank
    counts: tuple[int, ...]  # received (remote) (row, slot) pairs per local expert
    own_counts: tuple[int, ...]  # own (row, slot) pairs per local expert
    send_idx: torch.Tensor  # (S,) token of each row sent to another rank (chunk-local index)
    own_idx: torch.Tensor  # (L,) token of each own row
    own_ids: torch.Tensor  # (L, J) local expert ids of the own rows
    own_w: torch.Tensor  # (L, J) their gate weights (in the graph of w_leaf)
    h_leaf: torch.Tensor  # (T_c, H) detached hidden states, the leaf of this chunk's dispatch graph
    w_leaf: torch.Tensor  # (T_c, K) detached gate weights
    send_x: torch.Tensor  # (S, H) rows gathered for sending (kept in the graph for backward)
    send_w: torch.Tensor  # (S, J)
    send_ids: torch.Tensor  # (S, J)
    x_leaf: torch.Tensor | None  # (R, H) received rows; None once backward has used them
    rw_leaf: torch.Tensor | None  # (R, J)
    out: torch.Tensor | None  # (R, H) the local experts' output, kept for backward when grad is on


class _OwnRows:
    """This rank's own rows of every chunk (tokens for its own experts) through its experts, as one
    piece: they need no network, so the schedule computes them while the first exchange travels.

    One piece, not one per chunk: each piece of expert graph gets a dense (P, I, O) gradient of every
    expert weight in backward, which autograd then adds into `.grad` (on CPU, a memory pass each)."""

    __slots__ = ("states", "idx", "counts", "out")

    def __init__(self, states: list[_Chunk]):
        self.states = states
        # (L,) token of each own row in the layer's T: the chunk's local index offset by its first token
        self.idx = torch.cat([st.own_idx + st.lo for st in states])
        self.counts = tuple(sum(per) for per in zip(*(st.own_counts for st in states)))
        self.out: torch.Tensor | None = None  # (L, H), graph kept for backward when grad is on

    def forward(self, experts, backend, graph, out_TH) -> None:
        if not sum(self.counts):  # no own pairs, hence no own rows: nothing to compute or sum
            return
        # gathered from each chunk's leaf: their backward lands in h_leaf.grad / w_leaf.grad directly
        x_LH = torch.cat([st.h_leaf[st.own_idx] for st in self.states])
        ids_LJ = torch.cat([st.own_ids for st in self.states])
        w_LJ = torch.cat([st.own_w for st in self.states])
        out_LH = local_experts_forward(x_LH, ids_LJ, w_LJ, experts, backend, counts=self.counts)
        self.out = out_LH if graph else None
        out_TH.index_add_(0, self.idx, out_LH.detach().to(out_TH.dtype))

    def backward(self, grad_out_TH) -> None:
        if self.out is None:
            return
        # retain_graph: the own rows' gate weights share send_weights_SK's graph with the rows sent,
        # and PEFT's cached LoRA weight is shared with the chunks (all freed with ctx.states)
        torch.autograd.backward(self.out, grad_out_TH[self.idx].to(self.out.dtype), retain_graph=True)
        self.out = None


class _SharedPiece:
    """The block's shared MLP on every token of the layer (`shared=` of `pipelined_moe_forward`), run by
    the layer's forward while the combines travel.

    Its graph hangs off the layer's inputs as if the block had run it (built under enable_grad inside the
    layer's forward, on the input itself, not on a detached leaf): its backward is autograd's own, so a
    wrapper that follows the graph from the loss (DDP finding its parameters) sees it, and no gradient
    hook fires twice. `_Homecoming` puts that backward between the layer's and the wait for the
    dispatch's transposes, taking what the layer's backward leaves in `pending`: (states, returning,
    grad_out_TH, weights_like)."""

    __slots__ = ("module", "out", "pending")

    def __init__(self, module: nn.Module):
        self.module = module
        self.out: torch.Tensor | None = None
        self.pending: tuple | None = None

    def run(self, hidden_TH: torch.Tensor, graph: bool) -> None:
        with torch.enable_grad() if graph else torch.no_grad():
            self.out = self.module(hidden_TH)


class _Homecoming(torch.autograd.Function):
    """The end of the layer's backward, as a node of its own in front of the layer: forward passes the
    hidden states and gate weights through; backward waits for the dispatch's transposes that the
    layer's backward issued (`_SharedPiece.pending`) and adds their gradients to what arrives.

    The layer and the shared MLP both consume its outputs, so autograd runs this backward only after
    both of theirs: the shared MLP's backward runs while the transposes travel. (Its nodes were made
    after this one and before the layer's, and the engine runs the latest-made ready node first.)"""

    @staticmethod
    def forward(ctx, hidden_TH, weights_TK, piece):
        ctx.piece = piece
        return hidden_TH.view_as(hidden_TH), weights_TK.view_as(weights_TK)

    @staticmethod
    def backward(ctx, grad_h, grad_w):
        piece, ctx.piece = ctx.piece, None
        pending, piece.pending = piece.pending, None
        if pending is None:  # the layer's output got no gradient: nothing was issued
            return grad_h, grad_w, None
        home_h, home_w = _dispatch_transpose(*pending)
        return _added(grad_h, home_h), _added(grad_w, home_w.to(pending[3].dtype)), None


def _own_only(plan: RowPlan, rank: int) -> RowPlan:
    """A plan whose count table tells only this rank itself its row (a copy of the real one's): in the
    count exchange it makes read_counts return the own rows' pairs per local expert, with no extra read."""
    meta_DC = torch.zeros_like(plan.meta_DC)
    meta_DC[rank] = plan.meta_DC[rank]
    return replace(plan, meta_DC=meta_DC)


def _without_own(splits: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return tuple(0 if j == rank else n for j, n in enumerate(splits))


# Schedule, with asynchronous collectives (`comm.start_exchange`: gloo runs them on the process
# group's own threads, NCCL on its own stream); O = the own rows' experts (no network, `_OwnRows`),
# S = the block's shared MLP when given (`_SharedPiece`, `exchange_overlap_shared`):
#     forward:   dispatch(0) + O | dispatch(1) + experts(0) | combine(0) + dispatch(2) + experts(1) | ...
#                | combine(n - 1) + S
#     backward:  combine^T(0) + O^T, then combine^T(c + 1) in flight while experts^T(c) runs, then
#                dispatch^T(c); with S the wait for the dispatch^T is `_Homecoming`'s, after autograd has
#                run S^T (its graph hangs off the layer's inputs, see `_SharedPiece`)
# so with one chunk (`overlap_local`) the dispatch travels while the own rows compute, and the combine
# is issued before the own rows are summed (they already are).
# All chunks' counts (and the own rows' counts) travel in one count exchange, so the schedule adds no
# host synchronisation. Own rows are cut out of every collective: their splits are 0 both ways.
# Autograd: forward builds each chunk's local-expert graph on detached leaves (under enable_grad) and
# keeps it; backward feeds each chunk's returned gradient into that graph (`torch.autograd.backward`,
# as reentrant checkpointing does), which accumulates the expert parameters' .grad and gives the
# received rows' gradients, sends them home and maps them onto the hidden states and gate weights.
# Hence, as with reentrant checkpointing, `torch.autograd.grad(..., inputs=expert parameters)` does not
# see the expert gradients; `backward()` does. Results equal `moe_forward` to float rounding (the
# per-token sums add the same rows in another order).
class _PipelinedMoE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden_TH,
        weights_TK,
        topk_ids_TK,
        experts,
        exchange,
        chunks,
        backend,
        graph,
        shared_piece,
        *anchors,
    ):
        group, p = exchange.group, exchange.layout.experts_per_device
        states = _plan_chunks(hidden_TH, weights_TK, topk_ids_TK, exchange, chunks, graph)
        # the local ids ride as columns of the hidden rows when exact there (as in exchange.send_rows)
        ids_dtype = hidden_TH.dtype if p <= largest_exact_integer(hidden_TH.dtype) else torch.long

        def start_dispatch(st):
            tensors = [st.send_x.detach(), st.send_w.detach(), st.send_ids.to(ids_dtype)]
            return start_exchange(tensors, st.send_splits, st.recv, group)

        out_TH = hidden_TH.new_zeros(
            hidden_TH.shape[0], hidden_TH.shape[1], dtype=torch.promote_types(hidden_TH.dtype, torch.float32)
        )
        pending = []
        with torch.enable_grad() if graph else torch.no_grad():
            own = _OwnRows(states)
            inflight = start_dispatch(states[0])
            own.forward(experts, backend, graph, out_TH)  # while dispatch(0) travels
            ran = own.out is not None or not graph  # whether an expert graph holds the weights already
            for c, st in enumerate(states):
                recv_x, recv_w, recv_ids = inflight.wait()
                if c + 1 < chunks:
                    inflight = start_dispatch(states[c + 1])  # in flight while chunk c computes
                # received rows are leaves of the chunk's expert graph; their .grad is what goes home
                st.x_leaf = recv_x.requires_grad_(graph)
                st.rw_leaf = recv_w.requires_grad_(graph)
                # nothing received (R = 0): no expert graph, hence no dense weight gradient in backward,
                # unless no other piece has one: the expert weights then still get their (zero) .grad,
                # as with `moe_forward`, so every rank's gradient hooks fire alike
                compute = bool(sum(st.counts)) or (c + 1 == chunks and not ran)
                ran = ran or compute
                if compute:
                    out_RH = local_experts_forward(
                        st.x_leaf, recv_ids.round().long() if recv_ids.is_floating_point() else recv_ids,
                        st.rw_leaf, experts, backend, counts=st.counts,
                    )  # fmt: skip
                else:
                    out_RH = st.x_leaf.detach().clone()
                st.out = out_RH if graph and compute else None
                pending.append(start_exchange([out_RH.detach()], st.recv, st.send_splits, group))
            if shared_piece is not None:  # the shared MLP while the combines travel
                shared_piece.run(hidden_TH, graph)
            # the combines: each chunk's rows come home and are summed per token in at least fp32
            for st, returning in zip(states, pending):
                (back_SH,) = returning.wait()
                # send_idx is local to the chunk: offset by writing into out_TH[lo:hi]
                out_TH[st.lo : st.hi].index_add_(0, st.send_idx, back_SH.to(out_TH.dtype))
        ctx.states, ctx.own, ctx.group, ctx.anchors = states, own, group, len(anchors)
        # with a shared MLP whose graph hangs off these inputs, `_Homecoming` finishes the backward
        ctx.homecoming = shared_piece if shared_piece is not None and graph else None
        ctx.weights_like = weights_TK.detach()
        return out_TH.to(hidden_TH.dtype)

    @staticmethod
    def backward(ctx, grad_out_TH):
        states, group = ctx.states, ctx.group
        grad_out_TH = grad_out_TH.contiguous()

        # the combine's transpose: each sent row's token gradient goes back to the expert's device
        def start_reverse_combine(st):
            g_SH = grad_out_TH[st.lo : st.hi][st.send_idx].to(st.x_leaf.dtype)
            return start_exchange([g_SH], st.send_splits, st.recv, group)

        returning = []
        with torch.enable_grad():  # expert parameters' .grad and the chunks' leaves accumulate here
            inflight = start_reverse_combine(states[0])
            ctx.own.backward(grad_out_TH)  # while combine^T(0) travels
            for c, st in enumerate(states):
                (g_out_RH,) = inflight.wait()
                if c + 1 < len(states):
                    inflight = start_reverse_combine(states[c + 1])
                if st.out is not None:
                    # retain_graph: a graph the chunks share (PEFT's cached LoRA weight) must survive until
                    # the last piece has gone through it; everything is freed with ctx.states below
                    torch.autograd.backward(st.out, g_out_RH, retain_graph=True)
                # zeros where nothing flowed, so every rank sends the same tensors and the collectives pair up
                g_x = st.x_leaf.grad if st.x_leaf.grad is not None else torch.zeros_like(st.x_leaf)
                g_w = st.rw_leaf.grad if st.rw_leaf.grad is not None else torch.zeros_like(st.rw_leaf)
                returning.append(start_exchange([g_x, g_w], st.recv, st.send_splits, group))
                st.out = st.x_leaf = st.rw_leaf = None
        anchors, weights_like, homecoming = ctx.anchors, ctx.weights_like, ctx.homecoming
        ctx.states = ctx.own = ctx.weights_like = ctx.homecoming = None
        # one gradient per forward input: hidden, weights; None for ids, experts, exchange, chunks, backend,
        # graph, shared_piece, and the anchors (their gradients already accumulated in backward)
        rest = (None,) * (7 + anchors)
        if homecoming is not None:  # the shared MLP's backward runs next, while the transposes travel
            homecoming.pending = (states, returning, grad_out_TH, weights_like)
            return (torch.zeros_like(grad_out_TH), torch.zeros_like(weights_like), *rest)
        return (*_dispatch_transpose(states, returning, grad_out_TH, weights_like), *rest)


def _dispatch_transpose(states, returning, grad_out_TH, weights_like) -> tuple[torch.Tensor, torch.Tensor]:
    """Wait for the dispatch's transposes and map the sent rows' gradients onto the layer's hidden states
    and gate weights, plus what the own rows' backward left in the chunks' leaves."""
    grad_h = torch.zeros_like(grad_out_TH)
    pieces_w = []
    for st, home in zip(states, returning):
        g_send_x, g_send_w = home.wait()
        # dispatch's transpose: the sent rows' gradients through the gather onto the chunk's leaves
        with torch.enable_grad():
            g_h, g_w = torch.autograd.grad(
                [st.send_x, st.send_w], [st.h_leaf, st.w_leaf], [g_send_x, g_send_w], allow_unused=True
            )
        # plus what the own rows' backward left in the leaves' .grad
        h_total, w_total = _added(g_h, st.h_leaf.grad), _added(g_w, st.w_leaf.grad)
        if h_total is not None:  # the chunk's tokens are rows lo..hi of the layer
            grad_h[st.lo : st.hi] = h_total
        pieces_w.append(w_total if w_total is not None else torch.zeros_like(st.w_leaf))
    grad_w = torch.cat(pieces_w) if pieces_w else torch.zeros_like(weights_like)
    return grad_h, grad_w


def _added(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def _plan_chunks(
    hidden_TH, weights_TK, topk_ids_TK, exchange: Exchange, chunks: int, graph: bool
) -> list[_Chunk]:
    """Every chunk's rows, split into those for other ranks and this rank's own: one count exchange."""
    rank = exchange.rank
    # chunk boundaries as tensor_split cuts T (sizes differ by at most 1; a chunk may be empty)
    bounds = [0]
    for piece in torch.arange(hidden_TH.shape[0]).tensor_split(chunks):
        bounds.append(bounds[-1] + len(piece))
    states, plans = [], []
    with torch.enable_grad() if graph else torch.no_grad():
        for c in range(chunks):
            st = _Chunk()
            st.lo, st.hi = bounds[c], bounds[c + 1]
            # detached leaves: backward differentiates each chunk's own small graph, not the caller's
            st.h_leaf = hidden_TH[st.lo : st.hi].detach().requires_grad_(graph)
            st.w_leaf = weights_TK[st.lo : st.hi].detach().requires_grad_(graph)
            plans.append(exchange.plan(topk_ids_TK[st.lo : st.hi], st.w_leaf))
            states.append(st)
        # the n real plans then n own-only ones, their (D, P + 2) count tables side by side: one count
        # exchange and one host read for all; the own-only plans' counts are the own rows' pairs
        plans += [_own_only(plan, rank) for plan in plans]
        meta_DX = torch.cat([plan.meta_DC for plan in plans], dim=1)
        sends, recvs, counts = read_counts(plans, exchange_meta(meta_DX, exchange.group))  # the one sync
        for c, st in enumerate(states):
            st.layout = layout = layout_from_plan(plans[c], sends[c])
            st.own_counts = counts[chunks + c]
            # received pairs per local expert, less the own ones (they no longer travel)
            st.counts = tuple(a - b for a, b in zip(counts[c], st.own_counts))
            st.send_splits, st.recv = _without_own(sends[c], rank), _without_own(recvs[c], rank)
            # rows are grouped by destination in rank order: the own block is [first, last)
            first = sum(sends[c][:rank])
            last = first + sends[c][rank]
            remote = torch.cat([torch.arange(first), torch.arange(last, sum(sends[c]))]).to(
                layout.send_token_idx_S.device
            )
            st.send_idx = layout.send_token_idx_S[remote]
            st.own_idx = layout.send_token_idx_S[first:last]
            st.own_ids = layout.send_local_ids_SK[first:last]
            st.own_w = layout.send_weights_SK[first:last]
            # kept in the graph: backward maps the returned row gradients onto the leaves through them
            st.send_x = st.h_leaf[st.send_idx]
            st.send_w = layout.send_weights_SK[remote]
            st.send_ids = layout.send_local_ids_SK[remote]
    return states


@overload
def pipelined_moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: nn.Module,
    exchange: Exchange,
    chunks: int,
    backend: str = ...,
    shared: None = ...,
) -> torch.Tensor: ...


@overload
def pipelined_moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: nn.Module,
    exchange: Exchange,
    chunks: int,
    backend: str = ...,
    *,
    shared: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def pipelined_moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: nn.Module,
    exchange: Exchange,
    chunks: int,
    backend: str = "auto",
    shared: nn.Module | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`moe_forward` in `chunks` pipelined chunks, the own rows outside the collectives (the schedule is
    described above `_PipelinedMoE`); same result.

    Args:
        hidden_TH: (T, H); topk_ids_TK: (T, K) global expert ids; weights_TK: (T, K) gate weights.
        experts: this rank's P contiguous experts. exchange: one whose `pipelinable` is true (a
            `FlatExchange` in exact mode or a `PerExpertExchange`); with another, only chunks=1 without
            `shared` runs (as `moe_forward`). chunks: n >= 1, the same on every rank (chunks may be
            empty); 1 keeps the own rows' overlap with the exchange.
        backend: grouped matmul backend of the local compute.
        shared: a module applied to every token (a block's shared MLP), computed while the combines
            travel, its backward while the dispatch's transposes travel; its graph is the caller's, as if
            it had run it.

    Returns:
        (T, H) in hidden_TH.dtype; with `shared`, also `shared(hidden_TH)`, (T, O).
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive integer")
    if not exchange.pipelinable:
        if chunks == 1 and shared is None:
            return moe_forward(hidden_TH, topk_ids_TK, weights_TK, experts, exchange, backend)
        what = f"chunks={chunks}" if chunks > 1 else "shared="
        raise ValueError(
            f"{what} pipelines one-stage exact exchanges (flat without a capacity, per_expert); "
            f"this {exchange.name} exchange is not one: use chunks=1"
            + (" and shared=None" if shared is not None else "")
        )
    if hidden_TH.dim() != 2 or hidden_TH.shape[0] != topk_ids_TK.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden_TH.shape)} and topk_ids {tuple(topk_ids_TK.shape)} must be (T, H) and (T, K)"
        )
    if num_local_experts(experts) != exchange.layout.experts_per_device:
        raise ValueError(
            f"the module holds {num_local_experts(experts)} experts; the exchange expects "
            f"{exchange.layout.experts_per_device} per device; shard with shard_experts(model, group)"
        )
    graph = torch.is_grad_enabled()
    # The expert weights as the layer sees them (parameters, or PEFT's LoRA-merged weights) are inputs
    # too: the output then needs a backward whenever they train, even if neither the hidden states nor
    # the gate weights do (a frozen router on frozen embeddings); their gradients flow inside backward.
    anchors = (
        [t for t in expert_weights(experts).values() if isinstance(t, torch.Tensor) and t.requires_grad]
        if graph
        else []
    )
    piece = _SharedPiece(shared) if shared is not None else None
    if piece is not None and graph:  # the layer's backward ends in front of it (`_Homecoming`)
        hidden_TH, weights_TK = _Homecoming.apply(hidden_TH, weights_TK, piece)
    out_TH = _PipelinedMoE.apply(
        hidden_TH, weights_TK, topk_ids_TK, experts, exchange, chunks, backend, graph, piece, *anchors
    )
    if piece is None:
        return out_TH
    assert piece.out is not None  # the forward ran it
    return out_TH, piece.out
