"""The exchange of one MoE layer, per backend, as each library runs it on one rank (inside a worker).

Every backend runs on the same tokens (`hidden_TH`) and routing (`topk_ids_TK`, `weights_TK`) with
identity experts: `run()` is the layer's forward *dispatch + combine* and nothing else; whatever a backend
derives from the routing on the way (sorting, layouts, dense buffers, split sizes) is part of `run()`.

    deepspeed_classic         DeepSpeed's classic MoE (`sharded_moe`): its `topkgating` on the given routing
                              (capacity factor 1.0, min_capacity 4), the dense [E, C, H] buffer, two
                              equal-split `_AllToAll`; without deepspeed, `CapacityReplicaRun`
    deepspeed_classic_nodrop  the same with `drop_tokens=False` (C = largest expert load, all-reduced)
    per_expert                one row per (token, expert) (transformers' native EP, AutoEP, Tutel and
                              MegaBlocks send that) through `occult_ft.dispatch.PerExpertExchange`
    hf_native_ep              transformers' `AllToAllEP` itself, called with identity experts
    occult_dedup[_pruneM]     `occult_ft.dispatch.FlatExchange`: one row per (token, device)
    occult_dedup_capacity     the same, capacity-bounded (C = ceil(T / D) rows to every process, padded)
    occult_two_stage[_pruneM] `occult_ft.dispatch.TwoStageExchange` (--nodes N > 1): one row per (token,
                              node) to its gateway, fanned out to the node's devices

`CollectiveClock` adds up the time (and bytes) spent inside collectives while it is active.

Shape legend: T tokens on this rank, K top-k, H hidden, E experts, D ranks, P = E / D, C capacity.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..dispatch import (
    Exchange,
    FlatExchange,
    PerExpertExchange,
    ReceivedRows,
    TwoStageExchange,
    TwoStageHandle,
)
from ..layout import ExpertLayout

__all__ = ["CollectiveClock", "BackendRun", "build_exchange", "init_deepspeed_comm"]


# CollectiveClock wraps `torch.distributed.all_to_all_single` / `all_reduce` and the collective functions
# transformers' EP module imported by name (a module-level rebind would miss those); on CUDA it
# synchronises around each collective so the time is the collective's own.
class CollectiveClock:
    """Context manager: time and input bytes of every collective called while it is active."""

    def __init__(self):
        self.seconds = 0.0
        self.bytes = 0
        self.calls = 0
        self._saved: list[tuple[object, str, object]] = []

    def reset(self) -> None:
        self.seconds, self.bytes, self.calls = 0.0, 0, 0

    def _timed(self, fn: Callable, arg_index: int, arg_name: str, functional: bool = False) -> Callable:
        clock = self

        def wrapper(*args, **kwargs):
            tensor = args[arg_index] if len(args) > arg_index else kwargs.get(arg_name)
            cuda = tensor.device if isinstance(tensor, torch.Tensor) and tensor.is_cuda else None
            if cuda is not None:
                torch.cuda.synchronize(cuda)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if functional:  # functional collectives return a tensor that completes lazily
                out = out.trigger_wait() if hasattr(out, "trigger_wait") else out
                out = torch.ops._c10d_functional.wait_tensor(out)
            elif kwargs.get("async_op") and out is not None:
                out.wait()
            if cuda is not None:
                torch.cuda.synchronize(cuda)
            clock.seconds += time.perf_counter() - start
            clock.calls += 1
            if isinstance(tensor, torch.Tensor):
                clock.bytes += tensor.numel() * tensor.element_size()
            return out

        return wrapper

    def _patch(self, owner, name: str, arg_index: int, arg_name: str, functional: bool = False) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        self._saved.append((owner, name, fn))
        setattr(owner, name, self._timed(fn, arg_index, arg_name, functional))

    def __enter__(self) -> CollectiveClock:
        self._patch(dist, "all_to_all_single", 1, "input")
        self._patch(dist, "all_reduce", 0, "tensor")
        try:
            import transformers.distributed.expert_parallel as hf_ep
        except ImportError:
            hf_ep = None  # type: ignore[assignment]
        if hf_ep is not None:
            self._patch(hf_ep, "all_to_all_single", 1, "input")
            self._patch(hf_ep, "all_to_all_single_autograd", 0, "input", functional=True)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()


class BackendRun(ABC):
    """One backend's forward dispatch + combine of one layer on this rank (what the benchmark times).

    Attributes:
        name: backend name.
        implementation: what exactly runs (library, function, settings).
        send_rows_D: rows this rank's dispatch sends to each rank (the combine sends them back); for
            the two-stage exchange, its first (inter-node) stage.
        stage2_rows_D: rows this rank sends to each rank in the second (intra-node) stage of a
            two-stage exchange; empty for one-stage backends.
        dropped_routes: (token, expert) routes the backend drops on this rank (capacity overflow).
    """

    name: str = ""
    implementation: str = ""

    def __init__(self):
        self.send_rows_D: list[int] = []
        self.stage2_rows_D: list[int] = []
        self.dropped_routes = 0

    @abstractmethod
    def run(self) -> torch.Tensor:
        """Dispatch this rank's tokens, apply identity experts, combine; returns (T, H)."""


