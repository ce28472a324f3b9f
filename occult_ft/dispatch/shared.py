"""Shared experts beside the combine: a MoE block's always-on MLP computed while the layer's combine
travels, instead of after it, and its backward while the dispatch's transposes travel
(`pipeline._SharedPiece`, `pipeline._Homecoming`).

    SharedBeside                 what `attach_shared` leaves on a layer (`experts.occult_beside`)
    attach_shared / detach_shared   install it on every sharded layer with a shared MLP / remove it

The experts kernel sees only (tokens, expert ids, gate weights); the shared MLP belongs to each
family's MoE block, which calls it itself. So the kernel computes the shared MLP on its own input
inside the pipeline (`pipelined_moe_forward(shared=...)`), and hands the result to the block's next
call of that MLP on the same tensor: `SharedBeside.forward` replaces the MLP's `forward` on the
instance (as accelerate's hooks do) and returns the kernel's output when the call's input is the
kernel's input (same storage, size and version: the same values), else runs the MLP. Families whose
block calls the shared MLP after the experts (DeepSeek-V2/V3, GLM-4-MoE: `experts(x) +
shared_experts(residuals)`) gain the overlap; where the block calls it first (Qwen-MoE), the kernel
sees that it already ran on this input and does not run it again: nothing moves, nothing changes.
Either way the result is the stock block's: the same MLP on the same values, one call.

Nothing outlives one forward of the block: a pre-hook and a hook on the block clear what the kernel
left, so an output is never handed to a later call whose input merely reuses the memory.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import base_experts, find_moe_layers

__all__ = ["SharedBeside", "attach_shared", "detach_shared"]


_Seen = tuple[torch.Tensor, int]
"""A tensor and its write version when it was seen."""


def _seen(x: torch.Tensor) -> _Seen:
    return x, x._version


def _same_values(seen: _Seen, b: torch.Tensor) -> bool:
    """Whether b holds the values the seen tensor had, token for token: the same contiguous memory,
    element count and dtype, and no write since (views of one tensor share its version counter, so an
    in-place write through either moves b's version past the one recorded)."""
    a, version = seen
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.numel() == b.numel()
        and a.shape[-1] == b.shape[-1]
        and a.data_ptr() == b.data_ptr()
        and b._version == version
        and a.is_contiguous()  # then both list the same tokens in the same order
        and b.is_contiguous()
    )


class SharedBeside:
    """One layer's shared MLP, run by the experts kernel beside its combine.

    Attributes:
        module: the block's shared MLP (its `forward` is `self.forward` while attached).
        served: calls of the block answered with the kernel's output (the overlap happened).
        ran_first: kernel calls that found the MLP already run on their input (the block calls it first).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        # the forward the instance attribute hides: the class's, or another wrapper's (accelerate's hooks)
        self._original = module.forward
        self._own_attribute = "forward" in module.__dict__
        self.hooks: tuple = ()
        self._ready: tuple[_Seen, torch.Tensor] | None = None  # (the kernel's input, the output)
        self._ran_on: _Seen | None = None  # the input the MLP last ran on in this block forward
        self.served = 0
        self.ran_first = 0

    def wanted(self, hidden_TH: torch.Tensor) -> bool:
        """Whether the kernel should run the MLP on `hidden_TH`: not if the block already did."""
        if self._ran_on is not None and _same_values(self._ran_on, hidden_TH):
            self.ran_first += 1
            return False
        return True

    def offer(self, hidden_TH: torch.Tensor, out_TO: torch.Tensor) -> None:
        """The kernel's output for `hidden_TH`, for the block's next call on the same values."""
        self._ready = (_seen(hidden_TH), out_TO)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        ready = self._ready
        if ready is not None and not args and not kwargs and _same_values(ready[0], x):
            self._ready = None
            self.served += 1
            out = ready[1]  # (T, O) over the block's (..., H) tokens in the same order
            return out.view(*x.shape[:-1], out.shape[-1])
        out = self._original(x, *args, **kwargs)
        self._ran_on = _seen(x)
        return out

    def clear(self, *_args, **_kwargs) -> None:
        self._ready = self._ran_on = None


def attach_shared(model: nn.Module) -> int:
    """Install `SharedBeside` on every sharded MoE layer whose block has a shared MLP (idempotent).

    Returns:
        the number of layers that have one.
    """
    count = 0
    for layer in find_moe_layers(model):
        experts = base_experts(layer.experts)
        attr = layer.arch.shared_mlp_attr
        module = getattr(layer.block, attr, None) if attr else None
        if not isinstance(module, nn.Module) or getattr(experts, "occult_shard", None) is None:
            continue
        count += 1
        if getattr(experts, "occult_beside", None) is not None:
            continue
        beside = SharedBeside(module)
        module.forward = beside.forward
        # the block's forward bounds what the kernel leaves: cleared on entry and on exit
        beside.hooks = (
            layer.block.register_forward_pre_hook(beside.clear),
            layer.block.register_forward_hook(beside.clear),
        )
        # not a Module: no state_dict entry, no submodule
        experts.occult_beside = beside  # type: ignore[assignment]
    return count


def detach_shared(model: nn.Module) -> None:
    """Undo `attach_shared`: every shared MLP runs its own forward again."""
    for layer in find_moe_layers(model):
        experts = base_experts(layer.experts)
        beside: SharedBeside | None = getattr(experts, "occult_beside", None)
        if beside is None:
            continue
        if beside._own_attribute:  # another wrapper's forward, as it was
            beside.module.forward = beside._original
        else:  # the class's forward shows through again
            del beside.module.forward
        for hook in beside.hooks:
            hook.remove()
        beside.clear()
        del experts.occult_beside
