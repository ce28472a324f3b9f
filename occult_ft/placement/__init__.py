"""Collaboration-aware expert placement: which device hosts which expert, the placement file, and the
weight permutation that makes a placed model contiguous.

    core.py        PlacementError, routing -> incidence helpers, the exact objective, the load bound, the
                   per-layer result, the two-level (nodes, then devices) composition
    algorithms.py  the one algorithm registry `PLACEMENT_ALGORITHMS` (and its dispatch) and the constructive
                   sequential / occult / greedy_pairs
    search.py      `search`: swap local search, and its hierarchical guarantee
    partition.py   set partitioning on HiGHS (scipy): column generation, exact pricing, lower bounds, MILP
    lns.py         pair moves: two devices re-solved exactly at a time
    solver.py      `solver` (the default): search, pair moves, the exact model; hierarchical with bounds
    pruned.py      the routing after a `max_devices_per_token` budget, and the local search on it
    layer.py       `place_layer`, `solve_layer`, `compute_placement` (per-layer figures, or a share of the
                   layers), `merge_placements`, `sequential_placement`
    file.py        `Placement` and its JSON file
    permute.py     `permute_experts`
    replicas.py    `place_replicas`: which experts get a redundant copy on which device

The time to place DeepSeek-V3 width is measured by `benchmarks/placement_time.py`; how far each algorithm is
from the optimum by `benchmarks/placement_gap.py`.
"""

from __future__ import annotations

from .algorithms import DEFAULT_ALGORITHM, PLACEMENT_ALGORITHMS, PlacementAlgorithm, register_algorithm
from .core import DEFAULT_LOAD_IMBALANCE, LayerResult, PlacementError, coactivation_matrix
from .file import PLACEMENT_FORMAT, PLACEMENT_VERSION, Placement
from .layer import compute_placement, merge_placements, place_layer, sequential_placement, solve_layer
from .partition import scipy_available
from .permute import permute_experts
from .pruned import PRUNING_CRITERIA
from .search import SEARCH_CELLS, SEARCH_RESTARTS
from .solver import SOLVER_TIME_LIMIT

__all__ = [
    "PLACEMENT_ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "DEFAULT_LOAD_IMBALANCE",
    "PLACEMENT_FORMAT",
    "PLACEMENT_VERSION",
    "PRUNING_CRITERIA",
    "SEARCH_CELLS",
    "SEARCH_RESTARTS",
    "SOLVER_TIME_LIMIT",
    "LayerResult",
    "PlacementAlgorithm",
    "PlacementError",
    "Placement",
    "coactivation_matrix",
    "place_layer",
    "solve_layer",
    "compute_placement",
    "merge_placements",
    "register_algorithm",
    "scipy_available",
    "sequential_placement",
    "permute_experts",
]