def _contiguous_splits(counts: torch.Tensor) -> list[int]:
    return [int(c) for c in counts.tolist()]


class _IdentityExperts(nn.Module):
    """Stands in for a transformers experts module: P local experts that return their input."""

    def __init__(self, num_local_experts: int):
        super().__init__()
        self.num_experts = num_local_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class HFNativeEPRun(BackendRun):
    """transformers' `AllToAllEP` (native expert parallelism, `ep_implementation="all_to_all"`)."""

    name = "hf_native_ep"

    def __init__(self, hidden_TH, topk_ids_TK, weights_TK, num_experts: int, group, mesh):
        super().__init__()
        import transformers
        from transformers.distributed.expert_parallel import AllToAllEP

        num_devices = dist.get_world_size(group)
        self.implementation = (
            f"transformers {transformers.__version__} "
            "transformers.distributed.expert_parallel.AllToAllEP, identity experts"
        )
        self.impl = AllToAllEP(_IdentityExperts(num_experts // num_devices), mesh["ep"], mesh["tp"])
        self.args = (hidden_TH, topk_ids_TK, weights_TK)
        counts_E = torch.bincount(topk_ids_TK.reshape(-1), minlength=num_experts)
        self.send_rows_D = _contiguous_splits(counts_E.view(num_devices, -1).sum(dim=1))

    def run(self) -> torch.Tensor:
        return self.impl(*self.args)


class DeepSpeedClassicRun(BackendRun):
    """DeepSpeed's classic MoE dispatch: dense [E, C, H] buffer, equal-split all-to-all both ways."""

    def __init__(
        self,
        hidden_TH,
        topk_ids_TK,
        weights_TK,
        num_experts: int,
        group,
        capacity_factor: float | None,
        min_capacity: int,
    ):
        super().__init__()
        import deepspeed
        from deepspeed.moe import sharded_moe as sm

        self.sm, self.group, self.hidden_TH = sm, group, hidden_TH
        self.name = "deepspeed_classic" if capacity_factor is not None else "deepspeed_classic_nodrop"
        setting = f"capacity_factor={capacity_factor}" if capacity_factor is not None else "drop_tokens=False"
        self.implementation = (
            f"deepspeed {deepspeed.__version__} sharded_moe.topkgating({setting}, "
            f"min_capacity={min_capacity}) + _sparse_encode/_AllToAll x2/_sparse_decode"
        )
        num_tokens, k = topk_ids_TK.shape
        # Router logits whose softmax top-k is exactly the given experts, with the given weights as
        # relative gate values (DeepSpeed's "probs" drop policy keeps the highest-gate routes).
        logits_TE = torch.full(
            (num_tokens, num_experts), -1.0e4, dtype=torch.float32, device=hidden_TH.device
        )
        logits_TE.scatter_(1, topk_ids_TK, weights_TK.float().clamp_min(1e-6).log())
        gate_out = sm.topkgating(
            logits_TE,
            k,
            capacity_factor if capacity_factor is not None else 0.0,
            min_capacity,
            drop_tokens=capacity_factor is not None,
            ep_group=group,
            sparse_routes=True,
        )
        _, capacity, _, indices_KT, locations_KT, gates_KT, counts_E = gate_out
        self.capacity, self.num_experts = int(capacity), num_experts
        kept_KT = indices_KT >= 0
        chosen_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=logits_TE.device)
        chosen_TE.scatter_(1, topk_ids_TK, True)
        tok_KT = torch.arange(num_tokens, device=logits_TE.device).expand_as(indices_KT)
        if not bool(chosen_TE[tok_KT[kept_KT], indices_KT[kept_KT].long()].all()):
            raise RuntimeError("DeepSpeed's gating picked experts outside the given routing")
        self.dropped_routes = int((~kept_KT).sum())
        self.slots_KT = sm._route_slots(indices_KT, locations_KT, num_experts, self.capacity)
        self.gates_KT = gates_KT
        self.max_count = counts_E.max().reshape(1) if capacity_factor is None else None
        d = dist.get_world_size(group)
        self.send_rows_D = [self.capacity * (num_experts // d)] * d

    def run(self) -> torch.Tensor:
        sm = self.sm
        if self.max_count is not None:  # drop_tokens=False: DeepSpeed all-reduces the capacity each forward
            dist.all_reduce(self.max_count.clone(), op=dist.ReduceOp.MAX, group=self.group)
        buf_ECH = sm._sparse_encode(self.hidden_TH, self.slots_KT, self.num_experts, self.capacity)
        recv_ECH = sm._AllToAll.apply(self.group, buf_ECH)
        back_ECH = sm._AllToAll.apply(self.group, recv_ECH)
        return sm._sparse_decode(
            back_ECH.reshape(-1, back_ECH.shape[-1]), self.slots_KT, self.gates_KT, self.hidden_TH.shape[0]
        )


# Without an importable deepspeed (e.g. on a GPU machine without it) the two DeepSpeed rows fall back to
# this replica: the same buffer and capacity formula, "position" drop policy instead of "probs" (the same
# number of dropped routes), the same equal-split all-to-alls; its `implementation` says so.
class CapacityReplicaRun(BackendRun):
    """DeepSpeed classic's exchange shape when deepspeed is not importable: the same [E, C, H] buffer
    (same capacity formula), built here, moved by two equal-split `all_to_all_single` calls."""

    def __init__(
        self,
        hidden_TH,
        topk_ids_TK,
        weights_TK,
        num_experts: int,
        group,
        capacity_factor: float | None,
        min_capacity: int,
        reason: str,
    ):
        super().__init__()
        import math

        self.group, self.hidden_TH, self.weights_TK = group, hidden_TH, weights_TK
        self.name = "deepspeed_classic" if capacity_factor is not None else "deepspeed_classic_nodrop"
        self.implementation = f"occult_ft replica of DeepSpeed's [E, C, H] buffer ({reason})"
        num_tokens, k = topk_ids_TK.shape
        d = dist.get_world_size(group)
        counts_E = torch.bincount(topk_ids_TK.reshape(-1), minlength=num_experts)
        if capacity_factor is None:
            top = counts_E.max().reshape(1).clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            capacity = int(top)
            self.max_count: torch.Tensor | None = counts_E.max().reshape(1)
        else:
            capacity = max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)
            self.max_count = None
        # position of each route within its expert (token order), "position" drop policy
        flat_N = topk_ids_TK.reshape(-1)
        onehot_NE = torch.nn.functional.one_hot(flat_N, num_experts)
        pos_N = (onehot_NE.cumsum(dim=0) * onehot_NE).sum(dim=1) - 1
        keep_N = pos_N < capacity
        self.slot_N = torch.where(keep_N, flat_N * capacity + pos_N, num_experts * capacity)
        self.capacity, self.num_experts = capacity, num_experts
        self.dropped_routes = int((~keep_N).sum())
        self.send_rows_D = [capacity * (num_experts // d)] * d

    def run(self) -> torch.Tensor:
        if self.max_count is not None:
            dist.all_reduce(self.max_count.clone(), op=dist.ReduceOp.MAX, group=self.group)
        num_tokens, k = self.weights_TK.shape
        h = self.hidden_TH.shape[1]
        buf_SH = self.hidden_TH.new_zeros(self.num_experts * self.capacity + 1, h)
        buf_SH[self.slot_N] = self.hidden_TH.repeat_interleave(k, dim=0)
        send_SH = buf_SH[:-1].contiguous()
        recv_SH = torch.empty_like(send_SH)
        dist.all_to_all_single(recv_SH, send_SH, group=self.group)
        back_SH = torch.empty_like(recv_SH)
        dist.all_to_all_single(back_SH, recv_SH, group=self.group)
        padded_SH = torch.cat([back_SH, back_SH.new_zeros(1, h)])
        out_TKH = padded_SH[self.slot_N].view(num_tokens, k, h).float()
        return (out_TKH * self.weights_TK.unsqueeze(-1)).sum(dim=1).to(self.hidden_TH.dtype)


class OccultRun(BackendRun):
    """One of occult_ft's own exchanges (`occult_ft.dispatch`): its dispatch + combine around identity
    experts that apply the gate weights (so every backend returns sum_k w_k x)."""

    def __init__(self, name: str, exchange: Exchange, hidden_TH, topk_ids_TK, weights_TK):
        super().__init__()
        self.name, self.exchange = name, exchange
        self.implementation = {
            "flat": "occult_ft.dispatch.FlatExchange: dispatch + combine (one row per (token, device))",
            "per_expert": "occult_ft.dispatch.PerExpertExchange: dispatch + combine (one row per (token, expert))",
            "two_stage": "occult_ft.dispatch.TwoStageExchange: dispatch + combine (one row per (token, node) "
            "to the gateway of the sender's local index, then one per (token, device) inside the node)",
        }[exchange.name]
        self.args = (hidden_TH, topk_ids_TK, weights_TK.to(hidden_TH.dtype))
        _, _, handle = exchange.dispatch(*self.args)  # a trial run, for the volumes
        if exchange.name != "two_stage":
            assert isinstance(handle, ReceivedRows)  # the one-stage exchanges' handle
            self.send_rows_D = list(handle.layout.send_splits)
            return
        assert isinstance(exchange, TwoStageExchange) and isinstance(handle, TwoStageHandle)
        groups = exchange.groups
        world, local_size = groups.num_devices, groups.local_size
        self.send_rows_D = [0] * world
        for m, count in enumerate(handle.node_layout.send_splits):
            self.send_rows_D[m * local_size + groups.local_rank] = count
        self.stage2_rows_D = [0] * world
        for li, count in enumerate(handle.device_layout.send_splits):
            self.stage2_rows_D[groups.node * local_size + li] = count

    def run(self) -> torch.Tensor:
        recv_x_RH, recv_w_RJ, handle = self.exchange.dispatch(*self.args)
        out_RH = recv_x_RH * recv_w_RJ.sum(dim=-1, keepdim=True)  # identity experts, gate-weighted
        return self.exchange.combine(out_RH, handle, out_dtype=self.args[0].dtype)


def init_deepspeed_comm(backend: str) -> str | None:
    """Initialise deepspeed.comm on top of the running torch.distributed; None, or why it failed."""
    try:
        import deepspeed.comm as ds_comm
        from deepspeed.moe import sharded_moe  # noqa: F401 - the functions the backend calls

        ds_comm.init_distributed(dist_backend=backend)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the replica, and say why
        return f"deepspeed unavailable: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return None


def build_exchange(
    name: str,
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    group,
    *,
    capacity_factor: float = 1.0,
    min_capacity: int = 4,
    deepspeed_error: str | None = None,
    mesh=None,
    node_groups=None,
    capacity: int | None = None,
) -> BackendRun:
    """The `BackendRun` of backend `name` for this rank's tokens (see the module docstring); the two-stage
    backends need `node_groups` (`occult_ft.dispatch.node_groups`)."""
    if name in ("deepspeed_classic", "deepspeed_classic_nodrop"):
        factor = capacity_factor if name == "deepspeed_classic" else None
        if deepspeed_error is None:
            return DeepSpeedClassicRun(
                hidden_TH, topk_ids_TK, weights_TK, num_experts, group, factor, min_capacity
            )
        return CapacityReplicaRun(
            hidden_TH, topk_ids_TK, weights_TK, num_experts, group, factor, min_capacity, deepspeed_error
        )
    num_devices = dist.get_world_size(group)
    if name == "per_expert":
        exchange: FlatExchange = PerExpertExchange(ExpertLayout(num_experts, num_devices), group)
        return OccultRun(name, exchange, hidden_TH, topk_ids_TK, weights_TK)
    if name == "hf_native_ep":
        if mesh is None:
            raise RuntimeError("transformers native EP needs a device mesh")
        return HFNativeEPRun(hidden_TH, topk_ids_TK, weights_TK, num_experts, group, mesh)
    if name.startswith("occult_two_stage"):
        if node_groups is None:
            raise RuntimeError("the two-stage exchange needs node groups (run with nodes > 1)")
        layout = ExpertLayout(num_experts, num_devices, node_groups.nodes)
        return OccultRun(name, TwoStageExchange(layout, node_groups), hidden_TH, topk_ids_TK, weights_TK)
    if name == "occult_dedup_capacity":
        if capacity is None:
            raise RuntimeError("the capacity-bounded exchange needs its capacity (rows per process)")
        exchange = FlatExchange(ExpertLayout(num_experts, num_devices), group, capacity=capacity)
        return OccultRun(name, exchange, hidden_TH, topk_ids_TK, weights_TK)
    if name.startswith("occult_dedup"):
        exchange = FlatExchange(ExpertLayout(num_experts, num_devices), group)
        return OccultRun(name, exchange, hidden_TH, topk_ids_TK, weights_TK)
    raise ValueError(f"unknown backend {name!r}")
