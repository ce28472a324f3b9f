"""Placement under a pruning budget: the routing after `max_devices_per_token` pruning, evaluated from the
profile, and a local search on it.

With a budget M, the pruned router (`occult_ft.routing.limit_topk`, criteria score, device_max and
similarity) keeps a token that reaches at most M devices as it is; any other token walks its top-k in
descending score and admits each expert's device until M devices are admitted, and its new experts all
lie on the admitted devices, each of which keeps at least the expert that admitted it. So the devices a
pruned token reaches are exactly its first M distinct devices in score order, whatever the criterion:
a pure function of the profiled top-k (recorded in router order, best first) and the placement
(`admitted_devices`, checked against `limit_topk` in the tests). `device_topk_sum` ranks devices by
scores the profile does not keep and is refused here.

What the placement changes under a budget: comm_complexity is min(C_T, M) per token (at most M), the
device loads (rows each device receives; the most loaded device sets the layer time) and the router's
choices that pruning removes. The objective of `refine_pruned` is the number of removed (token, expert)
selections (the profile keeps no gate weights, so each counts 1), then the unpruned summed devices; the
pruned routing's load imbalance is kept within the bound (max/mean rows per device).

Shape legend: T tokens, K top-k slots (best first), E experts, D devices, R distinct ordered rows.
"""

from __future__ import annotations

import time

import torch

from ..checks import is_int
from .core import PlacementError, device_to_groups, imbalance

__all__ = [
    "PRUNING_CRITERIA",
    "PrunedState",
    "admitted_devices",
    "check_budget",
    "pruned_figures",
    "refine_pruned",
]

PRUNING_CRITERIA = ("score", "device_max", "similarity")  # device sets identical, see the module docstring


def check_budget(max_devices_per_token, criterion: str, num_devices: int) -> None:
    """One-line `PlacementError` for a budget placement cannot evaluate."""
    if max_devices_per_token is None:
        return
    if not is_int(max_devices_per_token):
        raise PlacementError(
            f"max_devices_per_token={max_devices_per_token!r} must be an integer between 1 and {num_devices}"
        )
    if not 1 <= max_devices_per_token <= num_devices:
        raise PlacementError(
            f"max_devices_per_token={max_devices_per_token} must be between 1 and devices={num_devices}; leave it "
            "unset for no budget"
        )
    if criterion not in PRUNING_CRITERIA:
        raise PlacementError(
            f"criterion={criterion!r}: placement under a budget reads the pruned routing from the profile's top-k, "
            f"which fixes the devices for {', '.join(PRUNING_CRITERIA)}; 'device_topk_sum' ranks devices by scores "
            "the profile does not keep: place for 'score' (the same devices as device_max and similarity)"
        )


