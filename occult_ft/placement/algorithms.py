"""The placement algorithm registry and the constructive algorithms (sequential, occult, greedy_pairs).

Each algorithm is a solver `solve(x_TE, num_devices, *, <options>) -> groups[d]` (sorted expert ids on
device d) registered once in `PLACEMENT_ALGORITHMS`. Its keyword-only parameters are its options, read
from the signature: an option it does not take is a one-line `PlacementError`, never swallowed. An
entry may also bring its own hierarchical (nodes, then devices) placement; otherwise the solver runs at
both levels (`core.two_level`). Every entry also takes `max_load_imbalance` (`PlacementAlgorithm.place`).

    sequential    device d holds experts [d*E/D, (d+1)*E/D): what every framework does.
    occult        the paper's greedy, farthest-point style: device 0 is seeded with the most co-selected
                  pair, each further device with the unplaced expert least co-selected with everything
                  placed so far; devices are then filled round-robin (device 0, 1, ..., D-1, 0, ...), each
                  taking the unplaced expert with the highest mean co-selection with its members.
                  Round-robin (rather than filling device 0 completely first) keeps early devices from
                  taking the experts that belong with later seeds.
    greedy_pairs  the public variant: walk expert pairs by co-selection count, merging the two groups
                  whenever the merged group still fits on a device; leftover groups are packed first-fit
                  decreasing (a group that fits nowhere is split over the devices with room left).
    search        (`search.py`) swap local search from the best of the three.
    solver        (default; `solver.py`) set partitioning on HiGHS with a proven lower bound, started from
                  `search`; falls back to `search` when scipy is missing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial

import torch

from .core import (
    RERUN,
    LayerResult,
    PlacementError,
    Solver,
    check_load_bound,
    check_routing,
    device_loads,
    imbalance,
    incidence,
    two_level,
    validate_sizes,
)

__all__ = [
    "DEFAULT_ALGORITHM",
    "PLACEMENT_ALGORITHMS",
    "UNIVERSAL_OPTIONS",
    "PlacementAlgorithm",
    "get_algorithm",
    "greedy_pairs",
    "occult",
    "register_algorithm",
    "sequential",
]

DEFAULT_ALGORITHM = "solver"  # registered by `solver.py`; falls back to `search` without scipy
UNIVERSAL_OPTIONS = ("max_load_imbalance",)  # every algorithm takes these (see `PlacementAlgorithm.place`)


@dataclass(frozen=True)
class PlacementAlgorithm:
    """One registry entry.

    Args:
        name: the key in `PLACEMENT_ALGORITHMS` (and `occult-ft place --algorithm`).
        solve: `solve(x_TE, num_devices, *, <options>) -> groups` or a `LayerResult`; its keyword-only
            parameters (with defaults) are the algorithm's options; `**kwargs` is not allowed.
        hierarchical: optional `fn(topk_ids_TK, num_experts, num_devices, num_nodes, *, <options>) ->
            groups` (or a `LayerResult`) for num_nodes > 1, taking the same options; default: `solve` at
            both levels.
    Calling an entry is `place_layer(topk_ids_TK, num_experts, num_devices, algorithm=name, **kwargs)`.
    """

    name: str
    solve: Solver
    hierarchical: Solver | None = None
    options: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        # the registry reads an algorithm's options from its signature: a catch-all would hide them
        params = inspect.signature(self.solve).parameters.values()
        if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
            raise TypeError(
                f"placement algorithm {self.name!r}: solve must name its options, not take *args/**kw"
            )
        # the keyword-only parameters are the options: `check_options` and its hints read them from here
        options = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        if self.hierarchical is not None:
            hier = inspect.signature(self.hierarchical).parameters.values()
            if tuple(p.name for p in hier if p.kind is p.KEYWORD_ONLY) != options:
                raise TypeError(
                    f"placement algorithm {self.name!r}: hierarchical must take the options {options}"
                )
        object.__setattr__(self, "options", options)

    def check_options(self, options) -> None:
        """Raise a one-line `PlacementError` naming the first option this algorithm does not take
        (`max_load_imbalance` is taken by every algorithm)."""
        for key in options:
            if key in self.options or key in UNIVERSAL_OPTIONS:
                continue
            takes = f"its options are {', '.join(self.options)}" if self.options else "it takes no options"
            owners = [a.name for a in PLACEMENT_ALGORITHMS.values() if key in a.options]
            hint = f" ({key!r} is an option of {', '.join(map(repr, owners))})" if owners else ""
            raise PlacementError(f"placement algorithm {self.name!r} has no option {key!r}; {takes}{hint}")

    def place(
        self, topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, num_nodes: int = 1, **options
    ) -> LayerResult:
        """Place one layer (validated inputs, flat or hierarchical) and return its `LayerResult`.

        `max_load_imbalance` (None or a number >= 1) is passed to an algorithm that takes it (it keeps
        max/mean device load within it while it optimises); any other algorithm's result is checked against
        it, and a placement above the bound is a one-line `PlacementError`.
        """
        check_routing(topk_ids_TK)
        validate_sizes(num_experts, num_devices, num_nodes)
        # the bound is taken out of the options: an algorithm without it is checked after it ran (below)
        bound = options.pop("max_load_imbalance", None)
        check_load_bound(bound)
        self.check_options(options)
        if topk_ids_TK.dim() != 2:
            raise PlacementError(f"topk_ids must be (tokens, top_k), got shape {tuple(topk_ids_TK.shape)}")
        # -1 marks an empty slot (a token routed to fewer than k experts); any other id must be an expert
        if topk_ids_TK.numel() and (int(topk_ids_TK.max()) >= num_experts or int(topk_ids_TK.min()) < -1):
            bad = int(topk_ids_TK.max()) if int(topk_ids_TK.max()) >= num_experts else int(topk_ids_TK.min())
            raise PlacementError(
                f"topk_ids hold expert id {bad} but the layer has {num_experts} experts; {RERUN}"
            )
        takes_bound = "max_load_imbalance" in self.options
        if takes_bound:
            options["max_load_imbalance"] = bound
        if num_nodes == 1:
            # one level: the solver sees the (T, E) incidence; hierarchical ones take the raw routing ids
            out = self.solve(incidence(topk_ids_TK, num_experts), num_devices, **options)
        elif self.hierarchical is not None:
            out = self.hierarchical(topk_ids_TK, num_experts, num_devices, num_nodes, **options)
        else:  # the same solver and options at both levels
            out = two_level(topk_ids_TK, num_experts, num_devices, num_nodes, partial(self.solve, **options))
        result = out if isinstance(out, LayerResult) else LayerResult(out)
        result.groups = [sorted(g) for g in result.groups]  # one spelling per placement: files compare equal
        # also checks the algorithms that take the bound: hierarchical search keeps it per node, and the
        # whole layer's devices must keep it too
        if bound is not None:
            x_TE = incidence(topk_ids_TK, num_experts)
            dev_E = torch.empty(num_experts, dtype=torch.long)
            for d, group in enumerate(result.groups):
                dev_E[group] = d
            found = imbalance(device_loads(x_TE, dev_E, num_devices))
            if found > bound * (1 + 1e-9):  # relative slack: a placement exactly at the bound keeps it
                raise PlacementError(
                    f"placement algorithm {self.name!r} gives load imbalance {found:.3f} > max_load_imbalance="
                    f"{bound}; use algorithm 'solver' or 'search' (they keep the bound) or raise max_load_imbalance"
                )
        return result

    def __call__(self, topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, **kwargs):
        """`place_layer(topk_ids_TK, num_experts, num_devices, algorithm=name, **kwargs)`: the groups."""
        return self.place(topk_ids_TK, num_experts, num_devices, **kwargs).groups


PLACEMENT_ALGORITHMS: dict[str, PlacementAlgorithm] = {}


def register_algorithm(name: str, solve: Solver, hierarchical: Solver | None = None) -> PlacementAlgorithm:
    """Add an algorithm to `PLACEMENT_ALGORITHMS`; a name registered twice is a ValueError."""
    if name in PLACEMENT_ALGORITHMS:
        raise ValueError(f"placement algorithm {name!r} is registered already; pick another name")
    PLACEMENT_ALGORITHMS[name] = PlacementAlgorithm(name, solve, hierarchical)
    return PLACEMENT_ALGORITHMS[name]


def get_algorithm(name: str) -> PlacementAlgorithm:
    """The registry entry, or a one-line `PlacementError` listing the registered names."""
    if name not in PLACEMENT_ALGORITHMS:
        raise PlacementError(
            f"unknown placement algorithm {name!r}; use one of {', '.join(sorted(PLACEMENT_ALGORITHMS))}"
        )
    return PLACEMENT_ALGORITHMS[name]


# ---- the constructive algorithms (on the incidence matrix) --------------------------------------
def sequential(x_TE: torch.Tensor, num_devices: int) -> list[list[int]]:
    per = x_TE.shape[1] // num_devices
    # device d holds experts d*per .. (d+1)*per - 1: the placement before any optimisation
    return [list(range(d * per, (d + 1) * per)) for d in range(num_devices)]


def occult(x_TE: torch.Tensor, num_devices: int) -> list[list[int]]:
    num_experts = x_TE.shape[1]
    per = num_experts // num_devices
    if per == 1 or num_devices == 1:
        return sequential(x_TE, num_devices)
    # co_EE[a, b]: tokens selecting both a and b; the diagonal is each expert's own token count (its load)
    co_EE = (x_TE.T @ x_TE).double()
    load_E = co_EE.diagonal().clone()
    co_EE.fill_diagonal_(0.0)
    placed = torch.zeros(num_experts, dtype=torch.bool)
    # device 0: the most co-selected pair (argmax over the upper triangle, first on ties; the +1 lets a
    # zero-count pair beat the zeroed lower triangle)
    pair_scores = torch.triu(co_EE + 1.0, diagonal=1)
    a, b = divmod(int(pair_scores.argmax()), num_experts)  # flat index of the (E, E) matrix -> (row, col)
    groups = [[a, b]] + [[] for _ in range(num_devices - 1)]
    placed[[a, b]] = True
    # devices 1..D-1: the unplaced expert least co-selected with all placed ones (ties: highest load)
    for d in range(1, num_devices):
        # co-selection of each unplaced expert with the experts placed so far; placed ones never win (inf)
        score_E = co_EE[:, placed].sum(dim=1).masked_fill(placed, float("inf"))
        ties = score_E == score_E.min()
        e = int(load_E.masked_fill(~ties, -1.0).argmax())  # -1: below any load, so never a non-tie
        groups[d].append(e)
        placed[e] = True
    # fill round-robin: each device takes the unplaced expert of highest mean co-selection with it
    while not bool(placed.all()):
        for group in groups:
            if len(group) == per:
                continue
            # mean, not sum: a device's score does not grow with how many members it already has
            mean_E = co_EE[:, group].mean(dim=1).masked_fill(placed, -1.0)
            e = int(mean_E.argmax())
            group.append(e)
            placed[e] = True
    return [sorted(g) for g in groups]


def greedy_pairs(x_TE: torch.Tensor, num_devices: int) -> list[list[int]]:
    num_experts = x_TE.shape[1]
    per = num_experts // num_devices
    if per == 1 or num_devices == 1:
        return sequential(x_TE, num_devices)
    co_EE = (x_TE.T @ x_TE).double()  # co-selection counts, as in `occult`
    load = co_EE.diagonal().tolist()
    rows, cols = torch.triu_indices(num_experts, num_experts, offset=1)  # each pair a < b once
    counts = co_EE[rows, cols]
    order = torch.argsort(counts, descending=True, stable=True)
    order = order[counts[order] > 0]  # a pair never selected together gives no reason to merge
    group_of = list(range(num_experts))  # expert -> group id
    members: dict[int, list[int]] = {e: [e] for e in range(num_experts)}
    for a, b in zip(rows[order].tolist(), cols[order].tolist()):
        ga, gb = group_of[a], group_of[b]
        # already together, or the union would overflow a device of `per` experts
        if ga == gb or len(members[ga]) + len(members[gb]) > per:
            continue
        for e in members[gb]:  # union: gb's members join ga (groups stay at most `per` experts)
            group_of[e] = ga
        members[ga].extend(members.pop(gb))
    # first-fit decreasing into D devices of `per`; a group that fits nowhere is split, heaviest first
    leftovers = sorted(members.values(), key=lambda g: (-len(g), min(g)))
    devices: list[list[int]] = [[] for _ in range(num_devices)]
    for group in leftovers:
        # the first device with room for the whole group
        target = next((dv for dv in devices if len(dv) + len(group) <= per), None)
        if target is not None:
            target.extend(group)
            continue
        for e in sorted(group, key=lambda e: (-load[e], e)):
            # no device has room for it whole: its experts go one by one, heaviest first, into the first free slot
            next(dv for dv in devices if len(dv) < per).append(e)
    return [sorted(dv) for dv in devices]


register_algorithm("sequential", sequential)
register_algorithm("occult", occult)
register_algorithm("greedy_pairs", greedy_pairs)
