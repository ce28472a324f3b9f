"""Placing layers: `place_layer` (one MoE layer, flat or hierarchical), `solve_layer` (the same with its
bound), `compute_placement` (every layer of a profile, into a `Placement` with per-layer figures) and
`sequential_placement` (the framework default).

A placement assigns, per MoE layer, the E routed experts to D devices, E/D each, so that the experts a
token selects together sit on few devices. The objective is the paper's `comm_complexity` (mean over the
profiled tokens of the distinct devices hosting the token's top-k), computed on the token-level routing
`topk_ids_TK` recorded by profiling. Placement changes no result: it is a permutation of experts.

Hierarchical placement (`num_nodes` N > 1): experts are first split into N node groups of E/N (objective
= distinct nodes per token), then each node's experts are placed on its D/N devices (objective =
distinct devices per token within the node). Device d belongs to node d // (D/N).

Per-layer figures (`compute_placement`, stored in the placement file, shown by `analyze`): on the tokens
placed, comm_complexity (sequential and placed), load_imbalance (max/mean rows per device,
`metrics.load_imbalance`), the load bound kept, a proven lower bound of comm_complexity under that bound
and the relative gap; with `holdout` > 0 the same on the held-out tokens (every other block of
`HOLDOUT_BLOCK` profiled tokens for 0.5), which the placement never saw; with a budget
`max_devices_per_token`, the pruned routing's comm_complexity, load imbalance and removed share.

Shape legend: T tokens, K experts per token, E experts, D devices.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from math import floor
from typing import Any

import torch

from ..metrics import comm_complexity, expert_device_from_groups, load_imbalance, node_comm_complexity
from .algorithms import DEFAULT_ALGORITHM, get_algorithm, occult, sequential
from .columns import LoadBound, TokenSets
from .core import (
    LayerResult,
    PlacementError,
    check_load_bound,
    check_profile,
    incidence,
    resolve_load_bound,
    shown,
    validate_sizes,
)
from .file import Placement
from .partition import scipy_available, solve_partition
from .pruned import check_budget, pruned_figures, refine_pruned
from .solver import SOLVER_TIME_LIMIT

__all__ = [
    "BOUND_TIME_LIMIT",
    "HOLDOUT_BLOCK",
    "compute_placement",
    "merge_placements",
    "place_layer",
    "sequential_placement",
    "solve_layer",
    "split_holdout",
]

HOLDOUT_BLOCK = 256  # profiled tokens come sequence by sequence: held-out tokens are taken in blocks
BOUND_TIME_LIMIT = 3.0  # seconds per layer for the lower bound of an algorithm that computes none


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
        options: `max_load_imbalance` (every algorithm: None keeps max(1.25, occult's imbalance) where the
            algorithm optimises, a number >= 1 is a strict bound on max/mean rows per device) and the
            algorithm's own options (`PLACEMENT_ALGORITHMS[algorithm].options`); any other is a
            `PlacementError`. sequential, occult and greedy_pairs take none. `solver` takes `time_limit`
            (seconds per layer, default 30) and `seed`. `search` takes `seed` (default 0, of the random
            restarts: same seed, same result), `restarts` (default 4), `max_swaps` per descent (default 2E)
            and `max_search_tokens` (default 2**21 / E: swaps are evaluated on a seeded subset of that many
            tokens; 8192 at 256 experts).

    Returns:
        `groups`, D lists of E/D sorted expert ids; device d belongs to node d // (D/N).
    """
    return solve_layer(topk_ids_TK, num_experts, num_devices, algorithm, num_nodes, **options).groups


def solve_layer(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    algorithm: str = DEFAULT_ALGORITHM,
    num_nodes: int = 1,
    **options,
) -> LayerResult:
    """`place_layer` with what the algorithm proved: a `LayerResult` (groups, lower bound of the summed
    distinct devices over the tokens, optimal, node-level bound, note)."""
    validate_sizes(num_experts, num_devices, num_nodes)
    return get_algorithm(algorithm).place(topk_ids_TK, num_experts, num_devices, num_nodes, **options)


