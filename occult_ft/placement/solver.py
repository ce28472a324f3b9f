"""`solver`, the default placement algorithm: `search`, then exact re-solves of device pairs, then the set
partitioning model on HiGHS (`partition.py`), with a proven lower bound on every layer.

    solver               one layer, within `time_limit` seconds:
                           1. `search` under the same load bound (so `solver` is never worse than
                              `search`: every later stage only takes an improvement that keeps the bound);
                           2. pair moves (`lns.improve_pairs`): two devices re-solved exactly at a time;
                           3. when the layer fits the exact model (E <= `EXACT_MAX_EXPERTS`, E/D <=
                              `EXACT_MAX_GROUP`): `solve_partition`, which also gives the lower bound, and
                              pair moves again on the time left when optimality is not proven. Larger
                              layers (DeepSeek-V3: 256 experts) keep the pair moves for `LARGE_LAYER_SHARE`
                              of the time and report the trivial bound ceil(k / (E/D)) devices per token
    solver_hierarchical  N nodes: the node level solved the same way, then each node's devices within the
                         bound over all D devices (`_devices_in_nodes`)

The load bound is `max_load_imbalance` (max/mean rows per device, `metrics.load_imbalance`): None keeps
max(1.25, occult's imbalance), a number is kept strictly. Without scipy, `solver` runs `search` and says
so once (a warning and the layer's note); install the `solver` extra for the exact model.

Shape legend: T tokens, E experts, D devices, N nodes.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from ..checks import is_int
from ..metrics import expert_device_from_groups
from .algorithms import occult, register_algorithm
from .columns import LoadBound, TokenSets
from .core import (
    LayerResult,
    PlacementError,
    check_load_bound,
    device_loads,
    device_to_groups,
    devices_total,
    imbalance,
    incidence,
    level_totals,
    node_incidence,
    resolve_load_bound,
    two_level,
)
from .lns import improve_pairs
from .partition import scipy_available, solve_partition
from .search import search, search_hierarchical

__all__ = [
    "EXACT_MAX_EXPERTS",
    "EXACT_MAX_GROUP",
    "LARGE_LAYER_SHARE",
    "SOLVER_TIME_LIMIT",
    "check_solver_options",
    "solver",
    "solver_hierarchical",
]

SOLVER_TIME_LIMIT = (
    30.0  # seconds per layer (the harder layers of a 32-expert model prove optimal in 10-60 s)
)
EXACT_MAX_EXPERTS = 128  # the exact model's pricing enumerates groups of these many experts at most
EXACT_MAX_GROUP = 16  # and at most this many experts per device (the group size `price` searches)
LARGE_LAYER_SHARE = 0.25  # of time_limit for the pair moves of a layer too large for the exact model:
# DeepSeek-V3 width, 60 layers at the default 30 s (7.5 s each, plus search), stays under 10 minutes
_warned = {"scipy": False}  # the missing-scipy warning is given once per process, the note on every layer


def check_solver_options(max_load_imbalance, time_limit, seed) -> None:
    """One-line `PlacementError` for the first bad option of `solver`."""
    check_load_bound(max_load_imbalance)
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise PlacementError(f"time_limit={time_limit!r} must be a positive number of seconds per layer")
    if not is_int(seed) or seed < 0:
        raise PlacementError(f"seed={seed!r} must be an integer >= 0")


def _fallback_note() -> str:
    note = "scipy is not installed: placed by `search` (pip install 'occult-ft[solver]' for the exact model)"
    if not _warned["scipy"]:
        warnings.warn(note, stacklevel=3)
        _warned["scipy"] = True
    return note


def _groups_of(dev_E: np.ndarray, num_devices: int) -> list[list[int]]:
    return device_to_groups(torch.as_tensor(dev_E), num_devices)


def solver(
    x_TE: torch.Tensor,
    num_devices: int,
    *,
    max_load_imbalance: float | None = None,
    time_limit: float = SOLVER_TIME_LIMIT,
    seed: int = 0,
) -> LayerResult:
    """One layer (module docstring): the placement, its lower bound and whether it is proven optimal."""
    check_solver_options(max_load_imbalance, time_limit, seed)
    if not scipy_available():
        return LayerResult(
            search(x_TE, num_devices, max_load_imbalance=max_load_imbalance, seed=seed), note=_fallback_note()
        )
    num_experts = x_TE.shape[1]
    if num_devices == 1 or num_devices == num_experts or x_TE.shape[0] == 0:
        return _trivial_layer(x_TE, num_devices)
    started = time.perf_counter()
    deadline = started + time_limit
    # beta: the bound on max/mean rows per device; None resolves against occult's own imbalance on this layer
    occult_dev = expert_device_from_groups(occult(x_TE, num_devices), num_experts)
    beta = resolve_load_bound(max_load_imbalance, imbalance(device_loads(x_TE, occult_dev, num_devices)))
    bound = LoadBound(beta, num_devices)  # a whole layer: no other devices, offset 0
    sets = TokenSets.from_incidence(x_TE)  # identical tokens merged once for every later stage
    # E/D experts per device: the group size of the partition model
    per = num_experts // num_devices
    # past these sizes the pricing's branch and bound enumerates too many groups to finish in time
    large = num_experts > EXACT_MAX_EXPERTS or per > EXACT_MAX_GROUP
    # 20% of the time for pair moves before the exact model, which takes the rest (a layer too large
    # for it: LARGE_LAYER_SHARE, and no more)
    pairs_until = started + (LARGE_LAYER_SHARE if large else 0.2) * time_limit
    dev = _paired_search(x_TE, sets, num_devices, bound, pairs_until, seed)
    if large:
        if dev is None:
            raise PlacementError(
                f"no placement found within max_load_imbalance={beta}; raise max_load_imbalance"
            )
        return LayerResult(
            _groups_of(dev, num_devices),
            # each token reaches at least ceil(|S| / (E/D)) devices: the trivial bound (`TokenSets.trivial_bound`)
            sets.trivial_bound(per),
            False,
            note="bound: each token reaches ceil(k / (E/D)) devices (layer too large for the exact model)",
        )
    starts = [] if dev is None else [_groups_of(dev, num_devices)]
    # 90% of what is left, at least a second: the last pair moves get the remainder
    seconds = max(1.0, 0.9 * (deadline - time.perf_counter()))
    res = solve_partition(sets, num_devices, starts, bound=bound, seconds=seconds, seed=seed)
    if not res.groups:
        raise PlacementError(
            f"no placement found within max_load_imbalance={beta} in {time_limit:g} s; raise max_load_imbalance "
            "or the time limit"
        )
    groups = res.groups
    if not res.optimal and time.perf_counter() < deadline:
        # a new seed: the pair order differs from the first round, which already stopped improving
        dev = expert_device_from_groups(groups, num_experts).numpy()
        dev = improve_pairs(sets, dev, num_devices, bound=bound, deadline=deadline, seed=seed + 1)
        groups = _groups_of(dev, num_devices)
    # the partition model's bound holds for the layer whatever the pair moves did afterwards (they only improve)
    return LayerResult(groups, res.lower_bound, res.optimal, note=None if res.optimal else res.status)


def _trivial_layer(x_TE: torch.Tensor, num_devices: int) -> LayerResult:
    """One device, one expert per device or no tokens: every equal placement has the same objective and
    loads, so occult's is optimal."""
    groups = occult(x_TE, num_devices)
    value = devices_total(x_TE, expert_device_from_groups(groups, x_TE.shape[1]), num_devices)
    return LayerResult(groups, value, True)