def admitted_devices(
    topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int, max_devices: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pruned routing's devices.

    Args:
        topk_ids_TK: (T, K) expert ids, best first (the router's order).
        expert_device_E: (E,) device of each expert. max_devices: M.
    Returns:
        reach_TD: (T, D) bool, the devices each token reaches after pruning (its first M distinct ones);
        kept_TK: (T, K) bool, the selections pruning keeps (those on a reached device).
    """
    # dev_TK[t, j]: device of the token's j-th choice (slots best first)
    dev_TK = expert_device_E[topk_ids_TK.long()]
    k = dev_TK.shape[1]
    # a slot is a token's first choice on its device when no earlier slot (a better choice) is on that
    # device; the first M such slots are the M devices the budget admits, in the router's order
    # same_TKK[t, j, i]: slots j and i of token t sit on one device
    same_TKK = dev_TK[:, :, None] == dev_TK[:, None, :]
    earlier_KK = torch.tril(torch.ones(k, k, dtype=torch.bool), diagonal=-1)  # [j, i]: i before j
    first_TK = ~(same_TKK & earlier_KK).any(dim=2)
    admit_TK = first_TK & (first_TK.cumsum(dim=1) <= max_devices)  # cumsum: distinct devices so far
    reach_TD = torch.zeros(dev_TK.shape[0], num_devices, dtype=torch.bool)
    # row index of every admitted slot, paired with its device: one True per admitted (token, device)
    reach_TD[torch.arange(dev_TK.shape[0])[:, None].expand_as(dev_TK)[admit_TK], dev_TK[admit_TK]] = True
    # a selection is kept when its device was admitted (by that device's first slot, perhaps another one)
    return reach_TD, reach_TD.gather(1, dev_TK)


def pruned_figures(
    topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int, max_devices: int
) -> dict:
    """comm_complexity (mean devices per token), load_imbalance (max/mean rows per device) and
    removed_share (removed selections / T K) of the pruned routing."""
    if topk_ids_TK.shape[0] == 0:
        return dict(comm_complexity=0.0, load_imbalance=0.0, removed_share=0.0)
    reach_TD, kept_TK = admitted_devices(topk_ids_TK, expert_device_E, num_devices, max_devices)
    return dict(
        # reach_TD.sum() counts each token once per admitted device: comm_complexity = mean over tokens
        comm_complexity=float(reach_TD.sum()) / reach_TD.shape[0],
        # column sums: rows each device receives, one per token reaching it (de-duplicated dispatch)
        load_imbalance=imbalance(reach_TD.sum(dim=0)),
        removed_share=1.0 - float(kept_TK.float().mean()),
    )


class PrunedState:
    """Exact bookkeeping of the pruned objective for expert swaps, on the distinct ordered rows.

    Keeps, per distinct row r (weight w_r tokens), the unpruned and pruned device sets; a swap of a and b
    changes only the rows holding a or b, which are recounted (`swap_effect`).
    """

    def __init__(self, topk_ids_TK: torch.Tensor, dev_E: torch.Tensor, num_devices: int, max_devices: int):
        # rows stay ordered (best first): the budget admits devices in that order, so two tokens with the
        # same experts in another order can prune differently and are not merged
        rows_RK, counts_R = torch.unique(topk_ids_TK.long(), dim=0, return_counts=True)
        self.ids_RK, self.w_R = rows_RK, counts_R.double()
        self.num_devices, self.max_devices = num_devices, max_devices
        # per expert, the distinct rows that select it: the only rows a swap involving it can change
        self.rows_of = [(rows_RK == e).any(dim=1).nonzero().flatten() for e in range(int(dev_E.shape[0]))]
        self.reset(dev_E)

    def _measure(self, ids_RK: torch.Tensor, w_R: torch.Tensor, dev_E: torch.Tensor):
        reach_RD, kept_RK = admitted_devices(ids_RK, dev_E, self.num_devices, self.max_devices)
        # kept_RK False = the selection is on a device the budget did not admit: pruning removes it
        removed = float(w_R @ (~kept_RK).sum(dim=1).double())  # token-weighted selections pruned away
        dev_RK = dev_E[ids_RK]
        # plain_RD: the devices each row reaches without a budget (its whole top-k), for the tie-break
        plain_RD = torch.zeros_like(reach_RD).scatter_(1, dev_RK, True)
        unpruned = float(w_R @ plain_RD.sum(dim=1).double())  # summed devices before pruning: tie-break
        # w_R @ reach: the pruned rows each device receives, every distinct row weighted by its token count
        return removed, unpruned, w_R @ reach_RD.double()

    def reset(self, dev_E: torch.Tensor) -> None:
        self.dev_E = dev_E.clone()
        self.removed, self.unpruned, self.load_D = self._measure(self.ids_RK, self.w_R, self.dev_E)

    def swap_effect(self, a: int, b: int):
        """(removed change, unpruned-devices change, new load_D) of swapping experts a and b."""
        rows = torch.unique(torch.cat([self.rows_of[a], self.rows_of[b]]))
        ids, w = self.ids_RK[rows], self.w_R[rows]
        removed0, unpruned0, load0 = self._measure(ids, w, self.dev_E)
        dev = self.dev_E.clone()
        # the swap is tried on a copy: the state changes only in `apply`
        dev[a], dev[b] = self.dev_E[b], self.dev_E[a]
        removed1, unpruned1, load1 = self._measure(ids, w, dev)
        # the rows not holding a or b load the devices as before: only this subset's share is replaced
        return removed1 - removed0, unpruned1 - unpruned0, self.load_D - load0 + load1

    def apply(self, a: int, b: int, load_D: torch.Tensor, d_removed: float, d_unpruned: float) -> None:
        self.dev_E[a], self.dev_E[b] = self.dev_E[b].clone(), self.dev_E[a].clone()
        self.load_D, self.removed, self.unpruned = (
            load_D,
            self.removed + d_removed,
            self.unpruned + d_unpruned,
        )


def refine_pruned(
    topk_ids_TK: torch.Tensor,
    groups: list[list[int]],
    num_devices: int,
    max_devices: int,
    bound: float,
    *,
    deadline: float = float("inf"),
    seed: int = 0,
) -> list[list[int]]:
    """First-improvement swaps (seeded order) on (removed selections, unpruned summed devices) under the
    pruned load bound, after taking the swaps that lower the pruned imbalance while it is above the bound.

    Returns the new groups; a PlacementError when the bound cannot be reached.
    """
    num_experts = sum(len(g) for g in groups)
    dev_E = torch.empty(num_experts, dtype=torch.long)
    for d, g in enumerate(groups):
        dev_E[g] = d
    state = PrunedState(topk_ids_TK, dev_E, num_devices, max_devices)
    gen = torch.Generator().manual_seed(seed)
    # experts a < b, each unordered pair once
    pairs = [(a, b) for a in range(num_experts) for b in range(a + 1, num_experts)]  # E (E - 1) / 2 swaps

    def sweep(balance: bool) -> bool:
        moved = False
        for i in torch.randperm(len(pairs), generator=gen).tolist():
            if time.perf_counter() > deadline:
                return moved
            a, b = pairs[i]
            if state.dev_E[a] == state.dev_E[b]:  # same device: the swap changes nothing
                continue
            d_removed, d_unpruned, load = state.swap_effect(a, b)
            # the imbalance of the pruned routing's loads, before and after the swap
            now, after = imbalance(state.load_D), imbalance(load)
            if balance:
                if after < now - 1e-12:
                    state.apply(a, b, load, d_removed, d_unpruned)
                    moved = True
                    if after <= bound * (1 + 1e-9):
                        return True
                continue
            # both changes are token counts (integers): +-0.5 compares them without float noise; fewer
            # removed selections first, then fewer devices before pruning
            better = d_removed < -0.5 or (abs(d_removed) < 0.5 and d_unpruned < -0.5)
            if better and after <= bound * (1 + 1e-9):
                state.apply(a, b, load, d_removed, d_unpruned)
                moved = True
        return moved

    # phase 1: reach the load bound (any swap that lowers the imbalance); phase 2: improve within it
    while imbalance(state.load_D) > bound * (1 + 1e-9):
        if not sweep(balance=True) or time.perf_counter() > deadline:
            if imbalance(state.load_D) > bound * (1 + 1e-9):
                raise PlacementError(
                    f"no placement found whose pruned routing keeps max_load_imbalance={bound:.3f}: the lowest "
                    f"reached is {imbalance(state.load_D):.3f}; raise max_load_imbalance"
                )
    while time.perf_counter() < deadline and sweep(balance=False):
        pass
    return device_to_groups(state.dev_E, num_devices)
