"""`search`: swap local search from the best constructive start (the fallback of `solver` without scipy).

    SwapState            exact, vectorised swap deltas of the summed distinct devices per token
    search               one level: the best of occult, greedy_pairs and sequential on the exact
                         objective, then swaps between devices plus `restarts` perturb-and-descend rounds
                         (iterated local search, seeded: same seed, same result)
    search_hierarchical  N nodes: three candidates, never worse than hierarchical occult at either level

A swap is taken only if it keeps the device load imbalance (max/mean tokens per device) within the load
bound and lowers the exact objective, or leaves it equal while putting more co-selected pairs on one
device (this crosses the plateaus of the distinct-device count). The objective never rises, so on one
level `search` is never worse than `occult` or `greedy_pairs` (whichever of them keeps the bound).

The load bound is `max_load_imbalance`: None (the default) keeps max(1.25, occult's imbalance), so occult is
always admissible; a number is kept strictly. When no start keeps a strict bound, swaps that lower the
imbalance most are taken first (`SwapState.rebalance`); a bound that cannot be reached is a one-line
`PlacementError` naming the lowest imbalance found.

Shape legend: T tokens, E experts, D devices; x_TE (T, E) 0/1 incidence, count_TD (T, D) experts of the
token on each device, dev_E (E,) device of each expert.
"""

from __future__ import annotations

from functools import partial

import torch

from ..checks import is_int, is_positive_int
from ..metrics import expert_device_from_groups
from .algorithms import greedy_pairs, occult, register_algorithm, sequential
from .core import (
    PlacementError,
    check_load_bound,
    device_to_groups,
    devices_total,
    imbalance,
    incidence,
    level_totals,
    resolve_load_bound,
    two_level,
)

__all__ = [
    "SEARCH_RESTARTS",
    "SEARCH_CELLS",
    "SwapState",
    "check_search_options",
    "search",
    "search_hierarchical",
]

SEARCH_RESTARTS = 4  # perturb-and-descend rounds after the first descent
SEARCH_CELLS = 2**21  # swaps are evaluated on at most SEARCH_CELLS / E profiled tokens (a seeded random
# subset): every token of a 32-expert model's default profile, 8192 tokens at DeepSeek-V3 width (256)


