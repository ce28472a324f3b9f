"""Overlap: a MoE layer's tokens in chunks, the exchange of one chunk hidden behind another's experts.

    pipelined_moe_forward   `moe_forward` in n chunks, for exchanges whose `pipelinable` is true
    _PipelinedMoE           the layer as one autograd function (forward and backward pipelined)

The chunk count is `ExpertShard.chunks` (`OccultConfig.exchange_chunks`): 1 turns this off.

Shape legend: T tokens, K top-k, H hidden, J slots per row, S rows sent, R rows received, n chunks.
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import exchange_meta, start_exchange
from .exchange import Exchange, largest_exact_integer, moe_forward, read_counts
from .local import local_experts_forward, num_local_experts
from .plan import DispatchLayout, layout_from_plan
from .reference import expert_weights

__all__ = ["pipelined_moe_forward"]


class _Chunk:
    """One chunk's state between forward and backward; fields are filled as the schedule reaches them."""

    __slots__ = (
        "lo",
        "hi",
        "layout",
        "recv",
        "counts",
        "h_leaf",
        "w_leaf",
        "send_x",
        "send_w",
        "x_leaf",
        "rw_leaf",
        "out",
    )
    lo: int  # the chunk's tokens are [lo, hi) of the layer's T
    hi: int
    layout: DispatchLayout
    recv: tuple[int, ...]  # rows received from each source rank
    counts: tuple[int, ...]  # received rows per local expert
    h_leaf: torch.Tensor  # (T_c, H) detached hidden states, the leaf of this chunk's dispatch graph
    w_leaf: torch.Tensor  # (T_c, K) detached gate weights
    send_x: torch.Tensor  # (S, H) rows gathered for sending (kept in the graph for backward)
    send_w: torch.Tensor  # (S, K)
    x_leaf: torch.Tensor | None  # (R, H) received rows; None once backward has used them
    rw_leaf: torch.Tensor | None  # (R, K)
    out: torch.Tensor | None  # (R, H) the local experts' output, kept for backward when grad is on


