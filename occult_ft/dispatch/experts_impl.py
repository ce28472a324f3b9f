"""Expert parallelism inside a stock transformers model: the "occult_ep" experts implementation.

    ExpertShard / check_exchange_settings   the record `shard_experts` leaves on an experts module
    exchange_for / occult_ep_experts_forward   the kernel: `moe_forward` through the record's exchange
    shard_experts[_module] / configure_exchange   cut the experts to this rank's block, change settings
    gather_experts[_state_dict] / expert_shard_parameters   undo, save, find the shards

What sharding means for gradients, optimizers and checkpoints: docs/expert-parallel.md.

Shape legend: E experts of a layer, D devices (expert-parallel size), P = E / D experts per device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from ..layout import ExpertLayout
from ..models import base_experts, experts_state_key, find_moe_layers, unwrap_model
from .comm import group_size_and_rank
from .exchange import Exchange, FlatExchange, PerExpertExchange, moe_forward
from .pipeline import pipelined_moe_forward
from .shared import SharedBeside, attach_shared, detach_shared
from .two_stage import TwoStageExchange, node_groups

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "EXCHANGES",
    "ExpertShard",
    "check_exchange_settings",
    "exchange_for",
    "configure_exchange",
    "occult_ep_experts_forward",
    "register_experts_implementation",
    "shard_experts",
    "shard_experts_module",
    "expert_shard_parameters",
    "gather_experts_state_dict",
    "gather_experts",
]

EXPERTS_IMPLEMENTATION = "occult_ep"
EXCHANGES = ("flat", "two_stage", "per_expert")
"""Token exchanges the kernel can run (`ExpertShard.exchange`)."""


@dataclass(frozen=True)
class ExpertShard:
    """What `shard_experts` records on an experts module (`experts.occult_shard`).

    Attributes:
        group: the expert-parallel process group (None = default group).
        rank: this rank in `group`; it holds experts [rank * experts_per_device, (rank + 1) * experts_per_device).
        num_devices: D.
        num_experts: E, experts of the layer over all ranks.
        experts_per_device: P = E / D.
        param_names: the sharded fused tensors (dim 0 = expert).
        previous_implementation: `config._experts_implementation` before sharding (restored by
            `gather_experts`).
        nodes: N nodes of D / N consecutive ranks (the layout; the two-stage exchange crosses them).
        exchange: one of `EXCHANGES` ("flat" by default; "two_stage" when built with nodes > 1).
        chunks: token chunks the layer pipelines (1: no pipelining; flat and per_expert only).
        capacity: None (exact, one host synchronisation per layer) or rows per destination of the
            flat exchange's capacity-bounded mode (no synchronisation; see `FlatExchange`).
        overlap_local: run one chunk through the pipeline too: this rank's own rows (tokens for its
            own experts, no network) are computed while the other rows' exchanges travel (flat and
            per_expert, exact mode; with chunks > 1 the pipeline always does it).
        overlap_shared: run the block's shared MLP while the combine travels, through the pipeline
            (flat and per_expert, exact mode; `attach_shared` links the MLP: `experts.occult_beside`).
    """

    group: dist.ProcessGroup | None
    rank: int
    num_devices: int
    num_experts: int
    experts_per_device: int
    param_names: tuple[str, ...]
    previous_implementation: str | None
    nodes: int = 1
    exchange: str = ""
    chunks: int = 1
    capacity: int | None = None
    overlap_local: bool = False
    overlap_shared: bool = False

    def __post_init__(self):
        if not self.exchange:
            object.__setattr__(self, "exchange", "two_stage" if self.nodes > 1 else "flat")
        check_exchange_settings(
            self.exchange, self.nodes, self.chunks, self.capacity, self.overlap_local, self.overlap_shared
        )

    @property
    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.num_experts, self.num_devices, self.nodes)


PIPELINE_CHUNKS = 2
"""`exchange_chunks` left unset, for the flat exact exchange across nodes without a budget. Measured on
whole steps (docs/cluster.md, "Chunks by default"), 4 nodes x 1 process on 500 Mbit/s links: without a
budget 2 chunks cut the exposed exchange from 20-21% to 9% of the step and the step by 1-6% (3 runs); at
budget 2 the exposed exchange is 12% unchunked, and 2 chunks moved the step by -3% and +9%; on one
host's loopback they made it 14% slower (smaller expert matmuls, twice the collectives, nothing to
hide)."""


def default_exchange_chunks(exchange: str, nodes: int, capacity: int | str | None, budget: bool) -> int:
    """The chunk count an unset `exchange_chunks` takes: `PIPELINE_CHUNKS` where the exchange is large
    enough to hide: the flat exact exchange across nodes (nodes > 1: it crosses the slow links) without a
    device or node budget (`budget` False: every expert's device is reached). Otherwise 1: inside one
    node, under a budget (the exchange left is small; pipelining costs more than it hides), for
    two_stage and capacity-bounded buffers (they cannot pipeline) and for per_expert, which stands for
    the way other tools send (one all-to-all per layer, nothing overlapped)."""
    large = exchange == "flat" and nodes > 1 and not budget
    return PIPELINE_CHUNKS if large and capacity is None else 1


def check_exchange_settings(
    exchange: str,
    nodes: int,
    chunks: int,
    capacity: int | None,
    overlap_local: bool = False,
    overlap_shared: bool = False,
) -> None:
    """One-line ValueErrors for settings the kernel cannot run."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} is unknown; use one of {', '.join(EXCHANGES)}")
    if exchange == "two_stage" and nodes < 2:
        raise ValueError(f"exchange='two_stage' needs nodes > 1 (got nodes={nodes}); use exchange='flat'")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"exchange_chunks={chunks!r} must be a positive integer (1 = no pipelining)")
    if chunks > 1 and exchange == "two_stage":
        raise ValueError(
            "exchange_chunks > 1 pipelines the flat and per_expert exchanges; use 1 with two_stage"
        )
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"exchange_capacity={capacity!r} must be a positive number of rows, or None")
        if exchange != "flat":
            raise ValueError(
                f"exchange_capacity bounds the flat exchange's receive buffers; exchange={exchange!r} is exact only"
            )
        if chunks > 1:
            raise ValueError("exchange_capacity needs no host synchronisation to hide: use exchange_chunks=1")
    for name, value in (("overlap_local", overlap_local), ("overlap_shared", overlap_shared)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False")
        if value and (exchange == "two_stage" or capacity is not None):
            raise ValueError(
                f"{name} runs the pipeline of the flat and per_expert exact exchanges (got exchange={exchange!r}, "
                f"capacity={capacity!r}); use {name}=False"
            )


def exchange_for(shard: ExpertShard) -> Exchange:
    """The `Exchange` a shard record names (built per call: it is a few attribute reads)."""
    layout = shard.layout
    if shard.exchange == "two_stage":
        # two_stage keeps the node count: its layout is E experts on N nodes of D / N devices
        return TwoStageExchange(layout, node_groups(shard.nodes, shard.group))  # cached sub-groups
    # The one-stage exchanges see the D devices only: their layout drops the node count (a flat
    # exchange over several nodes is valid, it just sends a token once per device, not per node).
    if shard.exchange == "per_expert":
        return PerExpertExchange(ExpertLayout(shard.num_experts, shard.num_devices), shard.group)
    return FlatExchange(ExpertLayout(shard.num_experts, shard.num_devices), shard.group, shard.capacity)


def occult_ep_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts kernel: (T, H) tokens, (T, K) global expert ids and gate weights -> (T, H).

    Runs on a module sharded by `shard_experts`; every rank of its group must call it.
    """
    shard: ExpertShard | None = getattr(self, "occult_shard", None)
    if shard is None:
        raise RuntimeError(
            f"{type(self).__name__} uses experts_implementation={EXPERTS_IMPLEMENTATION!r} but holds all its "
            "experts; call occult_ft.dispatch.shard_experts(model, group) first"
        )
    exchange = exchange_for(shard)
    # the block's shared MLP beside the combine, unless the block already ran it on these tokens
    beside: SharedBeside | None = getattr(self, "occult_beside", None) if shard.overlap_shared else None
    if beside is not None and not beside.wanted(hidden_states):
        beside = None
    # check_exchange_settings already refused chunks > 1 and the overlaps for exchanges that cannot be
    # pipelined; one chunk through the pipeline is the own rows' overlap alone
    if beside is not None:
        out, shared_out = pipelined_moe_forward(
            hidden_states, top_k_index, top_k_weights, self, exchange, shard.chunks, shared=beside.module
        )
        beside.offer(hidden_states, shared_out)
        return out
    if shard.chunks > 1 or shard.overlap_local:
        return pipelined_moe_forward(hidden_states, top_k_index, top_k_weights, self, exchange, shard.chunks)
    return moe_forward(hidden_states, top_k_index, top_k_weights, self, exchange)


def register_experts_implementation() -> None:
    """Register "occult_ep" in transformers' `ALL_EXPERTS_FUNCTIONS` (idempotent; done at import)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, occult_ep_experts_forward)


# transformers 5.x routes every fused experts module through ALL_EXPERTS_FUNCTIONS, keyed by
# config._experts_implementation; registering at import lets `set_experts_implementation("occult_ep")`
# find the kernel on any model.
register_experts_implementation()


def shard_experts_module(
    experts: nn.Module,
    param_names: tuple[str, ...] | list[str],
    group: dist.ProcessGroup | None = None,
    previous_implementation: str | None = None,
    nodes: int = 1,
) -> ExpertShard:
    """Cut one fused experts module down to this rank's contiguous block of experts, in place.

    Args:
        experts: a transformers fused experts module holding all E experts.
        param_names: its tensors indexed by expert along dim 0 (`MoEArch.expert_params`).
        group: the expert-parallel process group (None: default group; without torch.distributed, D = 1).
        previous_implementation: recorded on the returned `ExpertShard` for `gather_experts`.
        nodes: N nodes of D / N consecutive ranks; above 1 the kernel uses the two-stage exchange (change
            it with `configure_exchange`).

    Returns:
        the `ExpertShard` record, also stored as `experts.occult_shard`.

    Raises:
        ValueError: if E is not divisible by the group size, a tensor's dim 0 is not E, or the module
            is already sharded.
    """
    if getattr(experts, "occult_shard", None) is not None:
        raise ValueError(f"{type(experts).__name__} is already sharded; shard_experts runs once per model")
    num_devices, rank = group_size_and_rank(group)
    names = tuple(param_names)
    # dim 0 of every fused expert tensor is the expert: its length is E
    num_experts = int(getattr(experts, names[0]).shape[0])
    layout = ExpertLayout(num_experts, num_devices, nodes)  # D divides E, N divides D
    per_device = layout.experts_per_device
    for name in names:
        full = getattr(experts, name)
        if full.shape[0] != num_experts:
            raise ValueError(
                f"experts.{name} has shape {tuple(full.shape)}; dim 0 should be {num_experts} experts"
            )
    for name in names:
        full = getattr(experts, name)
        # Contiguous block: rank r holds experts [r * P, (r + 1) * P), the layout every exchange
        # assumes. clone() so the full tensor can be freed; a new Parameter, so the optimizer must be
        # built after sharding.
        block = full.detach()[rank * per_device : (rank + 1) * per_device].clone()
        shard = nn.Parameter(block, requires_grad=full.requires_grad)
        # The mark tells trainers not to all-reduce it over the EP group: its gradient is complete here
        shard.occult_expert_shard = True  # type: ignore[attr-defined]
        setattr(experts, name, shard)
    record = ExpertShard(
        group,
        rank,
        num_devices,
        num_experts,
        layout.experts_per_device,
        names,
        previous_implementation,
        nodes,
    )
    experts.occult_shard = record  # type: ignore[assignment]
    experts.num_experts = per_device  # type: ignore[assignment]  # the module now holds P experts; stock kernels would see P
    return record


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None = None, nodes: int = 1) -> nn.Module:
    """Keep only this rank's contiguous block of experts in every MoE layer and switch to "occult_ep".

    Call it on every rank of `group` after all ranks hold identical weights (same checkpoint or same
    seed), and before building the optimizer.

    Args:
        model: a transformers MoE model of a registered type (DDP/DeepSpeed/PEFT wrappers are unwrapped).
        group: the expert-parallel process group (None: default group; without torch.distributed, D = 1).
        nodes: N > 1 selects the two-stage exchange over N nodes of D / N consecutive ranks; its
            sub-groups are built here (a collective over the whole world, see `two_stage.node_groups`).

    Returns:
        the same `model`, modified in place.

    Raises:
        ValueError: if a layer's expert count is not divisible by the group size (naming the layer),
            or the model is already sharded.
    """
    base = unwrap_model(model)
    previous: str | None = base.config._experts_implementation  # type: ignore[union-attr, assignment]
    for layer in find_moe_layers(base):
        try:
            shard_experts_module(
                base_experts(layer.experts), layer.arch.expert_params, group, previous, nodes
            )
        except ValueError as err:
            raise ValueError(f"{layer.name}.experts: {err}") from None
    if nodes > 1:
        # new_group is collective over the whole world: build the sub-groups now, on every rank at
        # once, rather than in the first forward (where ranks of other EP groups may not be yet)
        node_groups(nodes, group)
    base.set_experts_implementation(EXPERTS_IMPLEMENTATION)  # type: ignore[operator]
    return model