# ---- local search over swaps ---------------------------------------------------------------------
class SwapState:
    """Exact objective bookkeeping for swap local search.

    Keeps count_TD and, derived from it, Z = [count == 0], O = [count == 1] (both (T, D)),
        xz_ED = x^T Z   tokens of expert e that do not reach device d yet
        xo_ED = x^T O   tokens of expert e for which e is their only expert on device d
        a_EE[a, b] = sum over tokens holding a and b of O[t, dev(a)]
    Moving a from p to q changes the sum of C_T by xz[a, q] - xo[a, p]; a swap (a on p, b on q) is the two
    moves plus a_EE[a, b] + a_EE[b, a] for the tokens holding both (for them nothing changes).
    The tie-break, intra-device pairs sum_t sum_d n(n-1)/2, uses xc_ED = x^T count: moving a from p to q
    adds xc[a, q] - xc[a, p] + load(a) pairs, and a swap corrects by -2 co(a, b) for the tokens holding both.
    After a swap only the tokens holding a or b change, so every matrix is updated from those rows.
    All entries are integer counts, exact in float32 below 2^24 tokens.
    """

    def __init__(self, x_TE: torch.Tensor, dev_E: torch.Tensor, num_devices: int):
        self.x_TE, self.num_devices = x_TE, num_devices
        self.co_EE = x_TE.T @ x_TE  # co-selection counts, diagonal = expert load
        self.tokens_of = [x_TE[:, e].nonzero().flatten() for e in range(x_TE.shape[1])]
        eye = torch.eye(num_devices, dtype=torch.bool)
        self.excluded_DDD = eye[:, None, :] | eye[None, :, :]  # [p, q, r]: r is p or q
        self.reset(dev_E)

    def reset(self, dev_E: torch.Tensor) -> None:
        self.dev_E = dev_E.clone()
        # onehot_ED[e, d] = [dev(e) == d], so count_TD[t, d] = experts of token t on device d
        onehot_ED = torch.nn.functional.one_hot(self.dev_E, self.num_devices).float()
        self.count_TD = self.x_TE @ onehot_ED
        zero_TD, one_TD = (self.count_TD == 0).float(), (self.count_TD == 1).float()
        self.xz_ED, self.xo_ED = self.x_TE.T @ zero_TD, self.x_TE.T @ one_TD
        # y[t, a] = x[t, a] O[t, dev(a)]: t holds a and a is t's only expert on a's device; a_EE = y^T x
        self.a_EE = (self.x_TE * one_TD[:, self.dev_E]).T @ self.x_TE
        self.xc_ED = self.x_TE.T @ self.count_TD
        # a token loads a device once, however many of its experts sit there: T minus the tokens with none
        self.load_D = self.x_TE.shape[0] - zero_TD.sum(dim=0)  # tokens reaching each device

    @property
    def total(self) -> float:
        # summed load = sum_d (tokens reaching d) = sum_t C_t, the objective
        return float(self.load_D.sum())

    def swap_deltas(self, bound: float) -> torch.Tensor:
        """(E, E) change of the summed C_T for each swap; +inf for same-device pairs and swaps that would
        push max/mean device load above `bound`."""
        delta_EE, ratio_EE = self.swap_effects()
        return delta_EE.masked_fill(ratio_EE > bound * (1 + 1e-9), float("inf"))

    def swap_effects(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, E) change of the summed C_T and (E, E) max/mean device load after each swap; both +inf for
        same-device pairs."""
        dev = self.dev_E
        # xo_self_E[a] = xo[a, dev(a)]: tokens that stop reaching a's device when a leaves it
        xo_self_E = self.xo_ED.gather(1, dev[:, None]).squeeze(1)
        # column b picks device dev(b): move_EE[a, b] = xz[a, dev(b)] - xo[a, dev(a)]
        move_EE = (self.xz_ED - xo_self_E[:, None])[:, dev]  # [a, b]: move a onto b's device
        corr_EE = self.a_EE + self.a_EE.T
        delta_EE = move_EE + move_EE.T + corr_EE
        # new load of a's device after the swap (b's device: the transpose)
        # a's device loses the tokens only a brought there, gains b's tokens that did not reach it yet, and
        # a_EE adds back the tokens holding both (there b replaces a)
        load_a_EE = self.load_D[dev][:, None] - xo_self_E[:, None] + self.xz_ED[:, dev].T + self.a_EE
        # others_DD[p, q] = the largest load among the devices other than p and q (they keep their loads)
        others_DD = self.load_D.expand(self.num_devices, self.num_devices, -1)
        others_DD = others_DD.masked_fill(self.excluded_DDD, float("-inf")).amax(dim=-1)
        new_max = torch.maximum(torch.maximum(load_a_EE, load_a_EE.T), others_DD[dev][:, dev])
        # the objective is the summed load, so the mean after the swap is (total + delta) / D
        new_mean = (self.total + delta_EE) / self.num_devices
        same = dev[:, None] == dev[None, :]
        ratio_EE = (new_max / new_mean.clamp_min(1e-30)).masked_fill(same, float("inf"))
        return delta_EE.masked_fill(same, float("inf")), ratio_EE

    def rebalance(self, bound: float, max_swaps: int) -> bool:
        """Take the swap that lowers max/mean device load most (ties: the lowest objective change) until
        the load is within `bound`; False when no swap lowers it further first."""
        num_experts = self.x_TE.shape[1]
        for _ in range(max_swaps):
            now = imbalance(self.load_D)
            if now <= bound * (1 + 1e-9):
                return True
            delta_EE, ratio_EE = self.swap_effects()
            best_ratio = float(ratio_EE.min())
            if not best_ratio < now - 1e-12:
                return False
            # among the swaps that reach the best ratio, the one of least objective change; flat index -> (a, b)
            best = int(delta_EE.masked_fill(ratio_EE > best_ratio, float("inf")).argmin())
            self.apply_swap(*divmod(best, num_experts))
        return imbalance(self.load_D) <= bound * (1 + 1e-9)

    def pair_gains(self) -> torch.Tensor:
        """(E, E) increase of the intra-device pair count for each swap (the tie-break on plateaus)."""
        dev = self.dev_E
        # own_E[a] = xc[a, dev(a)], which counts a itself once per token: + load(a) (co's diagonal) removes it
        own_E = self.xc_ED.gather(1, dev[:, None]).squeeze(1)
        move_EE = (self.xc_ED - own_E[:, None])[:, dev] + self.co_EE.diagonal()[:, None]
        return move_EE + move_EE.T - 2 * self.co_EE

    def apply_swap(self, a: int, b: int) -> None:
        p, q = int(self.dev_E[a]), int(self.dev_E[b])
        # only tokens holding a or b change their counts: every update below reads those rows only
        rows = torch.unique(torch.cat([self.tokens_of[a], self.tokens_of[b]]))
        x_RE, c_RD = self.x_TE[rows], self.count_TD[rows]
        zero_old, one_old = (c_RD == 0).float(), (c_RD == 1).float()
        # the rows' old share of a_EE, subtracted once the new one is known
        y_old = x_RE * one_old[:, self.dev_E]
        step_R = x_RE[:, a] - x_RE[:, b]  # tokens with only a move a row p -> q, only b: q -> p
        c_RD[:, p] -= step_R
        c_RD[:, q] += step_R
        self.count_TD[rows] = c_RD
        # xc = x^T count changes by x^T (the rows' count change) on columns p and q only
        self.xc_ED[:, p] -= x_RE.T @ step_R
        self.xc_ED[:, q] += x_RE.T @ step_R
        self.dev_E[a], self.dev_E[b] = q, p
        zero_new, one_new = (c_RD == 0).float(), (c_RD == 1).float()
        x_RE_T = x_RE.T
        # xz, xo and a_EE move by the difference of the rows' new and old indicators
        self.xz_ED += x_RE_T @ (zero_new - zero_old)
        self.xo_ED += x_RE_T @ (one_new - one_old)
        self.a_EE += (x_RE * one_new[:, self.dev_E] - y_old).T @ x_RE
        self.load_D -= (zero_new - zero_old).sum(dim=0)

    def descend(self, bound: float, max_swaps: int) -> None:
        """Best-improvement swaps (most negative objective change, ties broken by the most intra-device
        pairs gained) until no swap lowers the objective or, at equal objective, gains pairs. Equal-objective
        swaps cross the plateaus of the distinct-device count (a token only gets cheaper once its last
        expert leaves a device); the pair count rises with each, so the descent cannot cycle."""
        num_experts = self.x_TE.shape[1]
        for _ in range(max_swaps):
            delta_EE = self.swap_deltas(bound)
            # integer deltas: > 0.5 means every allowed swap raises the objective
            best_delta = float(delta_EE.min())  # deltas are integers
            if best_delta > 0.5:
                return
            # among the swaps of the best delta, the one gaining the most intra-device pairs
            gain_EE = self.pair_gains().masked_fill(delta_EE != best_delta, float("-inf"))
            best = int(gain_EE.argmax())
            # at equal objective a swap must gain pairs (so the descent cannot cycle); none does: a local minimum
            if best_delta > -0.5 and not float(gain_EE.view(-1)[best]) > 0.5:
                return
            self.apply_swap(*divmod(best, num_experts))


def check_search_options(max_load_imbalance, seed, restarts, max_swaps, max_search_tokens) -> None:
    """One-line `PlacementError` for the first bad option of `search`."""
    check_load_bound(max_load_imbalance)
    for name, value, low in (("seed", seed, 0), ("restarts", restarts, 0)):
        if not is_int(value) or value < low:
            raise PlacementError(f"{name}={value!r} must be an integer >= {low}")
    for name, value in (("max_swaps", max_swaps), ("max_search_tokens", max_search_tokens)):
        if value is not None and not is_positive_int(value):
            raise PlacementError(f"{name}={value!r} must be a positive integer, or None for the default")


def search(
    x_TE: torch.Tensor,
    num_devices: int,
    *,
    max_load_imbalance: float | None = None,
    seed: int = 0,
    restarts: int = SEARCH_RESTARTS,
    max_swaps: int | None = None,
    max_search_tokens: int | None = None,
) -> list[list[int]]:
    """Swap local search (module docstring). On more than `max_search_tokens` profiled tokens the swaps
    are evaluated on a seeded random subset, and the result is kept only if it beats every start on all
    tokens within the bound (so "never worse than occult" holds on the whole profile)."""
    check_search_options(max_load_imbalance, seed, restarts, max_swaps, max_search_tokens)
    # default subset: SEARCH_CELLS / E tokens (at least 1024), so the (T, E) swap matrices stay bounded
    max_search_tokens = max_search_tokens or max(1024, SEARCH_CELLS // x_TE.shape[1])
    run = partial(_search_all, num_devices=num_devices, seed=seed, restarts=restarts, max_swaps=max_swaps)
    if x_TE.shape[0] <= max_search_tokens:
        return run(x_TE, max_load_imbalance=max_load_imbalance)
    # the same seed draws the same subset, so the result is reproducible
    subset = torch.randperm(x_TE.shape[0], generator=torch.Generator().manual_seed(seed))[:max_search_tokens]
    num_experts = x_TE.shape[1]

    def score(groups) -> tuple[float, float]:  # (objective, load imbalance) on all tokens
        # reach_TD[t, d]: token t has an expert on device d; its sum is the objective, its columns the loads
        reach_TD = (
            x_TE
            @ torch.nn.functional.one_hot(expert_device_from_groups(groups, num_experts), num_devices).float()
        ) > 0
        return float(reach_TD.sum()), imbalance(reach_TD.sum(dim=0))

    start = occult(x_TE, num_devices)
    bound = resolve_load_bound(max_load_imbalance, score(start)[1])
    try:
        found = run(x_TE[subset], max_load_imbalance=bound)
    except PlacementError:  # the subset could not keep the bound: the starts below still compete
        found = start
    best, best_total = None, float("inf")
    for candidate in (start, found, greedy_pairs(x_TE, num_devices), sequential(x_TE, num_devices)):
        total, imbalance_ = score(candidate)
        if total < best_total and imbalance_ <= bound * (1 + 1e-9):
            best, best_total = candidate, total
    if best is None:  # a strict bound no candidate keeps on all tokens: rebalance on all of them
        return run(x_TE, max_load_imbalance=bound, starts=[found])
    return best


def _search_all(
    x_TE: torch.Tensor,
    num_devices: int,
    *,
    max_load_imbalance: float | None = None,
    seed: int = 0,
    restarts: int = SEARCH_RESTARTS,
    max_swaps: int | None = None,
    starts: list[list[list[int]]] | None = None,
) -> list[list[int]]:
    num_experts = x_TE.shape[1]
    if num_devices == 1 or num_devices == num_experts or x_TE.shape[0] == 0:
        return occult(x_TE, num_devices)  # every equal placement has the same objective and load
    starts = (starts or []) + [
        occult(x_TE, num_devices),
        greedy_pairs(x_TE, num_devices),
        sequential(x_TE, num_devices),
    ]
    # each start as an (E,) device map, the form SwapState works on
    devs = [expert_device_from_groups(g, num_experts) for g in starts]
    # token load stays bounded: by default max/mean device load within max(1.25, occult's), so a lopsided
    # greedy start cannot carry its imbalance into the result; occult is then always admissible
    # devs[-3] is occult's start (the list ends occult, greedy_pairs, sequential): the bound's reference
    state = SwapState(x_TE, devs[-3], num_devices)
    bound = resolve_load_bound(max_load_imbalance, imbalance(state.load_D))
    max_swaps = max_swaps if max_swaps is not None else 2 * num_experts
    admissible, imbalances = [], []
    for dev in devs:
        # the loads of each start under the bound: only those within it may start the descent
        state.reset(dev)
        imbalances.append(imbalance(state.load_D))
        if imbalances[-1] <= bound * (1 + 1e-9):
            admissible.append(dev)
    if admissible:  # first of equals: the given start, then occult
        state.reset(min(admissible, key=lambda dev: devices_total(x_TE, dev, num_devices)))
    else:  # a strict bound no start keeps: lower the imbalance first
        state.reset(devs[min(range(len(devs)), key=imbalances.__getitem__)])
        if not state.rebalance(bound, 4 * num_experts):
            raise PlacementError(
                f"no placement found within max_load_imbalance={bound}: the lowest load imbalance reached is "
                f"{imbalance(state.load_D):.3f}; raise max_load_imbalance"
            )
    state.descend(bound, max_swaps)
    best_dev, best_total = state.dev_E.clone(), state.total
    # iterated local search: kick the best placement with a few random swaps, descend, keep if better
    gen = torch.Generator().manual_seed(seed)
    # a kick of at least 2 random swaps, one more per 32 experts
    kicks = max(2, num_experts // 32)
    for _ in range(restarts):
        state.reset(best_dev)
        for _ in range(kicks):
            a = int(torch.randint(num_experts, (1,), generator=gen))
            # the partner is any expert on another device
            others = (state.dev_E != state.dev_E[a]).nonzero().flatten()
            state.apply_swap(a, int(others[torch.randint(len(others), (1,), generator=gen)]))
        state.descend(bound, max_swaps)
        # totals are integers: - 0.5 keeps only a strict improvement
        if state.total < best_total - 0.5 and imbalance(state.load_D) <= bound * (1 + 1e-9):
            best_dev, best_total = state.dev_E.clone(), state.total
    return device_to_groups(best_dev, num_devices)


def search_hierarchical(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    num_nodes: int,
    *,
    max_load_imbalance: float | None = None,
    seed: int = 0,
    restarts: int = SEARCH_RESTARTS,
    max_swaps: int | None = None,
    max_search_tokens: int | None = None,
) -> list[list[int]]:
    """Nodes, then devices, never worse than hierarchical occult at either level. The load bound is kept
    at each level (node loads; device loads within each node).

    Three candidates:
        nodes_first   search at the node level (distinct nodes per token), then within each node
        occult_nodes  occult's node partition, then search within each node
        devices_first search on the D devices (distinct devices per token), then search over whole devices
                      onto the N nodes
    each measured, with hierarchical `occult` (occult at both levels), on the exact summed node-level and
    device-level costs. A candidate is admissible when it is no worse than hierarchical occult at BOTH
    levels; occult_nodes always is (same node partition, and within each node search is never worse than
    occult). The result is the admissible candidate with the lowest (node-level, device-level) cost,
    compared lexicographically (first listed on ties), so it is never worse than hierarchical `occult` in
    node-level comm_complexity AND in device-level comm_complexity, on every layer.
    """
    check_search_options(max_load_imbalance, seed, restarts, max_swaps, max_search_tokens)
    solve = partial(
        search,
        max_load_imbalance=max_load_imbalance,
        restarts=restarts,
        max_swaps=max_swaps,
        max_search_tokens=max_search_tokens,
    )
    args = (topk_ids_TK, num_experts, num_devices, num_nodes)
    x_TE = incidence(topk_ids_TK, num_experts)
    occult_nodes = occult(x_TE, num_nodes)
    candidates = [
        two_level(*args, solve, seed=seed),  # nodes_first
        two_level(*args, solve, node_groups=occult_nodes, seed=seed),  # occult_nodes
        _devices_first(x_TE, num_devices, num_nodes, solve, seed),
    ]
    reference = level_totals(x_TE, two_level(*args, occult, node_groups=occult_nodes), num_devices, num_nodes)
    totals = [level_totals(x_TE, groups, num_devices, num_nodes) for groups in candidates]
    # totals are token counts (integers): + 0.5 compares them without float noise
    admissible = [i for i, t in enumerate(totals) if all(c <= r + 0.5 for c, r in zip(t, reference))]
    return candidates[min(admissible, key=lambda i: totals[i])]  # occult_nodes is always admissible


def _devices_first(x_TE: torch.Tensor, num_devices: int, num_nodes: int, solve, seed: int) -> list[list[int]]:
    """Search on the D devices, then place whole devices onto the N nodes (a device is a unit reached by
    the tokens reaching any of its experts). Groups are returned node by node."""
    # the device level first: D groups of E/D experts
    groups = solve(x_TE, num_devices, seed=seed)
    onehot_ED = torch.nn.functional.one_hot(expert_device_from_groups(groups, x_TE.shape[1]), num_devices)
    reach_TD = ((x_TE @ onehot_ED.float()) > 0).float()  # (T, D): devices become the units placed on nodes
    # solve returns node groups of device ids: expand each device to its experts, node by node
    return [groups[d] for node in solve(reach_TD, num_nodes, seed=seed) for d in node]


register_algorithm("search", search, hierarchical=search_hierarchical)