def _paired_search(x_TE, sets, num_devices: int, bound: LoadBound, deadline: float, seed: int):
    """The heuristic start of `solver`: `search` within the bound, improved by pair moves until
    `deadline`; dev[e] = device of expert e (numpy), or None when search finds nothing within the bound
    (the exact model may still find a placement)."""
    try:
        start = search(x_TE, num_devices, max_load_imbalance=bound.beta, seed=seed)
    except PlacementError:
        return None
    dev = expert_device_from_groups(start, x_TE.shape[1]).numpy()  # the form the pair moves work on
    return improve_pairs(sets, dev, num_devices, bound=bound, deadline=deadline, seed=seed)


def solver_hierarchical(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    num_nodes: int,
    *,
    max_load_imbalance: float | None = None,
    time_limit: float = SOLVER_TIME_LIMIT,
    seed: int = 0,
) -> LayerResult:
    """Nodes, then the devices of each node, bounds at both levels.

    Two node partitions compete: the solver's (node loads within the bound) and occult's; each is refined
    device by device, node after node, every device kept within the bound over all D devices (the other
    nodes' loads as they stand). The automatic bound is max(1.25, hierarchical occult's imbalance), so
    occult's partition with occult's devices always qualifies; among the partitions that keep the bound
    the one with the fewest nodes, then devices, per token wins.

    The node level is solved like a layer (node loads within the bound, a node-level lower bound). The
    device-level lower bound holds for the chosen node partition: each node's device-level model within
    the cap beta * (total) / D that every better placement keeps.
    """
    check_solver_options(max_load_imbalance, time_limit, seed)
    if not scipy_available():
        groups = search_hierarchical(
            topk_ids_TK, num_experts, num_devices, num_nodes, max_load_imbalance=max_load_imbalance, seed=seed
        )
        return LayerResult(groups, note=_fallback_note())
    x_TE = incidence(topk_ids_TK, num_experts)
    # occult's node groups and devices inside them: the reference the automatic bound is measured on
    occult_nodes = occult(x_TE, num_nodes)
    reference = two_level(topk_ids_TK, num_experts, num_devices, num_nodes, occult, node_groups=occult_nodes)
    ref_dev = expert_device_from_groups(reference, num_experts)
    beta = resolve_load_bound(max_load_imbalance, imbalance(device_loads(x_TE, ref_dev, num_devices)))
    # a third of the time for the node level, a third for each candidate node partition's devices
    nodes = solver(
        x_TE, num_nodes, max_load_imbalance=max_load_imbalance, time_limit=time_limit / 3, seed=seed
    )
    best = None
    for node_groups, start in ((nodes.groups, None), (occult_nodes, reference)):
        got = _devices_in_nodes(
            topk_ids_TK, num_experts, num_devices, node_groups, start, beta, time_limit / 3, seed
        )
        if got is None:
            continue
        groups, device_lower = got
        # level_totals = (summed distinct nodes per token, summed distinct devices per token)
        totals = level_totals(x_TE, groups, num_devices, num_nodes)
        if best is None or totals < best[0]:  # (summed nodes, summed devices): nodes first
            best = (totals, groups, device_lower)
    if best is None:
        raise PlacementError(
            f"no hierarchical placement found within max_load_imbalance={beta}; raise max_load_imbalance"
        )
    # the device-level bound holds for the node partition chosen; the node level has its own bound
    return LayerResult(best[1], best[2], False, node_lower_bound=nodes.lower_bound)


