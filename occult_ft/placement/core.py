"""What every placement module shares: the error type, the routing -> incidence helpers, the exact
objective, the load bound, size validation, the per-layer result and the two-level (nodes, then
devices) composition of a layer placement.

Shape legend: T tokens, K experts per token, E experts, D devices (or nodes, for the node level).
    topk_ids_TK   int64 expert ids per token; -1 marks an empty slot (used for per-node sub-problems)
    x_TE          float32 0/1 incidence: x_TE[t, e] = 1 if token t selected expert e
    dev_E         int64 device of each expert
    load_D        rows each device receives: tokens with at least one expert on it (`metrics.device_load`)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..checks import is_positive_int
from ..layout import ExpertLayout

__all__ = [
    "DEFAULT_LOAD_IMBALANCE",
    "RERUN",
    "LayerResult",
    "PlacementError",
    "Solver",
    "check_load_bound",
    "check_profile",
    "check_routing",
    "coactivation_matrix",
    "device_loads",
    "device_to_groups",
    "devices_total",
    "imbalance",
    "incidence",
    "level_totals",
    "resolve_load_bound",
    "shown",
    "node_incidence",
    "two_level",
    "validate_sizes",
]

RERUN = "re-run `occult-ft place` on this model's profile"
DEFAULT_LOAD_IMBALANCE = 1.25  # the automatic bound: max(this, occult's imbalance on the layer)


class PlacementError(ValueError):
    """A placement request or file a user got wrong; the message names the value and the fix."""


def shown(value, width: int = 60) -> str:
    """`repr(value)` cut to `width` characters, for messages that quote what a caller passed."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def validate_sizes(num_experts: int, num_devices: int, num_nodes: int) -> None:
    """E is a positive integer, D must divide E and N must divide D (a one-line `PlacementError` otherwise)."""
    if not is_positive_int(num_experts):
        raise PlacementError(
            f"num_experts={shown(num_experts)} must be a positive integer (routed experts per layer)"
        )
    try:
        ExpertLayout(num_experts, num_devices, num_nodes)
    except ValueError as error:
        raise PlacementError(str(error)) from None


def check_routing(topk_ids_TK, where: str = "topk_ids_TK") -> None:
    """A (T, K) integer tensor of expert ids (a one-line `PlacementError` naming `where` otherwise)."""
    if not isinstance(topk_ids_TK, torch.Tensor):
        raise PlacementError(
            f"{where} is a {type(topk_ids_TK).__name__} ({shown(topk_ids_TK)}); pass a (tokens, top_k) integer "
            "torch.Tensor of expert ids, e.g. a profile's layers[i].topk_ids"
        )
    if topk_ids_TK.dim() != 2 or topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype.is_complex:
        raise PlacementError(
            f"{where} is a {topk_ids_TK.dim()}-D {topk_ids_TK.dtype} tensor; pass a (tokens, top_k) integer "
            "tensor of expert ids (-1 = empty slot)"
        )


def check_profile(profile, where: str = "profile") -> None:
    """A routing profile (`occult_ft.profiling.Profile`, or an object with its `num_experts` and `layers`:
    layer index -> object with a (T, K) integer `topk_ids`); a one-line `PlacementError` otherwise."""
    need = "pass an occult_ft.profiling.Profile (Profile.load(PATH) of `occult-ft profile`'s file, or profile_model)"
    missing = [a for a in ("num_experts", "layers") if not hasattr(profile, a)]
    if missing:
        raise PlacementError(
            f"{where} is a {type(profile).__name__} ({shown(profile)}) with no {' or '.join(missing)}; {need}"
        )
    if not is_positive_int(profile.num_experts):
        raise PlacementError(
            f"{where}.num_experts={shown(profile.num_experts)} must be a positive integer; {need}"
        )
    if not isinstance(profile.layers, dict):
        raise PlacementError(
            f"{where}.layers is a {type(profile.layers).__name__}; it must map layer index -> layer profile; {need}"
        )
    for index, layer in profile.layers.items():
        if not hasattr(layer, "topk_ids"):
            raise PlacementError(f"{where}.layers[{index!r}] has no topk_ids; {need}")
        check_routing(layer.topk_ids, f"{where}.layers[{index!r}].topk_ids")


