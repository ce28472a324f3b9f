"""The input embedding's gradient, reduced over the processes beside DDP's buckets, mostly hidden.

Backward reaches the input embedding last, so under DDP its bucket's all-reduce starts when backward
has ended, and nothing hides it: with per-layer buckets (`replicated_bucket_cap_mb`) it is the dense
all-reduce left exposed in an expert-parallel step (docs/cluster.md). Two facts make most of it
movable:

- under gradient accumulation (K micro-batches per optimizer step) the sum of the first K - 1
  micro-batches' gradients is final when the last micro-batch starts, so its all-reduce can travel
  during the whole last micro-batch;
- one micro-batch's gradient of a V x H table is a scatter-add of its N rows (the gradient at the
  embedding's output, one per token): gathering every rank's (token id, row) pairs receives
  (W - 1) N H values per rank, the ring all-reduce of the dense table 2 (W - 1) / W V H. A rank first
  sums the rows of each token it holds more than once (`sum_by_id`), so N counts distinct tokens,
  which text repeats often. Fine-tuning micro-batches hold far fewer tokens than the vocabulary
  (N W < 2 V), so the rows are the smaller message (`gather_is_cheaper`).

`EmbeddingGradientReducer` does both and leaves in `.grad` what DDP would have: the sum over ranks of
every rank's accumulated gradient, / W (the same terms, added in another order), with the same bits on
every rank, as an all-reduce leaves them: every rank adds the gathered rows in one order (`add_rows`),
so the replicas never drift apart. The embedding is left
out of DDP (`reducible_embedding` says which one may be; a table tied to the LM head, a scaled or
otherwise customised embedding module, or a frozen one stays with DDP).

Collectives, on a process group of its own so that their order never meets DDP's: per optimizer step
(K > 1) one all-reduce started before the last micro-batch, then after its backward one small
all-gather of the row counts (one host read per step) and the rows' gathers or the dense all-reduce.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["EmbeddingGradientReducer", "add_rows", "gather_is_cheaper", "reducible_embedding", "sum_by_id"]

_ID_BYTES = 8  # an int64 token id sent beside each row


def gather_is_cheaper(rows: int, world: int, vocab: int, hidden: int, value_bytes: int) -> bool:
    """Whether gathering `rows` (the most any rank holds) gradient rows and their ids from each of `world`
    ranks moves fewer bytes into a rank than a ring all-reduce of the dense `vocab` x `hidden` table."""
    gathered = (world - 1) * rows * (hidden * value_bytes + _ID_BYTES)
    ring = 2 * (world - 1) * vocab * hidden * value_bytes / world
    return gathered < ring


def reducible_embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """(name in `model.named_parameters()`, module) of the input embedding whose gradient
    `EmbeddingGradientReducer` can reduce: a plain `nn.Embedding` (not a subclass, which may scale or
    otherwise change its output), trainable, dense, without max_norm or scale_grad_by_freq, and whose
    table no other module holds (an LM head tied to it adds a dense gradient of its own). None otherwise."""
    base = getattr(model, "get_base_model", lambda: model)()  # a PEFT model: the model below it
    getter = getattr(base, "get_input_embeddings", None)
    module = getter() if callable(getter) else None
    if type(module) is not nn.Embedding:
        return None
    weight = module.weight
    if not weight.requires_grad or module.sparse or module.max_norm is not None or module.scale_grad_by_freq:
        return None
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]  # tied: several
    if len(names) != 1:
        return None
    return names[0], module


def sum_by_id(ids_M: torch.Tensor, rows_MH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_U, sums_UH): each id of `ids_M` once, ascending, with the sum of its rows taken in their given
    order (a stable sort, then one segment sum per id), so the same inputs give the same bits on any
    device and run. `rows_MH[m]` belongs to `ids_M[m]`; an id may repeat."""
    if ids_M.numel() == 0:
        return ids_M, rows_MH
    sorted_M, order_M = torch.sort(ids_M, stable=True)
    ids_U, counts_U = torch.unique_consecutive(sorted_M, return_counts=True)
    return ids_U, torch.segment_reduce(rows_MH[order_M], "sum", lengths=counts_U, axis=0)


def add_rows(table_VH: torch.Tensor, ids_M: torch.Tensor, rows_MH: torch.Tensor) -> torch.Tensor:
    """`table_VH[ids_M[m]] += rows_MH[m]` for every m (an id may repeat), in place, and the same bits on
    any device and run: each id's rows are summed first (`sum_by_id`) and added once. `index_add_` with
    repeated ids adds them with atomics on CUDA, in an order that may differ between ranks."""
    ids_U, sums_UH = sum_by_id(ids_M, rows_MH)
    return table_VH.index_add_(0, ids_U, sums_UH.to(table_VH.dtype))


