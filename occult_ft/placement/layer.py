"""Placing layers: `place_layer` (one MoE layer, flat or hierarchical), `compute_placement` (every layer
of a profile, into a `Placement` with metrics) and `sequential_placement` (the framework default).

A placement assigns, per MoE layer, the E routed experts to D devices, E/D each, so that the experts a
token selects together sit on few devices. The objective is the paper's `comm_complexity` (mean over the
profiled tokens of the distinct devices hosting the token's top-k), computed on the token-level routing
`topk_ids_TK` recorded by profiling. Placement changes no result: it is a permutation of experts.

Hierarchical placement (`num_nodes` N > 1): experts are first split into N node groups of E/N (objective
= distinct nodes per token), then each node's experts are placed on its D/N devices (objective =
distinct devices per token within the node). Device d belongs to node d // (D/N). `search` does this
with a guarantee at both levels (see `occult_ft.placement.search`).

Shape legend: T tokens, K experts per token, E experts, D devices.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch

from ..metrics import comm_complexity, expert_device_from_groups, load_imbalance
from .algorithms import PLACEMENT_ALGORITHMS, PlacementAlgorithm, _sequential
from .core import _RERUN, PlacementError, _incidence, _two_level, _validate_sizes
from .file import Placement
from .search import DEFAULT_ALGORITHM

__all__ = ["place_layer", "compute_placement", "sequential_placement"]


def _algorithm(
    num_experts: int, num_devices: int, num_nodes: int, algorithm: str, options
) -> PlacementAlgorithm:
    """Validate a request; return the registry entry."""
    _validate_sizes(num_experts, num_devices, num_nodes)
    if algorithm not in PLACEMENT_ALGORITHMS:
        raise PlacementError(
            f"unknown placement algorithm {algorithm!r}; use one of {', '.join(sorted(PLACEMENT_ALGORITHMS))}"
        )
    entry = PLACEMENT_ALGORITHMS[algorithm]
    entry.check_options(options)
    return entry


def place_layer(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    algorithm: str = DEFAULT_ALGORITHM,
    num_nodes: int = 1,
    **options,
) -> list[list[int]]:
    """Place one MoE layer's experts on devices.

    Args:
        topk_ids_TK: (T, K) int expert ids per profiled token (-1 = empty slot).
        num_experts: E.
        num_devices: D, a divisor of E.
        algorithm: a key of `PLACEMENT_ALGORITHMS`.
        num_nodes: N, a divisor of D; N > 1 places hierarchically (nodes first, then devices in a node).
        options: the algorithm's own options (`PLACEMENT_ALGORITHMS[algorithm].options`); any other is a
            `PlacementError`. sequential, occult and greedy_pairs take none. `search` takes
            `max_load_imbalance` (default 1.25: keep max/mean device load within max(this, `occult`'s
            imbalance); starts beyond that bound are not used), `seed` (default 0, of the random restarts:
            same seed, same result), `restarts` (default 4), `max_swaps` per descent (default 2E) and
            `max_search_tokens` (default 2**21 / E: swaps are evaluated on a seeded subset of that many
            tokens; 8192 at 256 experts).

    Returns:
        `groups`, D lists of E/D sorted expert ids; device d belongs to node d // (D/N).
    """
    entry = _algorithm(num_experts, num_devices, num_nodes, algorithm, options)
    if topk_ids_TK.dim() != 2:
        raise PlacementError(f"topk_ids must be (tokens, top_k), got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.numel() and (int(topk_ids_TK.max()) >= num_experts or int(topk_ids_TK.min()) < -1):
        bad = int(topk_ids_TK.max()) if int(topk_ids_TK.max()) >= num_experts else int(topk_ids_TK.min())
        raise PlacementError(
            f"topk_ids hold expert id {bad} but the layer has {num_experts} experts; {_RERUN}"
        )
    if num_nodes == 1:
        groups = entry.solve(_incidence(topk_ids_TK, num_experts), num_devices, **options)
    elif entry.hierarchical is not None:
        groups = entry.hierarchical(topk_ids_TK, num_experts, num_devices, num_nodes, **options)
    else:  # the same solver and options at both levels
        groups = _two_level(topk_ids_TK, num_experts, num_devices, num_nodes, partial(entry.solve, **options))
    return [sorted(g) for g in groups]


def _layer_report(
    topk_ids_TK: torch.Tensor, groups, num_experts: int, num_devices: int, num_nodes: int
) -> dict:
    dev_E = expert_device_from_groups(groups, num_experts)
    seq_E = torch.arange(num_experts) // (num_experts // num_devices)
    report = dict(
        tokens=int(topk_ids_TK.shape[0]),
        comm_complexity_sequential=comm_complexity(topk_ids_TK, seq_E, num_devices),
        comm_complexity=comm_complexity(topk_ids_TK, dev_E, num_devices),
        load_imbalance=load_imbalance(topk_ids_TK, dev_E, num_devices),
    )
    if num_nodes > 1:
        report["node_complexity"] = comm_complexity(
            topk_ids_TK, dev_E // (num_devices // num_nodes), num_nodes
        )
    return report


def _place_in_routing_groups(ids_TK, num_experts, num_devices, group_size, algorithm, num_nodes, **options):
    """Placement for a model whose router picks among contiguous routing groups (DeepSeek group-limited
    routing): groups must stay whole blocks. With whole groups per device, the groups are placed as
    units; when a group spans several devices, it keeps its slot and its experts are placed over those
    devices (on the tokens' experts inside it)."""
    per_device = num_experts // num_devices
    if per_device % group_size == 0:
        unit_groups = place_layer(
            ids_TK // group_size, num_experts // group_size, num_devices, algorithm, num_nodes, **options
        )
        return [
            sorted(e for u in g for e in range(u * group_size, (u + 1) * group_size)) for g in unit_groups
        ]
    span = group_size // per_device  # devices per routing group
    groups: list[list[int]] = []
    for q in range(num_experts // group_size):
        local = torch.where(ids_TK // group_size == q, ids_TK - q * group_size, -1)
        inside = local.max(dim=1).values >= 0  # tokens with at least one expert in this group
        sub = place_layer(local[inside], group_size, span, algorithm, **options)
        groups.extend(sorted(q * group_size + e for e in g) for g in sub)
    return groups


def compute_placement(
    profile, num_devices: int, num_nodes: int = 1, algorithm: str = DEFAULT_ALGORITHM, **options
) -> Placement:
    """Place every profiled layer.

    Args:
        profile: object with `model`, `model_type`, `num_experts`, `top_k` and `layers`
            (layer index -> object with `.topk_ids`, (T, K) int64), e.g. `occult_ft.profiling.Profile`.
        num_devices, num_nodes, algorithm, options: see `place_layer` (an option the algorithm does not
            take is a `PlacementError` before any layer is placed).

    Returns:
        A `Placement` whose `metrics` hold per-layer and token-weighted overall comm_complexity
        (sequential vs placed) and load imbalance on the profile.
    """
    num_experts = int(profile.num_experts)
    _algorithm(num_experts, num_devices, num_nodes, algorithm, options)
    if not profile.layers:
        raise PlacementError("profile has no MoE layers; profile the model with `occult-ft profile` first")
    group_size = int(getattr(profile, "group_size", 1) or 1) if algorithm != "sequential" else 1
    per_device = num_experts // num_devices
    if group_size > 1 and per_device % group_size and group_size % per_device:
        num_group = num_experts // group_size
        raise PlacementError(
            f"the model routes within {num_group} groups of {group_size} experts, which must stay whole, and "
            f"devices={num_devices} ({per_device} experts each) neither holds whole groups nor splits each group "
            f"evenly; use devices dividing or divisible by {num_group}, or placement 'sequential'"
        )
    groups, per_layer = {}, {}
    for layer in sorted(profile.layers):
        ids = profile.layers[layer].topk_ids
        if group_size > 1:
            groups[int(layer)] = _place_in_routing_groups(
                ids.long(), num_experts, num_devices, group_size, algorithm, num_nodes, **options
            )
        else:
            groups[int(layer)] = place_layer(ids, num_experts, num_devices, algorithm, num_nodes, **options)
        per_layer[str(layer)] = _layer_report(ids, groups[int(layer)], num_experts, num_devices, num_nodes)
    tokens = sum(m["tokens"] for m in per_layer.values())

    def overall(key: str) -> float:
        return sum(m[key] * m["tokens"] for m in per_layer.values()) / tokens if tokens else 0.0

    metrics = dict(
        comm_complexity_sequential=overall("comm_complexity_sequential"),
        comm_complexity=overall("comm_complexity"),
        load_imbalance=max(m["load_imbalance"] for m in per_layer.values()),
        layers=per_layer,
    )
    return Placement(
        getattr(profile, "model", None),
        getattr(profile, "model_type", None),
        num_experts,
        num_devices,
        num_nodes,
        algorithm,
        groups,
        metrics,
    )


def sequential_placement(
    num_experts: int,
    num_devices: int,
    layer_indices: Iterable[int],
    model: str | None = None,
    model_type: str | None = None,
) -> Placement:
    """The framework default (contiguous experts per device) as a `Placement`, for every listed layer."""
    _validate_sizes(num_experts, num_devices, 1)
    groups = _sequential(torch.zeros(0, num_experts), num_devices)
    return Placement(
        model,
        model_type,
        num_experts,
        num_devices,
        1,
        "sequential",
        {int(i): [list(g) for g in groups] for i in layer_indices},
    )
