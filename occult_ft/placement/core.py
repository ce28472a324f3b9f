"""What every placement module shares: the error type, the routing -> incidence helpers, the exact
objective, size validation and the two-level (nodes, then devices) composition of a layer placement.

Shape legend: T tokens, K experts per token, E experts, D devices (or nodes, for the node level).
    topk_ids_TK   int64 expert ids per token; -1 marks an empty slot (used for per-node sub-problems)
    x_TE          float32 0/1 incidence: x_TE[t, e] = 1 if token t selected expert e
    dev_E         int64 device of each expert
"""

from __future__ import annotations

from collections.abc import Callable
from math import isqrt

import torch

__all__ = ["PlacementError", "coactivation_matrix"]

_RERUN = "re-run `occult-ft place` on this model's profile"


class PlacementError(ValueError):
    """A placement request or file a user got wrong; the message names the value and the fix."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _divisors(n: int) -> str:
    """The divisors of n >= 1 as "1, 2, ..., n", in O(sqrt n) steps."""
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return ", ".join(str(d) for d in small + [n // d for d in reversed(small) if d * d != n])


def _validate_sizes(num_experts: int, num_devices: int, num_nodes: int) -> None:
    """D must divide E and N must divide D (a one-line `PlacementError` otherwise)."""
    if not _is_int(num_devices) or num_devices < 1 or num_experts % num_devices:
        raise PlacementError(
            f"devices={num_devices} does not divide the {num_experts} experts; use one of {_divisors(num_experts)}"
        )
    if not _is_int(num_nodes) or num_nodes < 1 or num_devices % num_nodes:
        raise PlacementError(
            f"nodes={num_nodes} does not divide devices={num_devices}; use one of {_divisors(num_devices)}"
        )


# ---- routing helpers ---------------------------------------------------------------------------
def _incidence(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(T', E) float32 0/1 incidence of the tokens that selected at least one expert (-1 slots ignored)."""
    ids = topk_ids_TK.long().cpu()
    ids = torch.where(ids >= 0, ids, num_experts)  # -1 -> spare column E, dropped below
    x = torch.zeros(ids.shape[0], num_experts + 1).scatter_add_(1, ids, torch.ones(ids.shape))
    x = x[:, :num_experts].clamp_(max=1.0)
    return x[x.sum(dim=1) > 0].contiguous()


def coactivation_matrix(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Co-selection counts of expert pairs.

    Args:
        topk_ids_TK: (T, K) int expert ids per token (-1 = empty slot).
        num_experts: E.

    Returns:
        (E, E) int64: [a, b] = tokens that selected both a and b; the diagonal is each expert's load.
    """
    x = _incidence(topk_ids_TK, num_experts).double()
    return (x.T @ x).round().long()


def _device_to_groups(dev_E: torch.Tensor, num_devices: int) -> list[list[int]]:
    return [sorted((dev_E == d).nonzero().flatten().tolist()) for d in range(num_devices)]


def _objective(x_TE: torch.Tensor, dev_E: torch.Tensor, num_devices: int) -> float:
    """Sum over tokens of distinct devices reached (comm_complexity times T)."""
    onehot_ED = torch.nn.functional.one_hot(dev_E, num_devices).float()
    return float(((x_TE @ onehot_ED) > 0).sum())


def _imbalance(load_D: torch.Tensor) -> float:
    mean = float(load_D.double().mean())
    return float(load_D.double().max()) / mean if mean > 0 else 0.0


# ---- hierarchical placement -----------------------------------------------------------------------
Solver = Callable[..., list[list[int]]]  # solve(x_TE, num_devices, **options) -> groups[d]


def _two_level(
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
        node_groups = solve(_incidence(ids, num_experts), num_nodes, **extra)
    groups: list[list[int]] = []
    for node, members in enumerate(node_groups):
        local = torch.full((num_experts + 1,), -1, dtype=torch.long)  # slot E: the -1 sentinel
        local[torch.tensor(members)] = torch.arange(len(members))
        sub_ids = local[torch.where(ids >= 0, ids, num_experts)]
        extra = {} if seed is None else {"seed": seed + node + 1}
        sub_groups = solve(_incidence(sub_ids, len(members)), num_devices // num_nodes, **extra)
        groups.extend(sorted(members[i] for i in g) for g in sub_groups)
    return groups


def _level_totals(
    x_TE: torch.Tensor, groups: list[list[int]], num_devices: int, num_nodes: int
) -> tuple[float, float]:
    """(summed distinct nodes, summed distinct devices) over the tokens of x_TE for a D-device placement."""
    dev_E = torch.empty(x_TE.shape[1], dtype=torch.long)
    for d, group in enumerate(groups):
        dev_E[group] = d
    return (
        _objective(x_TE, dev_E // (num_devices // num_nodes), num_nodes),
        _objective(x_TE, dev_E, num_devices),
    )
