"""The placement algorithm registry and the constructive algorithms (sequential, occult, greedy_pairs).

Each algorithm is a solver `solve(x_TE, num_devices, *, <options>) -> groups[d]` (sorted expert ids on
device d) registered once in `PLACEMENT_ALGORITHMS`. Its keyword-only parameters are its options, read
from the signature: an option it does not take is a one-line `PlacementError`, never swallowed. An
entry may also bring its own hierarchical (nodes, then devices) placement; otherwise the solver runs at
both levels (`core._two_level`).

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
    search        (default; `search.py`) swap local search from the best of the three.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from .core import PlacementError, Solver

__all__ = ["PlacementAlgorithm", "PLACEMENT_ALGORITHMS", "register_algorithm"]


@dataclass(frozen=True)
class PlacementAlgorithm:
    """One registry entry.

    Args:
        name: the key in `PLACEMENT_ALGORITHMS` (and `occult-ft place --algorithm`).
        solve: `solve(x_TE, num_devices, *, <options>) -> groups`; its keyword-only parameters (with
            defaults) are the algorithm's options; `**kwargs` is not allowed.
        hierarchical: optional `fn(topk_ids_TK, num_experts, num_devices, num_nodes, *, <options>) ->
            groups` for num_nodes > 1, taking the same options; default: `solve` at both levels.
    Calling an entry is `place_layer(topk_ids_TK, num_experts, num_devices, algorithm=name, **kwargs)`.
    """

    name: str
    solve: Solver
    hierarchical: Solver | None = None
    options: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        params = inspect.signature(self.solve).parameters.values()
        if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
            raise TypeError(
                f"placement algorithm {self.name!r}: solve must name its options, not take *args/**kw"
            )
        options = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        if self.hierarchical is not None:
            hier = inspect.signature(self.hierarchical).parameters.values()
            if tuple(p.name for p in hier if p.kind is p.KEYWORD_ONLY) != options:
                raise TypeError(
                    f"placement algorithm {self.name!r}: hierarchical must take the options {options}"
                )
        object.__setattr__(self, "options", options)

    def check_options(self, options) -> None:
        """Raise a one-line `PlacementError` naming the first option this algorithm does not take."""
        for key in options:
            if key in self.options:
                continue
            takes = f"its options are {', '.join(self.options)}" if self.options else "it takes no options"
            owners = [a.name for a in PLACEMENT_ALGORITHMS.values() if key in a.options]
            hint = f" ({key!r} is an option of {', '.join(map(repr, owners))})" if owners else ""
            raise PlacementError(f"placement algorithm {self.name!r} has no option {key!r}; {takes}{hint}")

    def __call__(self, topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, **kwargs):
        from .layer import place_layer

        return place_layer(topk_ids_TK, num_experts, num_devices, algorithm=self.name, **kwargs)


PLACEMENT_ALGORITHMS: dict[str, PlacementAlgorithm] = {}


def register_algorithm(name: str, solve: Solver, hierarchical: Solver | None = None) -> PlacementAlgorithm:
    """Add an algorithm to `PLACEMENT_ALGORITHMS`; a name registered twice is a ValueError."""
    if name in PLACEMENT_ALGORITHMS:
        raise ValueError(f"placement algorithm {name!r} is registered already; pick another name")
    PLACEMENT_ALGORITHMS[name] = PlacementAlgorithm(name, solve, hierarchical)
    return PLACEMENT_ALGORITHMS[name]


# ---- the constructive algorithms (on the incidence matrix) --------------------------------------
def _sequential(x_TE: torch.Tensor, num_devices: int) -> list[list[int]]:
    per = x_TE.shape[1] // num_devices
    return [list(range(d * per, (d + 1) * per)) for d in range(num_devices)]


def _occult(x_TE: torch.Tensor, num_devices: int) -> list[list[int]]:
    num_experts = x_TE.shape[1]
    per = num_experts // num_devices
    if per == 1 or num_devices == 1:
        return _sequential(x_TE, num_devices)
    co_EE = (x_TE.T @ x_TE).double()
    load_E = co_EE.diagonal().clone()
    co_EE.fill_diagonal_(0.0)
    placed = torch.zeros(num_experts, dtype=torch.bool)
    # device 0: the most co-selected pair (argmax over the upper triangle, first on ties; the +1 lets a
    # zero-count pair beat the zeroed lower triangle)
    pair_scores = torch.triu(co_EE + 1.0, diagonal=1)
    a, b = divmod(int(pair_scores.argmax()), num_experts)
    groups = [[a, b]] + [[] for _ in range(num_devices - 1)]
    placed[[a, b]] = True
    # devices 1..D-1: the unplaced expert least co-selected with all placed ones (ties: highest load)
    for d in range(1, num_devices):
        score_E = co_EE[:, placed].sum(dim=1).masked_fill(placed, float("inf"))
        ties = score_E == score_E.min()
        e = int(load_E.masked_fill(~ties, -1.0).argmax())
        groups[d].append(e)
        placed[e] = True
    # fill round-robin: each device takes the unplaced expert of highest mean co-selection with it
    while not bool(placed.all()):
        for group in groups:
            if len(group) == per:
                continue
            mean_E = co_EE[:, group].mean(dim=1).masked_fill(placed, -1.0)
            e = int(mean_E.argmax())
            group.append(e)
            placed[e] = True
    return [sorted(g) for g in groups]


def _greedy_pairs(x_TE: torch.Tensor, num_devices: int) -> list[list[int]]:
    num_experts = x_TE.shape[1]
    per = num_experts // num_devices
    if per == 1 or num_devices == 1:
        return _sequential(x_TE, num_devices)
    co_EE = (x_TE.T @ x_TE).double()
    load = co_EE.diagonal().tolist()
    rows, cols = torch.triu_indices(num_experts, num_experts, offset=1)
    counts = co_EE[rows, cols]
    order = torch.argsort(counts, descending=True, stable=True)
    order = order[counts[order] > 0]
    group_of = list(range(num_experts))  # expert -> group id
    members: dict[int, list[int]] = {e: [e] for e in range(num_experts)}
    for a, b in zip(rows[order].tolist(), cols[order].tolist()):
        ga, gb = group_of[a], group_of[b]
        if ga == gb or len(members[ga]) + len(members[gb]) > per:
            continue
        for e in members[gb]:
            group_of[e] = ga
        members[ga].extend(members.pop(gb))
    # first-fit decreasing into D devices of `per`; a group that fits nowhere is split, heaviest first
    leftovers = sorted(members.values(), key=lambda g: (-len(g), min(g)))
    devices: list[list[int]] = [[] for _ in range(num_devices)]
    for group in leftovers:
        target = next((dv for dv in devices if len(dv) + len(group) <= per), None)
        if target is not None:
            target.extend(group)
            continue
        for e in sorted(group, key=lambda e: (-load[e], e)):
            next(dv for dv in devices if len(dv) < per).append(e)
    return [sorted(dv) for dv in devices]


register_algorithm("sequential", _sequential)
register_algorithm("occult", _occult)
register_algorithm("greedy_pairs", _greedy_pairs)