def configure_exchange(
    model: nn.Module,
    exchange: str | None = None,
    chunks: int | None = None,
    capacity: int | None | str = "keep",
    overlap_local: bool | None = None,
    overlap_shared: bool | None = None,
) -> nn.Module:
    """Change the exchange settings of every sharded layer of `model` (call on every rank alike).

    Args:
        exchange: one of `EXCHANGES` (None: keep). "two_stage" builds the node sub-groups now (a
            collective over the whole world) and needs the model sharded with nodes > 1.
        chunks: token chunks to pipeline (None: keep).
        capacity: rows per destination of the capacity-bounded flat exchange, None for exact
            (default "keep").
        overlap_local: compute the own rows while the exchanges travel, also with one chunk (None: keep).
        overlap_shared: run each block's shared MLP while the combine travels (None: keep); layers
            without one are unchanged.

    Raises:
        ValueError: for a model that is not sharded or settings the kernel cannot run.
    """
    layers = list(_sharded_layers(unwrap_model(model)))
    if not layers:
        raise ValueError("the model has no sharded experts; call shard_experts(model, group) first")
    for layer, shard in layers:
        updated = replace(
            shard,
            exchange=shard.exchange if exchange is None else exchange,
            chunks=shard.chunks if chunks is None else chunks,
            capacity=shard.capacity if capacity == "keep" else capacity,
            overlap_local=shard.overlap_local if overlap_local is None else overlap_local,
            overlap_shared=shard.overlap_shared if overlap_shared is None else overlap_shared,
        )
        base_experts(layer.experts).occult_shard = updated
    if overlap_shared is not None:  # the shared MLPs answer the block from the kernel only while on
        (attach_shared if overlap_shared else detach_shared)(unwrap_model(model))
    first = layers[0][1]
    if exchange == "two_stage":  # the sub-groups are a world collective: build them on every rank now
        node_groups(first.nodes, first.group)
    return model