def check_load_bound(max_load_imbalance) -> None:
    """None (automatic) or a number >= 1; anything else is a one-line `PlacementError`."""
    if max_load_imbalance is None:
        return
    if (
        isinstance(max_load_imbalance, bool)
        or not isinstance(max_load_imbalance, (int, float))
        or not (max_load_imbalance >= 1)
        # >= 1 also rejects NaN (every comparison with NaN is False); inf would allow any imbalance
        or max_load_imbalance == float("inf")
    ):
        raise PlacementError(
            f"max_load_imbalance={max_load_imbalance!r} must be a number >= 1 (max/mean rows per device), or "
            f"None for the automatic bound max({DEFAULT_LOAD_IMBALANCE}, occult's imbalance)"
        )


def resolve_load_bound(max_load_imbalance: float | None, occult_imbalance: float) -> float:
    """The bound an optimising algorithm keeps: the user's number, or (None) max(1.25, occult's imbalance)
    so that the paper's placement is always admissible."""
    if max_load_imbalance is None:
        return max(DEFAULT_LOAD_IMBALANCE, occult_imbalance)
    return float(max_load_imbalance)


# ---- routing helpers ---------------------------------------------------------------------------
def incidence(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(T', E) float32 0/1 incidence of the tokens that selected at least one expert (-1 slots ignored)."""
    ids = topk_ids_TK.long().cpu()
    ids = torch.where(ids >= 0, ids, num_experts)  # -1 -> spare column E, dropped below
    # scatter_add counts each (token, expert) hit in its column; the spare column E takes the -1 slots
    x = torch.zeros(ids.shape[0], num_experts + 1).scatter_add_(1, ids, torch.ones(ids.shape))
    # clamp: an expert listed twice in one row (padded or repeated ids) still counts once
    x = x[:, :num_experts].clamp_(max=1.0)
    # a token with no expert left (all slots -1, e.g. outside a node's experts) loads nothing: dropped
    return x[x.sum(dim=1) > 0].contiguous()


def coactivation_matrix(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Co-selection counts of expert pairs.

    Args:
        topk_ids_TK: (T, K) int expert ids per token (-1 = empty slot).
        num_experts: E.

    Returns:
        (E, E) int64: [a, b] = tokens that selected both a and b; the diagonal is each expert's load.
    """
    check_routing(topk_ids_TK)
    if not is_positive_int(num_experts):
        raise PlacementError(
            f"num_experts={shown(num_experts)} must be a positive integer (routed experts per layer)"
        )
    x = incidence(topk_ids_TK, num_experts).double()
    return (x.T @ x).round().long()  # float64 sums of 0/1 products: exact integers below 2**53


def device_to_groups(dev_E: torch.Tensor, num_devices: int) -> list[list[int]]:
    # group d = the experts whose device is d, ascending
    return [sorted((dev_E == d).nonzero().flatten().tolist()) for d in range(num_devices)]


def device_loads(x_TE: torch.Tensor, dev_E: torch.Tensor, num_devices: int) -> torch.Tensor:
    """(D,) tokens of x_TE reaching each device (the rows it receives under de-duplicated dispatch)."""
    onehot_ED = torch.nn.functional.one_hot(dev_E, num_devices).float()
    # (T, E) @ (E, D): the token's experts on each device; > 0: one row however many of them are there
    return ((x_TE @ onehot_ED) > 0).sum(dim=0)


def devices_total(x_TE: torch.Tensor, dev_E: torch.Tensor, num_devices: int) -> float:
    """Sum over tokens of distinct devices reached (comm_complexity times T): the placement objective."""
    return float(device_loads(x_TE, dev_E, num_devices).sum())


def imbalance(load_D: torch.Tensor) -> float:
    """max / mean of a load vector (`metrics.load_imbalance`'s definition; 0.0 for no load)."""
    mean = float(load_D.double().mean())
    # float64: a mean of integer loads stays exact; no load at all has no imbalance (0.0, not NaN)
    return float(load_D.double().max()) / mean if mean > 0 else 0.0


@dataclass
class LayerResult:
    """One layer's placement as an algorithm returns it.

    Args:
        groups: D lists of E/D expert ids; device d belongs to node d // (D/N).
        lower_bound: a proven lower bound of the summed distinct devices over the placed tokens (under the
            same load bound), or None when the algorithm computes none.
        optimal: True when `groups` is proven optimal (the bound is met).
        node_lower_bound: the same at the node level of a hierarchical placement (None otherwise).
        note: what the algorithm did, for the placement file (e.g. a fallback).
    """

    groups: list[list[int]]
    lower_bound: float | None = None
    optimal: bool = False
    node_lower_bound: float | None = None
    note: str | None = None


# ---- hierarchical placement -----------------------------------------------------------------------
Solver = Callable[..., list[list[int]] | LayerResult]  # solve(x_TE, num_devices, **options) -> groups[d]


def two_level(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    num_nodes: int,
    solve: Solver,
    *,
    node_groups: list[list[int]] | None = None,
    seed: int | None = None,
) -> list[list[int]]:
    """Place experts onto N nodes (objective: distinct nodes per token), then each node's E/N experts onto
    its D/N devices (objective: distinct devices per token within the node, ids local to the node).

    `node_groups` skips the node level (given node partition). With `seed`, the node level gets `seed` and
    node i's device level `seed + i + 1`. Returns D groups; device d belongs to node d // (D/N).
    """
    ids = topk_ids_TK.long().cpu()
    extra = {} if seed is None else {"seed": seed}
    if node_groups is None:
        top = solve(incidence(ids, num_experts), num_nodes, **extra)
        # the node level: N groups of E/N experts, the tokens' distinct nodes as the objective
        node_groups = top.groups if isinstance(top, LayerResult) else top  # a solver may return either
    groups: list[list[int]] = []
    for node, members in enumerate(node_groups):
        # the node's sub-problem: the tokens that selected one of its experts, on its experts only
        sub_x = node_incidence(ids, num_experts, members)
        extra = {} if seed is None else {"seed": seed + node + 1}
        sub = solve(sub_x, num_devices // num_nodes, **extra)  # D/N devices per node, ids local to it
        sub_groups = sub.groups if isinstance(sub, LayerResult) else sub
        # node n's devices come n-th, so device d is on node d // (D/N); local ids back to expert ids
        groups.extend(sorted(members[i] for i in g) for g in sub_groups)
    return groups


def node_incidence(topk_ids_TK: torch.Tensor, num_experts: int, members: list[int]) -> torch.Tensor:
    """Incidence of the tokens on one node's experts, columns numbered 0..len(members)-1 in `members` order."""
    ids = topk_ids_TK.long().cpu()
    local = torch.full((num_experts + 1,), -1, dtype=torch.long)  # slot E: the -1 sentinel
    # local[e] = position of global expert e in `members`, -1 for the experts of other nodes (and slot E)
    local[torch.tensor(members)] = torch.arange(len(members))
    # -1 slots map to E, which maps to -1 again, so incidence drops them with the other nodes' experts
    return incidence(local[torch.where(ids >= 0, ids, num_experts)], len(members))


def level_totals(
    x_TE: torch.Tensor, groups: list[list[int]], num_devices: int, num_nodes: int
) -> tuple[float, float]:
    """(summed distinct nodes, summed distinct devices) over the tokens of x_TE for a D-device placement."""
    dev_E = torch.empty(x_TE.shape[1], dtype=torch.long)
    for d, group in enumerate(groups):
        dev_E[group] = d
    return (  # a tuple: compared lexicographically, nodes first
        devices_total(x_TE, dev_E // (num_devices // num_nodes), num_nodes),  # node of a device: d // (D/N)
        devices_total(x_TE, dev_E, num_devices),
    )
