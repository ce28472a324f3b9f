"""Redundant experts (EPLB's replicas of hot experts): the copies table and the dispatch rule.

A measurement apparatus, not a training option: with R redundant experts (the total number of extra
expert slots, as in EPLB and vLLM's `num_redundant_experts`), each of the D devices holds E/D experts of
its own plus R/D copies of experts of other devices. Which experts and where is
`occult_ft.placement.replicas`; this file holds the table and the rule that sends each (token, expert)
row to one copy. `benchmarks/redundant_experts.py` measures them on a trained checkpoint's routing
against the per-device selection bias (docs/device-balance.md, "Redundant experts").

The rule (`replica_devices`), per MoE layer:
  1. a row of an expert with one copy goes to that copy; the devices these rows reach are the token's
     fixed devices, and each device's load is the number of tokens it receives (de-duplicated rows);
  2. experts with several copies are taken in increasing id. A token selecting expert x whose copies
     include a device the token already reaches sends x's row there (the lowest such device): no new
     row. The other tokens selecting x ("free" tokens) each add one row: they are spread over x's copies
     so that the devices' loads rise as evenly as possible, each free token going to the copy on the
     least loaded device at that moment (ties: lowest device id); the free tokens fill the devices'
     shares in token order, the lowest device id first. Their devices then count as reached for the
     later replicated experts.
So a token never reaches more devices than without replicas (comm_complexity cannot grow), and the
rows a replica takes off its expert's own device land where they cost nothing or where load is lowest.

Shape legend: T tokens, K experts per token, E experts, D devices.
    topk_ids_TK   int, expert ids chosen per token
    copies_ED     bool, copies_ED[e, d]: device d holds a copy of expert e (each row has at least one)
    device_TK     int, the device that receives each (token, expert) row
"""

from __future__ import annotations

import torch

__all__ = [
    "check_copies",
    "single_copies",
    "replica_devices",
    "replica_load",
    "spread_counts",
]


def single_copies(expert_device_E: torch.Tensor, num_devices: int) -> torch.Tensor:
    """(E, D) copies table of a placement without replicas: expert e on device expert_device_E[e] only."""
    copies_ED = torch.zeros(expert_device_E.shape[0], num_devices, dtype=torch.bool)
    copies_ED[torch.arange(expert_device_E.shape[0]), expert_device_E.long().cpu()] = True
    return copies_ED


def check_copies(copies_ED: torch.Tensor) -> None:
    """Refuse a copies table that is not an (E, D) bool tensor giving every expert at least one copy."""
    if copies_ED.dtype != torch.bool or copies_ED.dim() != 2:
        raise ValueError(
            f"copies_ED must be an (E, D) bool tensor, got {tuple(copies_ED.shape)} {copies_ED.dtype}; "
            "build it with occult_ft.replicas.single_copies"
        )
    missing = (~copies_ED.any(dim=1)).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"experts {missing[:8]} have no copy on any device; every expert needs one")


def spread_counts(loads: list[int], free: int) -> list[int]:
    """How many of `free` new rows each device takes when each goes to the least loaded device then
    (ties: lowest index): the devices are filled up to a common level, the remainder to the lowest
    indices at that level.

    Args:
        loads: the current load of each candidate device, in increasing device id.
        free: rows to spread (>= 0).

    Returns:
        One count per device, summing to `free`.
    """
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    # the largest j whose j least loaded devices can all be raised to the j-th one's load with `free` rows
    j, below = 1, loads[order[0]]
    while j < len(order) and loads[order[j]] * (j + 1) - (below + loads[order[j]]) <= free:
        below += loads[order[j]]
        j += 1
    level, extra = divmod(free + below, j)  # level < the load of the (j+1)-th device
    counts = [0] * len(loads)
    filled = sorted(order[:j])
    for i in filled:
        counts[i] = level - loads[i]
    for i in filled[:extra]:  # at the common level the lowest ids come first
        counts[i] += 1
    return counts


def replica_devices(topk_ids_TK: torch.Tensor, copies_ED: torch.Tensor) -> torch.Tensor:
    """(T, K) device of each (token, expert) row under the replica rule of the module docstring.

    With one copy per expert this is `expert_device_E[topk_ids_TK]`. One host read per replicated expert.
    """
    ids_TK = topk_ids_TK.long()
    copies_ED = copies_ED.to(ids_TK.device)
    num_tokens, num_devices = ids_TK.shape[0], copies_ED.shape[1]
    replicated_E = copies_ED.sum(dim=1) > 1
    first_E = copies_ED.int().argmax(dim=1)  # the lowest device holding each expert
    device_TK = first_E[ids_TK]
    fixed_TK = ~replicated_E[ids_TK]
    reached_TD = torch.zeros(num_tokens, num_devices, dtype=torch.long, device=ids_TK.device)
    reached_TD = reached_TD.scatter_add_(1, device_TK, fixed_TK.long()) > 0
    for expert in replicated_E.nonzero().flatten().tolist():
        selects_TK = ids_TK == expert
        selects_T = selects_TK.any(dim=1)
        holders_D = copies_ED[expert]
        hit_TD = reached_TD & holders_D
        hit_T = hit_TD.any(dim=1)
        choice_T = hit_TD.int().argmax(dim=1)  # the lowest reached copy
        free_T = selects_T & ~hit_T
        holders = holders_D.nonzero().flatten().tolist()
        loads = reached_TD.sum(dim=0)[holders].tolist()
        counts = spread_counts(loads, int(free_T.sum()))
        # the r-th free token (r from 0, in token order) goes to the first holder whose share is not full
        ends = torch.tensor(counts, device=ids_TK.device).cumsum(0)
        rank_T = free_T.long().cumsum(0) - 1
        slot_T = torch.searchsorted(ends, rank_T.clamp(min=0), right=True).clamp(max=len(holders) - 1)
        holder_ids = torch.tensor(holders, device=ids_TK.device)
        choice_T = torch.where(free_T, holder_ids[slot_T], choice_T)
        device_TK = torch.where(selects_TK, choice_T[:, None], device_TK)
        reached_TD[selects_T, choice_T[selects_T]] = True
    return device_TK


def replica_load(topk_ids_TK: torch.Tensor, copies_ED: torch.Tensor) -> torch.Tensor:
    """(D,) rows each device receives (tokens that reach it) under the replica rule."""
    device_TK = replica_devices(topk_ids_TK, copies_ED)
    reached_TD = torch.zeros(
        device_TK.shape[0], copies_ED.shape[1], dtype=torch.long, device=device_TK.device
    )
    return (reached_TD.scatter_add_(1, device_TK, torch.ones_like(device_TK)) > 0).sum(dim=0)
