"""Collaboration-aware expert placement: which device hosts which expert, the placement file, and the
weight permutation that makes a placed model contiguous.

    core.py        PlacementError, routing -> incidence helpers, the exact objective, size checks,
                   the two-level (nodes, then devices) composition
    algorithms.py  the one algorithm registry `PLACEMENT_ALGORITHMS` and sequential / occult / greedy_pairs
    search.py      `search` (the default): swap local search, and its hierarchical guarantee
    layer.py       `place_layer`, `compute_placement`, `sequential_placement`
    file.py        `Placement` and its JSON file
    permute.py     `permute_experts`

The time to place DeepSeek-V3 width is measured by `benchmarks/placement_time.py`.
"""

from __future__ import annotations

from .algorithms import PLACEMENT_ALGORITHMS, PlacementAlgorithm, register_algorithm
from .core import PlacementError, coactivation_matrix
from .core import _incidence as _incidence  # re-exported for the tests
from .file import PLACEMENT_FORMAT, PLACEMENT_VERSION, Placement
from .layer import compute_placement, place_layer, sequential_placement
from .permute import permute_experts
from .search import DEFAULT_ALGORITHM, SEARCH_CELLS, SEARCH_RESTARTS
from .search import _SwapState as _SwapState  # re-exported for the tests

__all__ = [
    "PLACEMENT_ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "PLACEMENT_FORMAT",
    "PLACEMENT_VERSION",
    "SEARCH_CELLS",
    "SEARCH_RESTARTS",
    "PlacementAlgorithm",
    "PlacementError",
    "Placement",
    "coactivation_matrix",
    "place_layer",
    "compute_placement",
    "register_algorithm",
    "sequential_placement",
    "permute_experts",
]


def __getattr__(name: str):
    if name == "benchmark_placement":
        raise AttributeError(
            "occult_ft.placement.benchmark_placement moved to benchmarks/placement_time.py; run "
            "`python benchmarks/placement_time.py [--tokens N]`"
        )
    raise AttributeError(f"module 'occult_ft.placement' has no attribute {name!r}")