def _devices_in_nodes(topk_ids_TK, num_experts, num_devices, node_groups, start, beta, seconds, seed):
    """Each node's devices re-solved in turn within the bound over all D devices; (groups, device-level
    lower bound for this node partition) or None when no device layout keeps the bound."""
    num_nodes = len(node_groups)
    per_node = num_devices // num_nodes
    members = [list(g) for g in node_groups]
    # the sub-problem of a node: its tokens restricted to its experts, in the node's local expert ids
    subs_x = [node_incidence(topk_ids_TK, num_experts, g) for g in members]
    subs = [TokenSets.from_incidence(x) for x in subs_x]
    local = []
    for n, g in enumerate(members):
        # device d of node n is device n * (D/N) + d over all D
        if start is not None:  # the given devices of this node, in local ids
            # start holds global expert ids: map them to the node's local ids (the position in members[n])
            index = {e: i for i, e in enumerate(g)}
            local.append([sorted(index[e] for e in grp) for grp in start[n * per_node : (n + 1) * per_node]])
        else:
            local.append(search(subs_x[n], per_node, seed=seed + n + 1))

    def loads_of(n: int) -> np.ndarray:
        # G[d, e] = local expert e sits on the node's device d; cover gives each device's load (tokens it receives)
        G = np.zeros((per_node, len(members[n])), bool)
        for d, grp in enumerate(local[n]):
            G[d, grp] = True
        return subs[n].cover(G)

    loads = [loads_of(n) for n in range(num_nodes)]
    share = seconds / (3 * num_nodes)  # two rounds over the nodes, then the bounds: a third each

    def keeps() -> bool:
        every = np.concatenate(loads)
        # max/mean load over all D devices (every node's loads concatenated), with relative slack for rounding
        return bool(every.max() <= beta * every.mean() * (1 + 1e-9))

    for _ in range(2):  # each node within the bound over all D devices, the other nodes as they stand
        for n in range(num_nodes):
            # the loads of every device outside node n, held fixed while n is re-solved
            others = np.concatenate([loads[o] for o in range(num_nodes) if o != n])
            # offset = their summed load, other_max = their largest: the bound over all D devices (`LoadBound`)
            bound = LoadBound(beta, num_devices, float(others.sum()), float(others.max(initial=0.0)))
            res = solve_partition(
                subs[n], per_node, [local[n]], bound=bound, seconds=share, seed=seed + n + 1
            )
            if res.groups:
                local[n], loads[n] = res.groups, loads_of(n)
        if keeps():
            break
    if not keeps():
        return None
    # the device-level bound for this node partition: every better layout keeps each device within
    # beta * (its total) / D <= beta * (this total) / D, so each node's model within that cap bounds its part
    cap = beta * float(np.concatenate(loads).sum()) / num_devices
    lower = 0.0
    for n in range(num_nodes):
        res = solve_partition(subs[n], per_node, [local[n]], max_load=cap, seconds=share, seed=seed + n + 1)
        # the node's current cost is itself reachable, so a bound above it is capped there
        lower += min(res.lower_bound, float(loads[n].sum()))
    return [sorted(members[n][i] for i in grp) for n in range(num_nodes) for grp in local[n]], lower


register_algorithm("solver", solver, hierarchical=solver_hierarchical)