class EmbeddingGradientReducer:
    """Reduces one input embedding's gradient over every process (see the module docstring).

    Per micro-batch, on every rank: `before(last)` before its forward and `after(last)` after its
    backward, where `last` says it is the optimizer step's last micro-batch (accelerate's
    `sync_gradients`). After `after(True)` the table's `.grad` is the average over ranks, as DDP leaves
    it; before that, `.grad` holds only this rank's part.

    Args:
        embedding: the input embedding (`reducible_embedding`), left out of DDP.
        group: the process group to reduce over (all ranks); default: a new one over all ranks (a
            collective call: every rank builds its reducer at the same point).
    """

    def __init__(self, embedding: nn.Embedding, group: Any = None):
        self.embedding = embedding
        self.group = group if group is not None else dist.new_group(list(range(dist.get_world_size())))
        self.world = dist.get_world_size(self.group)
        self._earlier = 0  # micro-batches of this optimizer step whose backward has run
        self._armed = False
        self._pending: tuple[Any, torch.Tensor] | None = None  # (work, the earlier micro-batches' sum)
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids_N, grad_NH) of the last one
        self._unseen = False  # the last micro-batch called the embedding in a way whose ids were not seen
        self._hook = embedding.register_forward_hook(self._on_forward)
        self.last_mode: str | None = None  # "rows" or "dense": how the last step's last micro-batch went

    # ---- hooks --------------------------------------------------------------------------------------
    def _on_forward(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self._armed or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        if not args or not isinstance(args[0], torch.Tensor):  # called by keyword: rows not seen
            self._unseen = True
            return
        ids = args[0].detach()

        def keep(grad: torch.Tensor) -> None:
            self._rows.append((ids.reshape(-1), grad.detach().reshape(-1, grad.shape[-1])))

        output.register_hook(keep)

    # ---- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def before(self, last: bool) -> None:
        """Before a micro-batch's forward. Before the last one, the gradient accumulated so far leaves
        `.grad` and its all-reduce starts (when earlier micro-batches ran: the same on every rank)."""
        if not last:
            return
        self._armed, self._rows, self._unseen = True, [], False
        if self._earlier:
            weight = self.embedding.weight
            earlier = weight.grad if weight.grad is not None else torch.zeros_like(weight)
            weight.grad = None
            work = dist.all_reduce(earlier, group=self.group, async_op=True)
            self._pending = (work, earlier)

    @torch.no_grad()
    def after(self, last: bool) -> None:
        """After a micro-batch's backward; after the last one, `.grad` becomes the average over ranks, the
        same bits on every rank (as DDP's all-reduce leaves it: the replicas stay identical)."""
        if not last:
            self._earlier += 1
            return
        weight = self.embedding.weight
        local = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        total = self._last_micro_batch_summed(local)
        if self._pending is not None:
            work, earlier = self._pending
            work.wait()
            total.add_(earlier)
        total.div_(self.world)
        weight.grad = total
        self._earlier, self._armed, self._pending, self._rows, self._unseen = 0, False, None, [], False

    def _last_micro_batch_summed(self, local_VH: torch.Tensor) -> torch.Tensor:
        """The last micro-batch's gradient summed over ranks: every rank's rows gathered and added in one
        order, or the dense tables all-reduced, whichever moves fewer bytes (decided alike everywhere)."""
        device = local_VH.device
        if self._rows:
            ids_N = torch.cat([ids for ids, _ in self._rows]).to(device)
            rows_NH = torch.cat([rows for _, rows in self._rows]).to(local_VH.dtype)
        else:
            ids_N = torch.empty(0, dtype=torch.long, device=device)
            rows_NH = local_VH.new_empty(0, local_VH.shape[1])
        if self.embedding.padding_idx is not None:  # nn.Embedding gives its padding row no gradient
            keep_N = ids_N != self.embedding.padding_idx
            ids_N, rows_NH = ids_N[keep_N], rows_NH[keep_N]
        # one row per distinct token: text repeats its tokens, and every repeat is a row not sent
        ids_N, rows_NH = sum_by_id(ids_N, rows_NH)
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world)]
        mine = -1 if self._unseen else ids_N.numel()  # -1: this rank cannot send rows
        dist.all_gather(counts, torch.tensor([mine], device=device), group=self.group)
        n_of = [int(c) for c in counts]  # the step's one host read
        vocab, hidden = local_VH.shape
        if min(n_of) < 0 or not gather_is_cheaper(
            max(n_of), self.world, vocab, hidden, local_VH.element_size()
        ):
            self.last_mode = "dense"
            dist.all_reduce(local_VH, group=self.group)
            return local_VH
        self.last_mode = "rows"
        n = max(n_of)
        ids_pad = torch.full((n,), -1, dtype=torch.long, device=device)
        ids_pad[: ids_N.numel()] = ids_N
        rows_pad = rows_NH.new_zeros(n, hidden)
        rows_pad[: rows_NH.shape[0]] = rows_NH
        all_ids = [torch.empty_like(ids_pad) for _ in range(self.world)]
        all_rows = [torch.empty_like(rows_pad) for _ in range(self.world)]
        works = [
            dist.all_gather(all_ids, ids_pad, group=self.group, async_op=True),
            dist.all_gather(all_rows, rows_pad, group=self.group, async_op=True),
        ]
        for work in works:
            work.wait()
        ids_M = torch.cat([all_ids[r][: n_of[r]] for r in range(self.world)])
        rows_MH = torch.cat([all_rows[r][: n_of[r]] for r in range(self.world)])
        # this rank's own rows are among them: autograd's `local_VH` (another summation order) is dropped
        return add_rows(torch.zeros_like(local_VH), ids_M, rows_MH)

    def remove(self) -> None:
        """Remove the forward hook."""
        self._hook.remove()
