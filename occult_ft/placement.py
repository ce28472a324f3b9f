"""Collaboration-aware expert placement: which device hosts which expert, the placement file, and the
weight permutation that makes a placed model contiguous.

A placement assigns, per MoE layer, the E routed experts to D devices, E/D each, so that the experts a
token selects together sit on few devices. The objective is the paper's `comm_complexity` (mean over the
profiled tokens of the distinct devices hosting the token's top-k), computed on the token-level routing
`topk_ids_TK` recorded by profiling. Placement changes no result: it is a permutation of experts.

Algorithms (registry `PLACEMENT_ALGORITHMS`, all return `groups[d]` = sorted expert ids on device d):
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
    search        (default) start from the best of the three above on the exact objective, then local
                  search over expert swaps between devices, plus `restarts` perturb-and-descend rounds
                  (iterated local search, seeded: same seed, same result). A swap is taken only if it
                  keeps the device load imbalance (max/mean tokens per device) within
                  max(max_load_imbalance, imbalance of the start) and lowers the exact objective, or
                  leaves it equal while putting more co-selected pairs on one device (this crosses the
                  plateaus of the distinct-device count). The objective never rises, so `search` is never
                  worse than `occult` or `greedy_pairs`. Swap deltas are exact and vectorised: see
                  `_SwapState`.

Hierarchical placement (`num_nodes` N > 1): experts are first split into N node groups of E/N (same
algorithm, objective = distinct nodes per token), then each node's experts are placed on its D/N devices
(objective = distinct devices per token within the node). Device d belongs to node d // (D/N).

Shape legend: T tokens, K experts per token, E experts, D devices (or nodes, for the node level).
    topk_ids_TK   int64 expert ids per token; -1 marks an empty slot (used for per-node sub-problems)
    x_TE          float32 0/1 incidence: x_TE[t, e] = 1 if token t selected expert e
    count_TD      float32 number of the token's experts on each device
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .metrics import comm_complexity, expert_device_from_groups, load_imbalance
from .models import find_moe_layers

__all__ = [
    "PLACEMENT_ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "PLACEMENT_FORMAT",
    "PLACEMENT_VERSION",
    "PlacementError",
    "Placement",
    "coactivation_matrix",
    "place_layer",
    "compute_placement",
    "sequential_placement",
    "permute_experts",
    "benchmark_placement",
]

PLACEMENT_FORMAT = "occult_ft.placement"
PLACEMENT_VERSION = 1
DEFAULT_ALGORITHM = "search"
SEARCH_RESTARTS = 4  # perturb-and-descend rounds after the first descent
SEARCH_CELLS = 2**21  # swaps are evaluated on at most SEARCH_CELLS / E profiled tokens (a seeded random
# subset): every token of a 32-expert model's default profile, 8192 tokens at DeepSeek-V3 width (256)
_RERUN = "re-run `occult-ft place` on this model's profile"


class PlacementError(ValueError):
    """A placement request or file a user got wrong; the message names the value and the fix."""


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


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


# ---- local search over swaps ---------------------------------------------------------------------
class _SwapState:
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
        onehot_ED = torch.nn.functional.one_hot(self.dev_E, self.num_devices).float()
        self.count_TD = self.x_TE @ onehot_ED
        zero_TD, one_TD = (self.count_TD == 0).float(), (self.count_TD == 1).float()
        self.xz_ED, self.xo_ED = self.x_TE.T @ zero_TD, self.x_TE.T @ one_TD
        self.a_EE = (self.x_TE * one_TD[:, self.dev_E]).T @ self.x_TE
        self.xc_ED = self.x_TE.T @ self.count_TD
        self.load_D = self.x_TE.shape[0] - zero_TD.sum(dim=0)  # tokens reaching each device

    @property
    def total(self) -> float:
        return float(self.load_D.sum())

    def swap_deltas(self, bound: float) -> torch.Tensor:
        """(E, E) change of the summed C_T for each swap; +inf for same-device pairs and swaps that would
        push max/mean device load above `bound`."""
        dev = self.dev_E
        xo_self_E = self.xo_ED.gather(1, dev[:, None]).squeeze(1)
        move_EE = (self.xz_ED - xo_self_E[:, None])[:, dev]  # [a, b]: move a onto b's device
        corr_EE = self.a_EE + self.a_EE.T
        delta_EE = move_EE + move_EE.T + corr_EE
        # new load of a's device after the swap (b's device: the transpose)
        load_a_EE = self.load_D[dev][:, None] - xo_self_E[:, None] + self.xz_ED[:, dev].T + self.a_EE
        others_DD = self.load_D.expand(self.num_devices, self.num_devices, -1)
        others_DD = others_DD.masked_fill(self.excluded_DDD, float("-inf")).amax(dim=-1)
        new_max = torch.maximum(torch.maximum(load_a_EE, load_a_EE.T), others_DD[dev][:, dev])
        new_mean = (self.total + delta_EE) / self.num_devices
        bad = (dev[:, None] == dev[None, :]) | (new_max > bound * new_mean * (1 + 1e-9))
        return delta_EE.masked_fill(bad, float("inf"))

    def pair_gains(self) -> torch.Tensor:
        """(E, E) increase of the intra-device pair count for each swap (the tie-break on plateaus)."""
        dev = self.dev_E
        own_E = self.xc_ED.gather(1, dev[:, None]).squeeze(1)
        move_EE = (self.xc_ED - own_E[:, None])[:, dev] + self.co_EE.diagonal()[:, None]
        return move_EE + move_EE.T - 2 * self.co_EE

    def apply_swap(self, a: int, b: int) -> None:
        p, q = int(self.dev_E[a]), int(self.dev_E[b])
        rows = torch.unique(torch.cat([self.tokens_of[a], self.tokens_of[b]]))
        x_RE, c_RD = self.x_TE[rows], self.count_TD[rows]
        zero_old, one_old = (c_RD == 0).float(), (c_RD == 1).float()
        y_old = x_RE * one_old[:, self.dev_E]
        step_R = x_RE[:, a] - x_RE[:, b]  # tokens with only a move a row p -> q, only b: q -> p
        c_RD[:, p] -= step_R
        c_RD[:, q] += step_R
        self.count_TD[rows] = c_RD
        self.xc_ED[:, p] -= x_RE.T @ step_R
        self.xc_ED[:, q] += x_RE.T @ step_R
        self.dev_E[a], self.dev_E[b] = q, p
        zero_new, one_new = (c_RD == 0).float(), (c_RD == 1).float()
        x_RE_T = x_RE.T
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
            best_delta = float(delta_EE.min())  # deltas are integers
            if best_delta > 0.5:
                return
            gain_EE = self.pair_gains().masked_fill(delta_EE != best_delta, float("-inf"))
            best = int(gain_EE.argmax())
            if best_delta > -0.5 and not float(gain_EE.view(-1)[best]) > 0.5:
                return
            self.apply_swap(*divmod(best, num_experts))


def _search(
    x_TE: torch.Tensor,
    num_devices: int,
    *,
    max_load_imbalance: float = 1.25,
    seed: int = 0,
    max_search_tokens: int | None = None,
    **options,
) -> list[list[int]]:
    """Local search (`_search_all`; options: restarts, max_swaps). On more than `max_search_tokens`
    profiled tokens the swaps are evaluated on a seeded random subset, and the result is kept only if it
    beats every start on all tokens (so "never worse than occult" holds on the whole profile)."""
    max_search_tokens = max_search_tokens or max(1024, SEARCH_CELLS // x_TE.shape[1])
    search = partial(
        _search_all, num_devices=num_devices, max_load_imbalance=max_load_imbalance, seed=seed, **options
    )
    if x_TE.shape[0] <= max_search_tokens:
        return search(x_TE)
    subset = torch.randperm(x_TE.shape[0], generator=torch.Generator().manual_seed(seed))[:max_search_tokens]
    found = search(x_TE[subset])
    num_experts = x_TE.shape[1]

    def score(groups) -> tuple[float, float]:  # (objective, load imbalance) on all tokens
        reach_TD = (
            x_TE
            @ torch.nn.functional.one_hot(expert_device_from_groups(groups, num_experts), num_devices).float()
        ) > 0
        return float(reach_TD.sum()), _imbalance(reach_TD.sum(dim=0))

    occult = _occult(x_TE, num_devices)
    best_total, occult_imbalance = score(occult)
    best, bound = occult, max(max_load_imbalance, occult_imbalance)
    for candidate in (found, _greedy_pairs(x_TE, num_devices), _sequential(x_TE, num_devices)):
        total, imbalance = score(candidate)
        if total < best_total and imbalance <= bound * (1 + 1e-9):
            best, best_total = candidate, total
    return best


def _search_all(
    x_TE: torch.Tensor,
    num_devices: int,
    *,
    max_load_imbalance: float = 1.25,
    seed: int = 0,
    restarts: int = SEARCH_RESTARTS,
    max_swaps: int | None = None,
) -> list[list[int]]:
    num_experts = x_TE.shape[1]
    if num_devices == 1 or num_devices == num_experts or x_TE.shape[0] == 0:
        return _occult(x_TE, num_devices)  # every equal placement has the same objective
    starts = [_occult(x_TE, num_devices), _greedy_pairs(x_TE, num_devices), _sequential(x_TE, num_devices)]
    devs = [expert_device_from_groups(g, num_experts) for g in starts]
    # token load stays bounded: max/mean device load within max(max_load_imbalance, occult's), so a
    # lopsided greedy start cannot carry its imbalance into the result; occult is always admissible
    state = _SwapState(x_TE, devs[0], num_devices)
    bound = max(max_load_imbalance, _imbalance(state.load_D))
    admissible = []
    for dev in devs:
        state.reset(dev)
        if _imbalance(state.load_D) <= bound * (1 + 1e-9):
            admissible.append(dev)
    start = min(admissible, key=lambda dev: _objective(x_TE, dev, num_devices))  # first of equals: occult
    state.reset(start)
    max_swaps = max_swaps if max_swaps is not None else 2 * num_experts
    state.descend(bound, max_swaps)
    best_dev, best_total = state.dev_E.clone(), state.total
    # iterated local search: kick the best placement with a few random swaps, descend, keep if better
    gen = torch.Generator().manual_seed(seed)
    kicks = max(2, num_experts // 32)
    for _ in range(restarts):
        state.reset(best_dev)
        for _ in range(kicks):
            a = int(torch.randint(num_experts, (1,), generator=gen))
            others = (state.dev_E != state.dev_E[a]).nonzero().flatten()
            state.apply_swap(a, int(others[torch.randint(len(others), (1,), generator=gen)]))
        state.descend(bound, max_swaps)
        if state.total < best_total - 0.5 and _imbalance(state.load_D) <= bound * (1 + 1e-9):
            best_dev, best_total = state.dev_E.clone(), state.total
    return _device_to_groups(best_dev, num_devices)


# ---- public per-layer API --------------------------------------------------------------------------
_SOLVERS: dict[str, Callable[..., list[list[int]]]] = {
    "sequential": lambda x_TE, num_devices, **_: _sequential(x_TE, num_devices),
    "occult": lambda x_TE, num_devices, **_: _occult(x_TE, num_devices),
    "greedy_pairs": lambda x_TE, num_devices, **_: _greedy_pairs(x_TE, num_devices),
    "search": _search,
}


def _validate(num_experts: int, num_devices: int, num_nodes: int, algorithm: str) -> None:
    if not isinstance(num_devices, int) or num_devices < 1 or num_experts % num_devices:
        raise PlacementError(
            f"devices={num_devices} does not divide the {num_experts} experts; use one of {_divisors(num_experts)}"
        )
    if not isinstance(num_nodes, int) or num_nodes < 1 or num_devices % num_nodes:
        raise PlacementError(
            f"nodes={num_nodes} does not divide devices={num_devices}; use one of {_divisors(num_devices)}"
        )
    if algorithm not in _SOLVERS:
        raise PlacementError(
            f"unknown placement algorithm {algorithm!r}; use one of {', '.join(sorted(_SOLVERS))}"
        )


def place_layer(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    algorithm: str = DEFAULT_ALGORITHM,
    num_nodes: int = 1,
    max_load_imbalance: float = 1.25,
    seed: int = 0,
    **options,
) -> list[list[int]]:
    """Place one MoE layer's experts on devices.

    Args:
        topk_ids_TK: (T, K) int expert ids per profiled token (-1 = empty slot).
        num_experts: E.
        num_devices: D, a divisor of E.
        algorithm: a key of `PLACEMENT_ALGORITHMS`.
        num_nodes: N, a divisor of D; N > 1 places hierarchically (nodes first, then devices in a node).
        max_load_imbalance: `search` keeps max/mean device load within max(this, `occult`'s imbalance)
            (starts beyond that bound are not used).
        seed: seed of `search`'s random restarts (same seed, same result).
        options: `search` budget: `restarts` (default 4), `max_swaps` per descent (default 2E),
            `max_search_tokens` (default 2**21 / E: swaps are evaluated on a seeded subset of that many
            tokens; 8192 at 256 experts).

    Returns:
        `groups`, D lists of E/D sorted expert ids; device d belongs to node d // (D/N).
    """
    _validate(num_experts, num_devices, num_nodes, algorithm)
    if topk_ids_TK.dim() != 2:
        raise PlacementError(f"topk_ids must be (tokens, top_k), got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.numel() and (int(topk_ids_TK.max()) >= num_experts or int(topk_ids_TK.min()) < -1):
        bad = int(topk_ids_TK.max()) if int(topk_ids_TK.max()) >= num_experts else int(topk_ids_TK.min())
        raise PlacementError(
            f"topk_ids hold expert id {bad} but the layer has {num_experts} experts; {_RERUN}"
        )
    solve = _SOLVERS[algorithm]
    kw = dict(max_load_imbalance=max_load_imbalance, seed=seed, **options)
    if num_nodes == 1:
        return [sorted(g) for g in solve(_incidence(topk_ids_TK, num_experts), num_devices, **kw)]
    # level 1: experts -> nodes; level 2: each node's experts -> its D/N devices, ids local to the node
    ids = topk_ids_TK.long().cpu()
    groups: list[list[int]] = []
    for node, members in enumerate(solve(_incidence(ids, num_experts), num_nodes, **kw)):
        local = torch.full((num_experts + 1,), -1, dtype=torch.long)  # slot E: the -1 sentinel
        local[torch.tensor(members)] = torch.arange(len(members))
        sub_ids = local[torch.where(ids >= 0, ids, num_experts)]
        kw["seed"] = seed + node + 1
        sub_groups = solve(_incidence(sub_ids, len(members)), num_devices // num_nodes, **kw)
        groups.extend(sorted(members[i] for i in g) for g in sub_groups)
    return groups


# name -> `place_layer` with that algorithm: fn(topk_ids_TK, num_experts, num_devices, **kwargs) -> groups
PLACEMENT_ALGORITHMS: dict[str, Callable[..., list[list[int]]]] = {
    name: partial(place_layer, algorithm=name) for name in _SOLVERS
}


# ---- the placement of a whole model, and its file ----------------------------------------------------
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_groups(groups, num_experts: int, num_devices: int, where: str) -> list[list[int]]:
    if not isinstance(groups, list) or len(groups) != num_devices:
        n = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise PlacementError(f"{where} has {n} device groups but num_devices={num_devices}; {_RERUN}")
    per, seen = num_experts // num_devices, set()
    for d, group in enumerate(groups):
        if not isinstance(group, list) or not all(_is_int(e) for e in group):
            raise PlacementError(f"{where} device {d} is not a list of expert ids: {group!r}; {_RERUN}")
        if len(group) != per:
            raise PlacementError(
                f"{where} device {d} holds {len(group)} experts; each of the {num_devices} devices must hold "
                f"{num_experts}/{num_devices}={per}; {_RERUN}"
            )
        for e in group:
            if not 0 <= e < num_experts:
                raise PlacementError(f"{where} has expert id {e} outside 0..{num_experts - 1}; {_RERUN}")
            if e in seen:
                raise PlacementError(f"{where} places expert {e} on two devices; {_RERUN}")
            seen.add(e)
    return [sorted(g) for g in groups]


@dataclass
class Placement:
    """Expert -> device assignment of every MoE layer of one model.

    Args:
        model: name or path of the profiled model (informational).
        model_type: HF `model_type`, checked by `check_model` when both sides know it.
        num_experts: E routed experts per layer.
        num_devices: D expert-parallel devices; num_nodes: N nodes (device d on node d // (D/N)).
        algorithm: the algorithm that produced it.
        groups: MoE layer index (decoder layer) -> D lists of E/D original expert ids (sorted).
        metrics: informational numbers, e.g. comm_complexity before/after on the profile.
    """

    model: str | None
    model_type: str | None
    num_experts: int
    num_devices: int
    num_nodes: int
    algorithm: str
    groups: dict[int, list[list[int]]]
    metrics: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("num_experts", "num_devices", "num_nodes"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise PlacementError(
                    f"placement {name}={getattr(self, name)!r} must be a positive integer; {_RERUN}"
                )
        try:
            _validate(self.num_experts, self.num_devices, self.num_nodes, "sequential")
        except PlacementError as err:
            raise PlacementError(f"placement {err}") from None
        if not self.groups:
            raise PlacementError(f"placement has no layers; {_RERUN}")
        self.groups = {
            int(layer): _check_groups(groups, self.num_experts, self.num_devices, f"placement layer {layer}")
            for layer, groups in sorted(self.groups.items())
        }

    @property
    def layers(self) -> list[int]:
        return sorted(self.groups)

    def _layer_groups(self, layer: int) -> list[list[int]]:
        if layer not in self.groups:
            raise PlacementError(f"placement has no layer {layer}; it covers layers {self.layers}; {_RERUN}")
        return self.groups[layer]

    def expert_device(self, layer: int) -> torch.Tensor:
        """(E,) int64 device of each original expert id of `layer`."""
        return expert_device_from_groups(self._layer_groups(layer), self.num_experts)

    def expert_order(self, layer: int) -> torch.Tensor:
        """(E,) int64: new expert j is original expert order[j] (device d holds new ids d*E/D .. +E/D-1)."""
        return torch.tensor([e for group in self._layer_groups(layer) for e in group], dtype=torch.long)

    def check_model(
        self, num_experts: int, layer_indices: Iterable[int], model_type: str | None = None
    ) -> None:
        """Raise `PlacementError` unless this placement fits a model with these experts and MoE layers."""
        if num_experts != self.num_experts:
            raise PlacementError(
                f"placement was made for {self.num_experts} experts, model has {num_experts}; {_RERUN}"
            )
        layers = sorted(int(i) for i in layer_indices)
        if layers != self.layers:
            raise PlacementError(f"placement covers MoE layers {self.layers}, model has {layers}; {_RERUN}")
        if model_type is not None and self.model_type is not None and model_type != self.model_type:
            raise PlacementError(
                f"placement was made for a {self.model_type} model, this one is {model_type}; {_RERUN}"
            )

    def to_json(self) -> str:
        """The file text: JSON with one line per device group."""
        head = dict(
            format=PLACEMENT_FORMAT,
            version=PLACEMENT_VERSION,
            model=self.model,
            model_type=self.model_type,
            num_experts=self.num_experts,
            num_devices=self.num_devices,
            num_nodes=self.num_nodes,
            algorithm=self.algorithm,
        )
        lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "layers": {']
        for i, layer in enumerate(self.layers):
            body = ",\n".join(f"      {json.dumps(g)}" for g in self.groups[layer])
            lines.append(f'    "{layer}": [\n{body}\n    ]' + ("," if i < len(self.groups) - 1 else ""))
        metrics = json.dumps(self.metrics, indent=2).replace("\n", "\n  ")
        return "\n".join(lines + ["  },", f'  "metrics": {metrics}', "}"]) + "\n"

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if not path.parent.is_dir():
            raise PlacementError(
                f"cannot write '{path}': directory '{path.parent}' does not exist; create it first"
            )
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        """Read and validate a placement file; every problem raises a one-line `PlacementError`."""
        path = Path(path)
        if not path.is_file():
            raise PlacementError(f"placement file '{path}' not found; create it with `occult-ft place`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            where = (
                f" at line {err.lineno}, column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
            )
            raise PlacementError(f"placement file '{path}' is not valid JSON{where}; {_RERUN}") from None
        if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlacementError(
                f"'{path}' is not an occult_ft placement file (format={found!r}, expected "
                f"{PLACEMENT_FORMAT!r}); {_RERUN}"
            )
        if data.get("version") != PLACEMENT_VERSION:
            raise PlacementError(
                f"'{path}' has placement version {data.get('version')!r}; this occult_ft reads version "
                f"{PLACEMENT_VERSION}; {_RERUN}"
            )
        for key in ("num_experts", "num_devices", "num_nodes", "algorithm", "layers"):
            if key not in data:
                raise PlacementError(f"placement file '{path}' lacks the {key!r} field; {_RERUN}")
        if not isinstance(data["layers"], dict):
            raise PlacementError(
                f"placement file '{path}': 'layers' must map layer index -> groups; {_RERUN}"
            )
        bad_keys = [k for k in data["layers"] if not k.lstrip("-").isdigit()]
        if bad_keys:
            raise PlacementError(
                f"placement file '{path}' has layer key {bad_keys[0]!r}, not an integer; {_RERUN}"
            )
        try:
            return cls(
                model=data.get("model"),
                model_type=data.get("model_type"),
                num_experts=data["num_experts"],
                num_devices=data["num_devices"],
                num_nodes=data["num_nodes"],
                algorithm=str(data["algorithm"]),
                groups={int(k): v for k, v in data["layers"].items()},
                metrics=data.get("metrics") or {},
            )
        except PlacementError as err:
            raise PlacementError(f"placement file '{path}': {err}") from None


def _layer_report(
    topk_ids_TK: torch.Tensor, groups, num_experts: int, num_devices: int, num_nodes: int
) -> dict:
    dev_E = expert_device_from_groups(groups, num_experts)
    seq_E = torch.arange(num_experts) // (num_experts // num_devices)
    report = dict(
        tokens=int(topk_ids_TK.shape[0]),
        comm_complexity_sequential=comm_complexity(topk_ids_TK, seq_E, num_devices),
        comm_complexity=comm_complexity(topk_ids_TK, dev_E, num_devices),
        load_imbalance=load_imbalance(topk_ids_TK, dev_E, num_devices),
    )
    if num_nodes > 1:
        report["node_complexity"] = comm_complexity(
            topk_ids_TK, dev_E // (num_devices // num_nodes), num_nodes
        )
    return report


def _place_in_routing_groups(ids_TK, num_experts, num_devices, group_size, algorithm, num_nodes, **kw):
    """Placement for a model whose router picks among contiguous routing groups (DeepSeek group-limited
    routing): groups must stay whole blocks. With whole groups per device, the groups are placed as
    units; when a group spans several devices, it keeps its slot and its experts are placed over those
    devices (on the tokens' experts inside it)."""
    per_device = num_experts // num_devices
    if per_device % group_size == 0:
        unit_groups = place_layer(
            ids_TK // group_size, num_experts // group_size, num_devices, algorithm, num_nodes, **kw
        )
        return [
            sorted(e for u in g for e in range(u * group_size, (u + 1) * group_size)) for g in unit_groups
        ]
    span = group_size // per_device  # devices per routing group
    groups: list[list[int]] = []
    for q in range(num_experts // group_size):
        local = torch.where(ids_TK // group_size == q, ids_TK - q * group_size, -1)
        inside = local.max(dim=1).values >= 0  # tokens with at least one expert in this group
        sub = place_layer(local[inside], group_size, span, algorithm, **kw)
        groups.extend(sorted(q * group_size + e for e in g) for g in sub)
    return groups


def compute_placement(
    profile, num_devices: int, num_nodes: int = 1, algorithm: str = DEFAULT_ALGORITHM, **kw
) -> Placement:
    """Place every profiled layer.

    Args:
        profile: object with `model`, `model_type`, `num_experts`, `top_k` and `layers`
            (layer index -> object with `.topk_ids`, (T, K) int64), e.g. `occult_ft.profiling.Profile`.
        num_devices, num_nodes, algorithm: see `place_layer`; kw: its other arguments.

    Returns:
        A `Placement` whose `metrics` hold per-layer and token-weighted overall comm_complexity
        (sequential vs placed) and load imbalance on the profile.
    """
    num_experts = int(profile.num_experts)
    _validate(num_experts, num_devices, num_nodes, algorithm)
    if not profile.layers:
        raise PlacementError("profile has no MoE layers; profile the model with `occult-ft profile` first")
    group_size = int(getattr(profile, "group_size", 1) or 1) if algorithm != "sequential" else 1
    per_device = num_experts // num_devices
    if group_size > 1 and per_device % group_size and group_size % per_device:
        num_group = num_experts // group_size
        raise PlacementError(
            f"the model routes within {num_group} groups of {group_size} experts, which must stay whole, and "
            f"devices={num_devices} ({per_device} experts each) neither holds whole groups nor splits each group "
            f"evenly; use devices dividing or divisible by {num_group}, or placement 'sequential'"
        )
    groups, per_layer = {}, {}
    for layer in sorted(profile.layers):
        ids = profile.layers[layer].topk_ids
        if group_size > 1:
            groups[int(layer)] = _place_in_routing_groups(
                ids.long(), num_experts, num_devices, group_size, algorithm, num_nodes, **kw
            )
        else:
            groups[int(layer)] = place_layer(ids, num_experts, num_devices, algorithm, num_nodes, **kw)
        per_layer[str(layer)] = _layer_report(ids, groups[int(layer)], num_experts, num_devices, num_nodes)
    tokens = sum(m["tokens"] for m in per_layer.values())

    def overall(key: str) -> float:
        return sum(m[key] * m["tokens"] for m in per_layer.values()) / tokens if tokens else 0.0

    metrics = dict(
        comm_complexity_sequential=overall("comm_complexity_sequential"),
        comm_complexity=overall("comm_complexity"),
        load_imbalance=max(m["load_imbalance"] for m in per_layer.values()),
        layers=per_layer,
    )
    return Placement(
        getattr(profile, "model", None),
        getattr(profile, "model_type", None),
        num_experts,
        num_devices,
        num_nodes,
        algorithm,
        groups,
        metrics,
    )


def sequential_placement(
    num_experts: int,
    num_devices: int,
    layer_indices: Iterable[int],
    model: str | None = None,
    model_type: str | None = None,
) -> Placement:
    """The framework default (contiguous experts per device) as a `Placement`, for every listed layer."""
    _validate(num_experts, num_devices, 1, "sequential")
    groups = _sequential(torch.zeros(0, num_experts), num_devices)
    return Placement(
        model,
        model_type,
        num_experts,
        num_devices,
        1,
        "sequential",
        {int(i): [list(g) for g in groups] for i in layer_indices},
    )


# ---- applying a placement to a model --------------------------------------------------------------------
def _check_group_routing(layer, order_E: torch.Tensor) -> None:
    """DeepSeek group-limited routing scores contiguous blocks of experts; a permutation that mixes them
    would change the model, so only block-preserving placements are allowed there."""
    size = layer.arch.routing_group_size(layer.router)
    if size == 1:
        return
    num_group = layer.num_experts // size
    blocks = {frozenset(range(g * size, (g + 1) * size)) for g in range(num_group)}
    moved = {frozenset(order_E[j * size : (j + 1) * size].tolist()) for j in range(num_group)}
    if moved != blocks:
        raise PlacementError(
            f"layer {layer.index} routes within {num_group} expert groups of {size} (group-limited routing) and "
            "this placement mixes them, which would change the model; place from a profile of this model "
            "(placement then moves whole groups), or use placement 'sequential'"
        )


@torch.no_grad()
def permute_experts(model: nn.Module, placement: Placement) -> None:
    """Reorder every MoE layer's expert-indexed tensors in place so that device d holds the contiguous new
    ids [d*E/D, (d+1)*E/D). The model computes the same function (same outputs) afterwards.

    Args:
        model: a supported transformers MoE model (PEFT/DDP wrappers are unwrapped).
        placement: a `Placement` matching the model (`check_model` is called first).
    """
    layers = find_moe_layers(model)
    placement.check_model(layers[0].num_experts, [layer.index for layer in layers], layers[0].arch.model_type)
    for layer in layers:
        order_E = placement.expert_order(layer.index)
        _check_group_routing(layer, order_E)
        for owner, names in (
            (layer.router, layer.arch.router_params),
            (layer.experts, layer.arch.expert_params),
        ):
            for name in names:
                tensor = getattr(owner, name, None)
                if tensor is None:
                    continue  # optional tensor (e.g. a bias) absent in this config
                if tensor.shape[0] != placement.num_experts:
                    raise PlacementError(
                        f"layer {layer.index} {name} has {tensor.shape[0]} rows on dim 0, expected "
                        f"{placement.num_experts} experts; is this model sharded already?"
                    )
                tensor.copy_(tensor.index_select(0, order_E.to(tensor.device)))


# ---- benchmark --------------------------------------------------------------------------------------------
def benchmark_placement(
    num_experts: int = 256,
    num_layers: int = 60,
    num_devices: int = 8,
    top_k: int = 8,
    tokens: int = 4096,
    algorithm: str = DEFAULT_ALGORITHM,
    seed: int = 0,
) -> float:
    """Seconds that `compute_placement` takes on a synthetic profile (not a test; for the benchmark report).

    Each layer hides E/8 groups of 8 experts (ids shuffled per layer); a token boosts each expert of one
    group with probability 0.7, so about 5.6 of its top_k picks land in the group, the rest anywhere.
    """
    gen = torch.Generator().manual_seed(seed)
    layers = {}
    for layer in range(num_layers):
        perm_E = torch.randperm(num_experts, generator=gen)
        group_T = torch.randint(num_experts // 8, (tokens,), generator=gen)
        inside_TE = torch.zeros(tokens, num_experts)
        inside_TE[torch.arange(tokens)[:, None], group_T[:, None] * 8 + torch.arange(8)] = 1.0
        score_TE = torch.rand(tokens, num_experts, generator=gen) + 2.0 * inside_TE * (
            torch.rand(tokens, num_experts, generator=gen) < 0.7
        )
        layers[layer] = SimpleNamespace(topk_ids=perm_E[score_TE.topk(top_k, dim=1).indices])
    profile = SimpleNamespace(
        model="synthetic", model_type=None, num_experts=num_experts, top_k=top_k, layers=layers
    )
    start = time.perf_counter()
    compute_placement(profile, num_devices, algorithm=algorithm)
    return time.perf_counter() - start
