"""Where redundant experts go: which experts get a copy on which device (EPLB's replicas, placed with
the routing's collaboration in view).

`place_replicas` adds the R redundant copies (its `redundant_experts`) one at a time, R/D per device
(every device holds the same number of expert slots, as in EPLB). Each step tries every (expert,
device) pair that is still open (the device has a free slot and no copy of the expert) and keeps the
one whose routing, under the dispatch rule of `occult_ft.replicas.replica_devices` on the profiled
tokens, gives:
  1. the lowest most-loaded device (rows per device: what every layer waits for), then
  2. the fewest rows in all (comm_complexity: a copy on a device the expert's tokens already reach
     saves their rows; this is where collaboration enters), then
  3. the most tokens of the expert that already reach the device (its co-activation with the
     device's experts), then the lowest expert id, then the lowest device id.
So the hot experts of the most loaded device are copied to the device whose experts they collaborate
with most, as long as that keeps the load lowest. Shapes as in `occult_ft.replicas`. Measured, not
used by training: `benchmarks/redundant_experts.py` (docs/device-balance.md).
"""

from __future__ import annotations

import torch

from ..checks import is_int
from ..replicas import check_copies, replica_devices, single_copies
from .core import PlacementError

__all__ = ["check_redundant_experts", "place_replicas", "replica_key"]


def check_redundant_experts(redundant_experts: int, num_experts: int, num_devices: int) -> None:
    """Refuse a replica count that is not a multiple of D in [0, D * (E - E/D)] (each device's slots
    can only hold copies of other devices' experts)."""
    most = num_devices * (num_experts - num_experts // num_devices)
    if not is_int(redundant_experts) or redundant_experts < 0 or redundant_experts % num_devices:
        raise PlacementError(
            f"redundant_experts={redundant_experts!r} must be a multiple of the {num_devices} devices "
            f"(each device holds redundant_experts / devices copies); use e.g. {num_devices}"
        )
    if redundant_experts > most:
        raise PlacementError(
            f"redundant_experts={redundant_experts} exceeds the {most} copies {num_devices} devices of "
            f"{num_experts} experts can hold; use at most {most}"
        )


def replica_key(topk_ids_TK: torch.Tensor, copies_ED: torch.Tensor, expert: int, device: int) -> tuple:
    """The order of `place_replicas` for the routing under `copies_ED` (the candidate copy included):
    (most-loaded device's rows, rows in all, -tokens of `expert` already reaching `device`, expert, device).
    """
    device_TK = replica_devices(topk_ids_TK, copies_ED)
    reached_TD = torch.zeros(
        device_TK.shape[0], copies_ED.shape[1], dtype=torch.long, device=device_TK.device
    )
    reached_TD = reached_TD.scatter_add_(1, device_TK, torch.ones_like(device_TK)) > 0
    load_D = reached_TD.sum(dim=0)
    # co-activation: tokens of `expert` whose other experts' rows already go to `device`
    ids_TK = topk_ids_TK.long().to(device_TK.device)
    together_T = ((device_TK == device) & (ids_TK != expert)).any(dim=1) & (ids_TK == expert).any(dim=1)
    return (int(load_D.max()), int(load_D.sum()), -int(together_T.sum()), expert, device)


def place_replicas(
    topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int, redundant_experts: int
) -> torch.Tensor:
    """The (E, D) copies table: each expert on its own device, plus `redundant_experts` copies chosen
    greedily by `replica_key` (module docstring).

    Args:
        topk_ids_TK: the profiled routing (placed or original ids, as `expert_device_E` reads them).
        expert_device_E: each expert's own device (an equal-size placement).
        num_devices: D.
        redundant_experts: R, a multiple of D; 0 returns the table without replicas.

    Returns:
        copies_ED, bool, on the CPU; row e holds 1 + (copies of e) True values.
    """
    num_experts = expert_device_E.shape[0]
    check_redundant_experts(redundant_experts, num_experts, num_devices)
    copies_ED = single_copies(expert_device_E, num_devices)
    check_copies(copies_ED)
    ids_TK = topk_ids_TK.long().cpu()
    slots = redundant_experts // num_devices
    for _ in range(redundant_experts):
        used_D = copies_ED.sum(dim=0) - num_experts // num_devices
        best: tuple | None = None
        for expert in range(num_experts):
            for device in range(num_devices):
                if copies_ED[expert, device] or used_D[device] >= slots:
                    continue
                copies_ED[expert, device] = True
                key = replica_key(ids_TK, copies_ED, expert, device)
                copies_ED[expert, device] = False
                if best is None or key < best:
                    best = key
        assert best is not None  # check_redundant_experts leaves an open slot each step
        copies_ED[best[3], best[4]] = True
    return copies_ED
