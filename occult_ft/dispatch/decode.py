"""Expert-parallel generation: the exact exchange for prefill, the capacity-bounded one for decode.

A prefill forward routes many tokens: the exact flat exchange reads its row counts on the host once per
layer and sends only the rows it needs. A decode step routes one token per sequence: the shapes are
tiny and that host read is most of a layer's cost, so the step runs the flat exchange's
capacity-bounded mode instead (`FlatExchange(capacity=C)`: no host read; every rank sends D x C rows,
padded). C = the largest batch of any rank is a bound no routing can overflow, since the flat exchange
sends a token at most once to each device.

`DecodeCapacity` is a forward pre-hook on the causal LM that picks the mode per forward, from host-side
facts alone (so every rank picks alike when every rank makes the same calls):

* a forward whose cache already holds tokens and which feeds one token per sequence is a decode
  step: capacity C;
* every other forward (prefill, a forward without cache) is exact; it also takes the largest batch
  over the expert-parallel group (one small all-reduce per prefill), which is C for the decode steps
  that follow (`capacity="auto"`), or checks a given C against it.

Shape legend: B sequences per rank, S tokens per sequence in one forward, D devices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .experts_impl import configure_exchange

__all__ = ["DecodeCapacity", "enable_decode_capacity"]


class DecodeCapacity:
    """Forward pre-hook switching the flat exchange between exact (prefill) and capacity (decode).

    Args:
        model: the sharded causal LM (its layers' `ExpertShard`s are updated through
            `configure_exchange`).
        capacity: "auto" (C = the largest batch of any rank, taken at each prefill) or C rows per device
            (refused at prefill when below that batch).
        group: the expert-parallel process group.

    Attributes:
        rows: the C of the decode steps after the last prefill (None before the first one).
        current: the capacity the layers run with now (None: exact).
        decode_forwards: forwards run as decode steps so far.
    """

    def __init__(self, model: nn.Module, capacity: int | str, group: dist.ProcessGroup | None = None):
        self.model = model
        self.capacity = capacity
        self.group = group
        self.rows: int | None = None
        self.current: int | None = None
        self.decode_forwards = 0

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        # input_ids by keyword or as the first positional argument; else inputs_embeds, whose leading dims are (B, S)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            return None
        # (B, S) ids or (B, S, H) embeddings: B sequences, S tokens each in this forward
        batch, per_row = int(ids.shape[0]), int(ids.shape[1]) if ids.dim() > 1 else 1
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.2x names it `cache`
        # a decode step: one new token per sequence on a non-empty cache, after a prefill has set C
        decoding = per_row == 1 and cache is not None and cache.get_seq_length() > 0 and self.rows is not None
        if decoding:
            # C >= the largest batch of any rank: each rank sends at most B <= C rows to each device
            self._set(self.rows)
            self.decode_forwards += 1
            return None
        self._set(None)
        # prefill (or a forward without cache): exact exchange, and the C for the decode steps that follow
        self.rows = self._decode_rows(batch, ids.device)
        return None

    def _decode_rows(self, batch: int, device: torch.device) -> int:
        """C for the decode steps after this prefill (collective: the largest batch of the group)."""
        largest = batch
        if dist.is_available() and dist.is_initialized():
            found = torch.tensor([batch], dtype=torch.int64, device=device)
            # MAX over the group: every rank gets the same C, so the padded splits agree on every rank
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
            largest = int(found.item())
        if self.capacity == "auto":
            return largest
        assert isinstance(self.capacity, int)
        if self.capacity < largest:
            raise ValueError(
                f"exchange_capacity={self.capacity} rows per device is below the batch of {largest} sequences "
                f"a rank decodes, so rows could be lost; set it to at least {largest}, 'auto', or None"
            )
        return self.capacity

    def _set(self, capacity: int | None) -> None:
        # configure_exchange touches every layer's record: only when the mode actually changes
        if capacity != self.current:
            configure_exchange(self.model, capacity=capacity)
            self.current = capacity


def enable_decode_capacity(
    model: nn.Module, capacity: int | str, group: dist.ProcessGroup | None = None
) -> DecodeCapacity:
    """Install `DecodeCapacity` on `model` (a sharded causal LM running the flat exchange); returns it,
    also kept as `model.occult_decode_capacity`."""
    hook = DecodeCapacity(model, capacity, group)
    model.register_forward_pre_hook(hook, with_kwargs=True)
    model.occult_decode_capacity = hook  # type: ignore[assignment]
    return hook
