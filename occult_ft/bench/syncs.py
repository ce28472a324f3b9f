"""Count host synchronisations: the points where Python waits for a value computed on the device.

On a GPU every such point stalls the host until the queued kernels are done (and NCCL collectives
queued behind them), so a layer that reads the device five times pays five round trips whatever its
size. On CPU nothing stalls, but the same calls are there, so they can be counted on CPU in a test and
in the benchmarks: `HostSyncCounter` patches, while it is active, every Python-level entry point that
needs a device value on the host:

    Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ / numpy
    nonzero, unique, unique_consecutive, masked_select, bincount (its size is data-dependent)
    indexing or index assignment with a boolean mask (x[mask], x[mask] = v, index_put_ with a mask)
    repeat_interleave with tensor repeats and no output_size

and counts the calls, with where they came from (`by_site`). Calls nested inside a counted call are
not counted again. `torch.cuda.set_sync_debug_mode("error")` is the GPU-side check of the same thing
(tests/test_gpu.py uses it).

Shape legend: none (counts only).
"""

from __future__ import annotations

import collections
import sys
import traceback

import torch

__all__ = ["HostSyncCounter"]

_METHODS: tuple[str, ...] = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "numpy",
    "nonzero",
    "unique",
)
_METHODS += ("unique_consecutive", "masked_select", "bincount")
_FUNCTIONS = ("nonzero", "unique", "unique_consecutive", "masked_select", "bincount")


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter:
    """Context manager counting host synchronisations (see the module docstring).

    Attributes:
        count: synchronisations seen.
        by_site: "file:line function" of the first caller outside torch -> count.
        enabled: count only while True (e.g. toggled by forward hooks around the MoE blocks).
    """

    def __init__(self, keep_sites: bool = True):
        self.enabled = True
        self.count = 0
        self.keep_sites = keep_sites
        self.by_site: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[object, str, object]] = []
        self._depth = 0

    def reset(self) -> None:
        self.count = 0
        self.by_site.clear()

    def _record(self) -> None:
        self.count += 1
        if not self.keep_sites:
            return
        for frame in reversed(traceback.extract_stack(sys._getframe(2), limit=12)):
            if "/torch/" not in frame.filename and not frame.filename.endswith("syncs.py"):
                self.by_site[f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"] += 1
                break

    def _wrap(self, fn, counts=lambda *a, **k: True):
        counter = self

        def wrapper(*args, **kwargs):
            if counter._depth == 0 and counter.enabled and counts(*args, **kwargs):
                counter._record()
            counter._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth -= 1

        return wrapper

    def _patch(self, owner, name: str, counts=None) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        self._saved.append((owner, name, fn))
        setattr(owner, name, self._wrap(fn, counts) if counts else self._wrap(fn))

    def __enter__(self) -> HostSyncCounter:
        for name in _METHODS:
            self._patch(torch.Tensor, name)
        for name in _FUNCTIONS:
            self._patch(torch, name)
        self._patch(torch.Tensor, "__getitem__", lambda self_, index: _has_mask(index))
        self._patch(torch.Tensor, "__setitem__", lambda self_, index, value: _has_mask(index))
        for name in ("index_put_", "index_put"):
            self._patch(torch.Tensor, name, lambda self_, indices, *a, **k: _has_mask(tuple(indices)))

        def repeats_need_sync(*args, **kwargs):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None

        self._patch(torch, "repeat_interleave", repeats_need_sync)
        self._patch(torch.Tensor, "repeat_interleave", repeats_need_sync)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