def split_holdout(num_tokens: int, holdout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, held-out) token indices: block b of `HOLDOUT_BLOCK` tokens is held out when
    floor((b + 1) h) > floor(b h), so the held-out blocks are spread evenly (every other one for h = 0.5).
    With fewer than two blocks nothing is held out."""
    blocks = -(-num_tokens // HOLDOUT_BLOCK)  # ceil: a last partial block counts as one
    if holdout <= 0 or blocks < 2:
        return torch.arange(num_tokens), torch.zeros(0, dtype=torch.long)
    # block b is held out when floor(b h) steps up between b and b + 1: h of the blocks, evenly spaced
    out_B = torch.tensor([floor((b + 1) * holdout) > floor(b * holdout) for b in range(blocks)])
    if bool(out_B.all()):  # h >= 1 holds out every block (b = 0 is kept for any h < 1): keep one
        out_B[0] = False
    out_T = out_B.repeat_interleave(HOLDOUT_BLOCK)[:num_tokens]  # (T,) bool, the last block cut short
    return (~out_T).nonzero().flatten(), out_T.nonzero().flatten()


def _figures(ids_TK, dev_E, num_devices, num_nodes, budget) -> dict:
    """comm_complexity (sequential and placed) and load imbalance of one token set (and node level, pruned)."""
    num_experts = dev_E.shape[0]
    # the sequential placement, the reference every figure is read against: expert e on device e // (E/D)
    seq_E = torch.arange(num_experts) // (num_experts // num_devices)
    out: dict[str, Any] = dict(
        tokens=int(ids_TK.shape[0]),
        comm_complexity_sequential=comm_complexity(ids_TK, seq_E, num_devices),
        comm_complexity=comm_complexity(ids_TK, dev_E, num_devices),
        load_imbalance=load_imbalance(ids_TK, dev_E, num_devices),
    )
    if num_nodes > 1:
        out["node_complexity"] = node_comm_complexity(ids_TK, dev_E, num_devices, num_nodes)
    if budget is not None:  # budget = (max_devices_per_token, criterion)
        out["pruned"] = dict(max_devices_per_token=budget[0], criterion=budget[1]) | pruned_figures(
            ids_TK, dev_E, num_devices, budget[0]
        )
    return out


def _auto_bound(x_TE: torch.Tensor, num_devices: int) -> float:
    """The automatic bound max(1.25, occult's imbalance) on these tokens."""
    dev = expert_device_from_groups(occult(x_TE, num_devices), x_TE.shape[1])
    # (T, E) @ (E, D) counts each token's experts per device; > 0: the token sends one row to that device,
    # so the column sums are the rows each device receives (de-duplicated dispatch)
    loads = ((x_TE @ torch.nn.functional.one_hot(dev, num_devices).float()) > 0).sum(dim=0)
    return resolve_load_bound(None, float(loads.max()) / float(loads.double().mean()) if loads.sum() else 0.0)


def _lower_bound(x_TE: torch.Tensor, groups, num_devices: int, beta: float, seconds: float) -> float | None:
    """A proven bound of the summed devices under `beta` for an algorithm that gives none (HiGHS; None
    without scipy)."""
    if not scipy_available():
        return None
    res = solve_partition(
        TokenSets.from_incidence(x_TE),
        num_devices,
        [groups],
        bound=LoadBound(beta, num_devices),
        seconds=seconds,
    )
    return res.lower_bound


def _place_one(
    ids_TK, num_experts, num_devices, num_nodes, algorithm, options, budget, bound_seconds
) -> dict:
    """Place one layer (unit ids) on its fit tokens: the `LayerResult`, the load bound kept (the user's or
    the automatic one, on the pruned routing under a budget) and the seconds taken."""
    started = time.perf_counter()
    explicit = options.get("max_load_imbalance")
    x_TE = incidence(ids_TK, num_experts)
    if budget is None:
        result = solve_layer(ids_TK, num_experts, num_devices, algorithm, num_nodes, **options)
        # the bound reported with the figures: the user's, or the automatic one the algorithm resolved alike
        beta = explicit if explicit is not None else _auto_bound(x_TE, num_devices)
    else:  # the bound belongs to the pruned routing: place unpruned, then refine on the pruned routing
        # the user's bound is dropped for the unpruned solve: it is a bound on the pruned routing's loads
        plain = {k: v for k, v in options.items() if k != "max_load_imbalance"}
        result = solve_layer(ids_TK, num_experts, num_devices, algorithm, num_nodes, **plain)
        dev_E = expert_device_from_groups(result.groups, num_experts)
        pruned = pruned_figures(ids_TK, dev_E, num_devices, budget[0])
        # the automatic bound under a budget: occult's imbalance on the pruned routing, as without one
        occ = expert_device_from_groups(occult(x_TE, num_devices), num_experts)
        beta = resolve_load_bound(
            explicit, pruned_figures(ids_TK, occ, num_devices, budget[0])["load_imbalance"]
        )
        if algorithm == "solver":
            # a quarter of the solver's own budget again: the pruned refinement is a local search
            seconds = 0.25 * options.get("time_limit", SOLVER_TIME_LIMIT)
            result.groups = refine_pruned(
                ids_TK, result.groups, num_devices, budget[0], beta, deadline=time.perf_counter() + seconds
            )
            # the bounds were for the unpruned objective
            result.lower_bound, result.node_lower_bound, result.optimal = None, None, False
            result.note = "refined on the pruned routing (removed selections); bound: none under a budget"
        elif explicit is not None and pruned["load_imbalance"] > explicit * (1 + 1e-9):
            raise PlacementError(
                f"placement algorithm {algorithm!r} gives the pruned routing load imbalance "
                f"{pruned['load_imbalance']:.3f} > max_load_imbalance={explicit}; use algorithm 'solver' "
                "(it keeps the bound on the pruned routing) or raise max_load_imbalance"
            )
    # a bound for the algorithms that prove none; not under a budget (the objective changes) nor for a
    # hierarchical placement (its device objective is per node)
    if result.lower_bound is None and budget is None and num_nodes == 1 and bound_seconds > 0:
        result.lower_bound = _lower_bound(x_TE, result.groups, num_devices, beta, bound_seconds)
    return dict(result=result, load_bound=beta, seconds=time.perf_counter() - started)


def _place_in_routing_groups(ids_TK, num_experts, num_devices, group_size, algorithm, num_nodes, options):
    """Placement for a model whose router picks among contiguous routing groups (DeepSeek group-limited
    routing): groups must stay whole blocks. With whole groups per device, the groups are placed as
    units; when a group spans several devices, it keeps its slot and its experts are placed over those
    devices (on the tokens' experts inside it). No bound is reported (the units change the objective)."""
    per_device = num_experts // num_devices
    if per_device % group_size == 0:
        # expert e of routing group u = e // group_size: the groups are placed as experts of their own
        # ids // group_size maps each expert to its routing group: the groups are the units placed
        unit_groups = place_layer(
            ids_TK // group_size, num_experts // group_size, num_devices, algorithm, num_nodes, **options
        )
        # unit u covers experts u*group_size .. (u+1)*group_size - 1: expand each device's units back
        return [
            sorted(e for u in g for e in range(u * group_size, (u + 1) * group_size)) for g in unit_groups
        ]
    span = group_size // per_device  # devices per routing group
    groups: list[list[int]] = []
    for q in range(num_experts // group_size):
        # (T, K) ids local to group q (0..group_size-1), -1 for the experts outside it
        # an expert of group q has local id e - q*group_size in 0..group_size-1
        local = torch.where(ids_TK // group_size == q, ids_TK - q * group_size, -1)
        inside = local.max(dim=1).values >= 0  # tokens with at least one expert in this group
        sub = place_layer(local[inside], group_size, span, algorithm, **options)
        # the group's span devices come in order: local ids back to global expert ids
        groups.extend(sorted(q * group_size + e for e in g) for g in sub)
    return groups


def _layers_to_place(profile, holdout: float, layers: Iterable[int] | None) -> list[int]:
    """The profiled layers to place, sorted (all when `layers` is None); the holdout share checked."""
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout < 1:
        raise PlacementError(f"holdout={holdout!r} must be a share of the tokens in [0, 1), e.g. 0.5 or 0")
    if not profile.layers:
        raise PlacementError("profile has no MoE layers; profile the model with `occult-ft profile` first")
    todo = sorted(profile.layers) if layers is None else sorted({int(i) for i in layers})
    unknown = [i for i in todo if i not in profile.layers]
    if unknown or not todo:
        raise PlacementError(
            f"layers={unknown or todo!r}: place profiled layers, a non-empty subset of {sorted(profile.layers)}"
        )
    return todo


def _routing_group_size(profile, algorithm: str, num_experts: int, num_devices: int) -> int:
    """Experts per routing group that must stay whole (DeepSeek group-limited routing; 1 = none):
    whole groups per device, or each group split evenly over group_size / per_device devices."""
    # sequential keeps every contiguous block whole anyway
    group_size = int(getattr(profile, "group_size", 1) or 1) if algorithm != "sequential" else 1
    per_device = num_experts // num_devices
    if group_size > 1 and per_device % group_size and group_size % per_device:
        num_group = num_experts // group_size
        raise PlacementError(
            f"the model routes within {num_group} groups of {group_size} experts, which must stay whole, and "
            f"devices={num_devices} ({per_device} experts each) neither holds whole groups nor splits each group "
            f"evenly; use devices dividing or divisible by {num_group}, or placement 'sequential'"
        )
    return group_size


def _layer_figures(
    ids_TK: torch.Tensor, dev_E: torch.Tensor, placed: dict, num_devices: int, num_nodes: int, budget
) -> dict[str, Any]:
    """One placed layer's figures on the tokens it was placed on, with the algorithm's bounds per token,
    the gaps to them, and its time."""
    result = placed["result"]
    figures = _figures(ids_TK, dev_E, num_devices, num_nodes, budget)
    # max(1, ...): a layer with no tokens divides by 1, not 0
    tokens = max(1, figures["tokens"])
    # the algorithms bound the summed devices over the tokens; per token it bounds comm_complexity
    bound = None if result.lower_bound is None else result.lower_bound / tokens
    if bound is not None:  # an LP bound may exceed the placement it proves by the solver's tolerance
        bound = min(bound, figures["comm_complexity"])
    # gap = comm_complexity / bound - 1: the placement's distance from the proven optimum
    gap = None if not bound else figures["comm_complexity"] / bound - 1.0
    figures.update(
        lower_bound=bound,
        gap=gap,
        # proven optimal: the algorithm says so, or the placement meets a lower bound (gap 0), whoever found it
        optimal=bool(result.optimal) or (gap is not None and gap <= 1e-9),
        load_bound=placed["load_bound"],
        seconds=placed["seconds"],
        note=result.note,
    )
    if num_nodes > 1:
        node_bound = None if result.node_lower_bound is None else result.node_lower_bound / tokens
        figures["node_lower_bound"] = node_bound
        figures["node_gap"] = None if not node_bound else figures["node_complexity"] / node_bound - 1.0
    return figures


def compute_placement(
    profile,
    num_devices: int,
    num_nodes: int = 1,
    algorithm: str = DEFAULT_ALGORITHM,
    *,
    max_load_imbalance: float | None = None,
    max_devices_per_token: int | None = None,
    criterion: str = "score",
    holdout: float = 0.0,
    bound_time_limit: float = BOUND_TIME_LIMIT,
    layers: Iterable[int] | None = None,
    **options,
) -> Placement:
    """Place every profiled layer (or the profiled `layers` listed).

    Args:
        profile: object with `model`, `model_type`, `num_experts`, `top_k` and `layers`
            (layer index -> object with `.topk_ids`, (T, K) int64, best first), e.g.
            `occult_ft.profiling.Profile`.
        num_devices, num_nodes, algorithm, options: see `place_layer` (an option the algorithm does not
            take is a `PlacementError` before any layer is placed).
        max_load_imbalance: the load bound (max/mean rows per device): None = max(1.25, occult's) where
            the algorithm optimises; a number is kept strictly by every algorithm (a constructive one above
            it is a `PlacementError`). With a budget it bounds the pruned routing.
        max_devices_per_token, criterion: a pruning budget M (`criterion` score, device_max or similarity:
            the same devices). `solver` then refines the placement on the pruned routing (fewest removed
            selections within the bound; module `pruned`); the figures gain the pruned routing's.
        holdout: share of the profiled tokens held out (blocks of `HOLDOUT_BLOCK`): the placement is made
            on the rest and the figures are given for both (0 = place on all tokens).
        bound_time_limit: seconds per layer for the HiGHS lower bound of an algorithm that gives none
            (0 = no bound); `solver` brings its own.
        layers: place only these profiled layers (None = all), e.g. one process's share of the layers;
            `merge_placements` joins the shares into the placement of every layer.

    Returns:
        A `Placement` whose `metrics` hold the per-layer figures (module docstring) and their token-weighted
        overall values.
    """
    check_profile(profile)
    num_experts = profile.num_experts
    validate_sizes(num_experts, num_devices, num_nodes)
    entry = get_algorithm(algorithm)
    check_load_bound(max_load_imbalance)
    entry.check_options(options)
    check_budget(max_devices_per_token, criterion, num_devices)
    todo = _layers_to_place(profile, holdout, layers)
    group_size = _routing_group_size(profile, algorithm, num_experts, num_devices)
    budget = None if max_devices_per_token is None else (int(max_devices_per_token), criterion)
    if max_load_imbalance is not None:
        options["max_load_imbalance"] = max_load_imbalance
    groups, per_layer = {}, {}
    for layer in todo:
        ids = profile.layers[layer].topk_ids.long()
        # fit and held are token indices: a held-out block never shapes the placement it measures
        fit, held = split_holdout(ids.shape[0], holdout)  # placed on `fit`; `held` is only measured
        try:
            if group_size > 1:
                started = time.perf_counter()
                unit_groups = _place_in_routing_groups(
                    ids[fit], num_experts, num_devices, group_size, algorithm, num_nodes, options
                )
                placed: dict[str, Any] = dict(
                    result=LayerResult(unit_groups, note="placed in whole routing groups: no bound"),
                    load_bound=max_load_imbalance,
                    seconds=time.perf_counter() - started,
                )
            else:
                placed = _place_one(
                    ids[fit],
                    num_experts,
                    num_devices,
                    num_nodes,
                    algorithm,
                    options,
                    budget,
                    bound_time_limit,
                )
        except PlacementError as err:
            raise PlacementError(f"layer {layer}: {err}") from None
        groups[int(layer)] = placed["result"].groups
        dev_E = expert_device_from_groups(placed["result"].groups, num_experts)
        figures = _layer_figures(ids[fit], dev_E, placed, num_devices, num_nodes, budget)
        if len(held):
            figures["held_out"] = _figures(ids[held], dev_E, num_devices, num_nodes, budget)
        per_layer[str(layer)] = figures
    return Placement(
        getattr(profile, "model", None),
        getattr(profile, "model_type", None),
        num_experts,
        num_devices,
        num_nodes,
        algorithm,
        groups,
        _overall(per_layer, max_load_imbalance, holdout, budget),
    )


def merge_placements(parts: Iterable[Placement]) -> Placement:
    """One placement of the layers of `parts` (shares of one `compute_placement` call: same model, sizes,
    algorithm and settings, each layer in one part), with the overall figures recomputed over them."""
    if isinstance(parts, Placement) or not isinstance(parts, Iterable):
        raise PlacementError(
            f"merge_placements takes a list of Placements, not a {type(parts).__name__} ({shown(parts)})"
        )
    parts = list(parts)
    if not parts:
        raise PlacementError("merge_placements needs at least one placement")
    for i, part in enumerate(parts):
        if not isinstance(part, Placement):
            raise PlacementError(
                f"merge_placements: part {i} is a {type(part).__name__} ({shown(part)}); pass the Placements "
                "that compute_placement returned for shares of the layers"
            )
    first = parts[0]
    keys = ("model_type", "num_experts", "num_devices", "num_nodes", "algorithm")
    settings = ("max_load_imbalance", "holdout", "max_devices_per_token", "criterion")
    groups: dict[int, list[list[int]]] = {}
    per_layer: dict[str, dict] = {}
    for part in parts:
        for key in keys + settings:
            mine = getattr(part, key) if key in keys else part.metrics.get(key)
            theirs = getattr(first, key) if key in keys else first.metrics.get(key)
            if mine != theirs:
                raise PlacementError(
                    f"merge_placements: {key} {mine!r} != {theirs!r}; merge shares of one call"
                )
        twice = sorted(set(groups) & set(part.groups))
        if twice:
            raise PlacementError(f"merge_placements: layers {twice} are in two parts; give each layer once")
        groups.update(part.groups)
        per_layer.update(part.metrics.get("layers", {}))
    metrics = first.metrics
    budget = None
    if metrics.get("max_devices_per_token") is not None:
        budget = (metrics["max_devices_per_token"], metrics["criterion"])
    ordered = {str(k): per_layer[str(k)] for k in sorted(groups) if str(k) in per_layer}
    # a part without per-layer figures (e.g. a hand-written file) leaves the overall figures unknown
    overall = (
        _overall(ordered, metrics.get("max_load_imbalance"), metrics.get("holdout", 0.0), budget)
        if len(ordered) == len(groups)
        else {}
    )
    return Placement(
        first.model,
        first.model_type,
        first.num_experts,
        first.num_devices,
        first.num_nodes,
        first.algorithm,
        groups,
        overall,
    )


def _overall(per_layer: dict, max_load_imbalance, holdout: float, budget) -> dict:
    """Token-weighted means over the layers (max for load imbalance) and the settings."""

    def mean(rows, key):  # weighted by each layer's tokens: a layer profiled on more tokens counts more
        tokens = sum(r["tokens"] for r in rows)
        return sum(r[key] * r["tokens"] for r in rows) / tokens if tokens else 0.0

    rows = list(per_layer.values())
    out = dict(
        comm_complexity_sequential=mean(rows, "comm_complexity_sequential"),
        comm_complexity=mean(rows, "comm_complexity"),
        # the worst layer: the slowest device of any layer sets the step time
        load_imbalance=max(r["load_imbalance"] for r in rows),
        # a mean bound needs every layer's: one layer without a bound leaves the overall unknown
        lower_bound=mean(rows, "lower_bound") if all(r["lower_bound"] is not None for r in rows) else None,
        max_load_imbalance=max_load_imbalance,
        holdout=holdout,
        seconds=sum(r["seconds"] for r in rows),
    )
    out["gap"] = out["comm_complexity"] / out["lower_bound"] - 1.0 if out["lower_bound"] else None
    if budget is not None:
        out["max_devices_per_token"], out["criterion"] = budget
    held = [r["held_out"] for r in rows if "held_out" in r]
    if held:
        out["held_out"] = dict(
            tokens=sum(r["tokens"] for r in held),
            comm_complexity_sequential=mean(held, "comm_complexity_sequential"),
            comm_complexity=mean(held, "comm_complexity"),
            load_imbalance=max(r["load_imbalance"] for r in held),
        )
    out["layers"] = per_layer
    return out


def sequential_placement(
    num_experts: int,
    num_devices: int,
    layer_indices: Iterable[int],
    model: str | None = None,
    model_type: str | None = None,
) -> Placement:
    """The framework default (contiguous experts per device) as a `Placement`, for every listed layer."""
    validate_sizes(num_experts, num_devices, 1)
    # sequential ignores the routing: zero tokens give the same groups
    groups = sequential(torch.zeros(0, num_experts), num_devices)
    return Placement(
        model,
        model_type,
        num_experts,
        num_devices,
        1,
        "sequential",
        {int(i): [list(g) for g in groups] for i in layer_indices},
    )