def expert_shard_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert-shard parameter (`occult_expert_shard = True`)."""
    return [
        (n, p) for n, p in unwrap_model(model).named_parameters() if getattr(p, "occult_expert_shard", False)
    ]


def _gather_dim0(shard: torch.Tensor, group: dist.ProcessGroup | None, num_devices: int) -> torch.Tensor:
    # Blocks are contiguous in rank order, so concatenating the gathered blocks restores (E, ...)
    if num_devices == 1:
        return shard.detach().clone()
    shard = shard.detach().contiguous()
    pieces = [torch.empty_like(shard) for _ in range(num_devices)]
    # all_gather returns the blocks in rank order: block r = experts [r * P, (r + 1) * P)
    dist.all_gather(pieces, shard, group=group)
    return torch.cat(pieces, dim=0)


def _sharded_layers(base: nn.Module):
    for layer in find_moe_layers(base):
        shard = getattr(base_experts(layer.experts), "occult_shard", None)
        if shard is not None:
            yield layer, shard


def gather_experts_state_dict(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded model, expert tensors all-gathered to (E, ...) (collective).

    Keys are those of the unwrapped model's `state_dict()`. Every rank must call it; every rank gets
    the result. Each layer gathers over the group recorded by `shard_experts` (`group` is used only
    where that was None, i.e. the default group). Save with `model.save_pretrained(path, state_dict=...)` on rank 0: transformers then
    writes its ordinary per-expert Hub layout, loadable by `from_pretrained` without occult_ft.
    """
    base = unwrap_model(model)
    state = dict(base.state_dict())
    for layer, shard in _sharded_layers(base):
        for name in shard.param_names:
            key = experts_state_key(layer, name)
            if key not in state:
                raise KeyError(f"state_dict has no key {key!r} for a sharded expert tensor")
            part = getattr(base_experts(layer.experts), name)
            state[key] = _gather_dim0(part, shard.group or group, shard.num_devices)
    return state


def gather_experts(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Undo `shard_experts` in place (collective): full expert tensors on every rank, previous kernel.

    Each layer gathers over the group recorded by `shard_experts` (`group` is used only where that was
    None, i.e. the default group). Expert LoRA factors sharded with the experts are not touched here:
    gather them first with `occult_ft.integrations.peft.unshard_expert_lora`.
    """
    base = unwrap_model(model)
    detach_shared(base)
    previous = None
    for layer, shard in list(_sharded_layers(base)):
        experts = base_experts(layer.experts)
        for name in shard.param_names:
            part = getattr(experts, name)
            gathered = _gather_dim0(part, shard.group or group, shard.num_devices)
            full = nn.Parameter(gathered, requires_grad=part.requires_grad)
            setattr(experts, name, full)
        # the module holds all E experts again: stock kernels read E
        experts.num_experts = shard.num_experts
        del experts.occult_shard
        previous = shard.previous_implementation
    if previous is not None and previous != EXPERTS_IMPLEMENTATION:
        base.set_experts_implementation(previous)  # type: ignore[operator]
    return model