# Schedule, with asynchronous collectives (`comm.start_exchange`: gloo runs them on the process
# group's own threads, NCCL on its own stream):
#     forward:   dispatch(0) | dispatch(1) + experts(0) | combine(0) + dispatch(2) + experts(1) | ...
#     backward:  combine^T(c + 1) in flight while experts^T(c) runs, then dispatch^T(c)
# All chunks' counts travel in one count exchange, so chunking adds no host synchronisation.
# Autograd: forward builds each chunk's local-expert graph on detached leaves (under enable_grad) and
# keeps it; backward feeds each chunk's returned gradient into that graph (`torch.autograd.backward`,
# as reentrant checkpointing does), which accumulates the expert parameters' .grad and gives the
# received rows' gradients, sends them home and maps them onto the hidden states and gate weights.
# Hence, as with reentrant checkpointing, `torch.autograd.grad(..., inputs=expert parameters)` does not
# see the expert gradients; `backward()` does. Results equal the unchunked layer to float rounding.
class _PipelinedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weights_TK, topk_ids_TK, experts, exchange, chunks, backend, graph, *anchors):
        group, p = exchange.group, exchange.layout.experts_per_device
        # chunk boundaries as tensor_split cuts T (sizes differ by at most 1; a chunk may be empty)
        bounds = [0]
        for piece in torch.arange(hidden_TH.shape[0]).tensor_split(chunks):
            bounds.append(bounds[-1] + len(piece))
        states = []
        with torch.enable_grad() if graph else torch.no_grad():
            plans = []
            for c in range(chunks):
                st = _Chunk()
                st.lo, st.hi = bounds[c], bounds[c + 1]
                # detached leaves: backward differentiates each chunk's own small graph, not the caller's
                st.h_leaf = hidden_TH[st.lo : st.hi].detach().requires_grad_(graph)
                st.w_leaf = weights_TK[st.lo : st.hi].detach().requires_grad_(graph)
                plans.append(exchange.plan(topk_ids_TK[st.lo : st.hi], st.w_leaf))
                states.append(st)
            # every chunk's (D, P + 2) count table side by side: one count exchange for all chunks
            meta_DX = torch.cat([plan.meta_DC for plan in plans], dim=1)
            sends, recvs, counts = read_counts(plans, exchange_meta(meta_DX, group))  # the one sync
            # the local ids ride as columns of the hidden rows when exact there (as in exchange.send_rows)
            ids_dtype = hidden_TH.dtype if p <= largest_exact_integer(hidden_TH.dtype) else torch.long
            pending = []
            for c, st in enumerate(states):
                st.layout = layout_from_plan(plans[c], sends[c])
                st.recv, st.counts = recvs[c], counts[c]
                # kept in the graph: backward maps the returned row gradients onto the leaves through them
                st.send_x = st.h_leaf[st.layout.send_token_idx_S]
                st.send_w = st.layout.send_weights_SK

            def start_dispatch(st):
                ids = st.layout.send_local_ids_SK.to(ids_dtype)
                tensors = [st.send_x.detach(), st.send_w.detach(), ids]
                return start_exchange(tensors, st.layout.send_splits, st.recv, group)

            out_TH = hidden_TH.new_zeros(
                hidden_TH.shape[0],
                hidden_TH.shape[1],
                dtype=torch.promote_types(hidden_TH.dtype, torch.float32),
            )
            inflight = start_dispatch(states[0])
            for c, st in enumerate(states):
                recv_x, recv_w, recv_ids = inflight.wait()
                if c + 1 < chunks:
                    inflight = start_dispatch(states[c + 1])  # in flight while chunk c computes
                # received rows are leaves of the chunk's expert graph; their .grad is what goes home
                st.x_leaf = recv_x.requires_grad_(graph)
                st.rw_leaf = recv_w.requires_grad_(graph)
                out_RH = local_experts_forward(
                    st.x_leaf, recv_ids.round().long() if recv_ids.is_floating_point() else recv_ids,
                    st.rw_leaf, experts, backend, counts=st.counts,
                )  # fmt: skip
                st.out = out_RH if graph else None
                pending.append(start_exchange([out_RH.detach()], st.recv, st.layout.send_splits, group))
            # the combines: each chunk's rows come home and are summed per token in at least fp32
            for st, back in zip(states, pending):
                (back_SH,) = back.wait()
                # each chunk's send_token_idx_S is local to the chunk: offset by writing into out_TH[lo:hi]
                out_TH[st.lo : st.hi].index_add_(0, st.layout.send_token_idx_S, back_SH.to(out_TH.dtype))
        ctx.states, ctx.group, ctx.chunks, ctx.anchors = states, group, chunks, len(anchors)
        return out_TH.to(hidden_TH.dtype)

    @staticmethod
    def backward(ctx, grad_out_TH):
        states, group = ctx.states, ctx.group
        grad_out_TH = grad_out_TH.contiguous()

        # the combine's transpose: each sent row's token gradient goes back to the expert's device
        def start_reverse_combine(st):
            # grad_out_TH[lo:hi][send_token_idx_S]: the gradient of each row the chunk sent (a token per row)
            g_SH = grad_out_TH[st.lo : st.hi][st.layout.send_token_idx_S].to(st.out.dtype)
            return start_exchange([g_SH], st.layout.send_splits, st.recv, group)

        returning = []
        inflight = start_reverse_combine(states[0])
        for c, st in enumerate(states):
            (g_out_RH,) = inflight.wait()
            if c + 1 < ctx.chunks:
                inflight = start_reverse_combine(states[c + 1])
            with torch.enable_grad():  # expert parameters' .grad accumulate here; a graph the chunks share
                # (PEFT's cached LoRA weight) must survive until the last chunk has gone through it
                torch.autograd.backward(st.out, g_out_RH, retain_graph=c + 1 < ctx.chunks)
            # zeros where nothing flowed, so every rank sends the same tensors and the collectives pair up
            g_x = st.x_leaf.grad if st.x_leaf.grad is not None else torch.zeros_like(st.x_leaf)
            g_w = st.rw_leaf.grad if st.rw_leaf.grad is not None else torch.zeros_like(st.rw_leaf)
            returning.append(start_exchange([g_x, g_w], st.recv, st.layout.send_splits, group))
            st.out = st.x_leaf = st.rw_leaf = None
        grad_h = torch.zeros_like(grad_out_TH)
        grad_w = None
        pieces_w = []
        for st, back in zip(states, returning):
            g_send_x, g_send_w = back.wait()
            # dispatch's transpose: the sent rows' gradients through the gather onto the chunk's leaves
            with torch.enable_grad():
                g_h, g_w = torch.autograd.grad(
                    [st.send_x, st.send_w], [st.h_leaf, st.w_leaf], [g_send_x, g_send_w], allow_unused=True
                )
            if g_h is not None:
                # the chunk's tokens are rows lo..hi of the layer: its gradient lands in that slice
                grad_h[st.lo : st.hi] = g_h
            pieces_w.append(g_w if g_w is not None else torch.zeros_like(st.w_leaf))
        grad_w = torch.cat(pieces_w) if pieces_w else None
        ctx.states = None
        # one gradient per forward input: hidden, weights; None for ids, experts, exchange, chunks, backend,
        # graph, and the anchors (their gradients already accumulated in backward)
        return (grad_h, grad_w, None, None, None, None, None, None, *([None] * ctx.anchors))


def pipelined_moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: nn.Module,
    exchange: Exchange,
    chunks: int,
    backend: str = "auto",
) -> torch.Tensor:
    """`moe_forward` in `chunks` pipelined chunks (the schedule is described above `_PipelinedMoE`); same result.

    Args:
        hidden_TH: (T, H); topk_ids_TK: (T, K) global expert ids; weights_TK: (T, K) gate weights.
        experts: this rank's P contiguous experts. exchange: one whose `pipelinable` is true (a
            `FlatExchange` in exact mode or a `PerExpertExchange`). chunks: n >= 1, the same on every rank (chunks may be empty).
        backend: grouped matmul backend of the local compute.

    Returns:
        (T, H) in hidden_TH.dtype.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive integer")
    if chunks == 1:
        return moe_forward(hidden_TH, topk_ids_TK, weights_TK, experts, exchange, backend)
    if not exchange.pipelinable:
        raise ValueError(
            f"chunks={chunks} pipelines one-stage exact exchanges (flat without a capacity, per_expert); "
            f"this {exchange.name} exchange is not one: use chunks=1"
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
    return _PipelinedMoE.apply(
        hidden_TH, weights_TK, topk_ids_TK, experts, exchange, chunks, backend, graph, *anchors
    )
