"""Collaboration pruning: device-limited top-k routing criteria and the pruned router.

A pruned router keeps each token on at most `max_devices_per_token` devices (and optionally
`max_nodes_per_token` nodes) with one of the `CRITERIA`; the rules, their reasons and the gate-weight
policies are described in docs/pruning.md, the device bias in docs/device-balance.md.

Files:
    rules.py   the criteria as pure tensor functions (no model): the walk, budgets, device bias.
    config.py  `PruningConfig`, the budget a pruned router applies.
    router.py  the model-aware `prune_topk` and the pruned router class swapped into a model.

Shape legend: T tokens, E experts, K top-k, D devices, N nodes, M = max_devices_per_token.
"""

from .config import PruningConfig
from .router import (
    RouterRecord,
    apply_pruning,
    collect_routing,
    fit_router_device_bias,
    prune_topk,
    pruned_routers,
    remove_pruning,
    router_device_bias,
    router_selectable,
    router_similarity,
    set_recording,
    unpruned_routing,
)
from .rules import (
    CRITERIA,
    GATE_WEIGHT_POLICIES,
    add_device_bias,
    check_pruning_settings,
    device_scores,
    fit_device_bias,
    fits_budget,
    limit_devices,
    limit_topk,
    replace_by_similarity,
    update_device_bias,
    walk_admitted_devices,
)

__all__ = [
    "CRITERIA",
    "GATE_WEIGHT_POLICIES",
    "PruningConfig",
    "RouterRecord",
    "check_pruning_settings",
    "device_scores",
    "fits_budget",
    "limit_devices",
    "limit_topk",
    "walk_admitted_devices",
    "replace_by_similarity",
    "router_selectable",
    "prune_topk",
    "apply_pruning",
    "remove_pruning",
    "pruned_routers",
    "collect_routing",
    "set_recording",
    "unpruned_routing",
    "router_similarity",
    "router_device_bias",
    "add_device_bias",
    "update_device_bias",
    "fit_device_bias",
    "fit_router_device_bias",
]
