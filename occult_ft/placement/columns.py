"""Columns of the set-partitioning model (`occult_ft.placement.partition`): the profiled tokens as
distinct expert sets with their weights (`TokenSets`), what a group of experts costs (the tokens that
reach its device), the load bound a group must keep (`LoadBound`), and pricing: the group of least
reduced cost c(g) - pi(g) within the cap (`price`, a branch and bound tried after swap descent and
greedy starts).

Shape legend: U distinct token sets, m experts of the sub-problem, s experts per group; pi (m,) duals,
rc(g) = c(g) - pi(g) a reduced cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ENUMERATION_LIMIT", "EPS", "LoadBound", "TokenSets", "greedy_groups", "local_descent", "price"]

ENUMERATION_LIMIT = 15000  # reduced-cost-fixed columns the final MILP takes (HiGHS: seconds at this size)
EPS = 1e-6
"""Slack of reduced-cost comparisons: a column prices negative below -EPS."""


@dataclass
class TokenSets:
    """Distinct token expert sets with their token counts.

    Args:
        X: (U, m) bool, X[u, e] = set u holds expert e. w: (U,) float64 token count of each set.
    """

    X: np.ndarray
    w: np.ndarray
    _Xf: np.ndarray | None = field(default=None, repr=False)
    _ids: np.ndarray | None = field(default=None, repr=False)
    _rows_of: list | None = field(default=None, repr=False)

    @classmethod
    def from_incidence(cls, x_TE) -> TokenSets:
        """Merge identical rows of a (T, m) 0/1 incidence (torch or numpy); empty rows are dropped."""
        x = np.asarray(x_TE.cpu() if hasattr(x_TE, "cpu") else x_TE) > 0.5
        return cls.from_bool(x)

    @classmethod
    def from_bool(cls, x: np.ndarray) -> TokenSets:
        # a token that reaches none of the m experts costs nothing on any partition: drop it
        x = x[x.any(axis=1)]
        if x.shape[0] == 0:
            return cls(np.zeros((0, x.shape[1]), bool), np.zeros(0))
        # np.unique over rows merges tokens with the same expert set; the count of each is its weight w_S
        rows, counts = np.unique(x, axis=0, return_counts=True)
        return cls(rows, counts.astype(np.float64))

    def restrict(self, keep: np.ndarray) -> TokenSets:
        """The token sets on the experts `keep` (bool (m,)), merged again (sets left empty are dropped)."""
        x = self.X[:, keep]
        live = x.any(axis=1)
        # sets that differ only outside `keep` merge into one row; bincount sums their weights per new row
        rows, inv = np.unique(x[live], axis=0, return_inverse=True)
        return TokenSets(rows, np.bincount(inv.ravel(), weights=self.w[live], minlength=len(rows)))

    @property
    def num_experts(self) -> int:
        return self.X.shape[1]

    @property
    def ids(self) -> np.ndarray:
        """(U, k) int64 experts of each set, padded with m (sets hold at most k experts)."""
        if self._ids is None:
            # k = the largest set size: the width of the padded (U, k) expert lists
            k = int(self.X.sum(axis=1).max(initial=0))
            # each row's members first (False sorts before True in ~X), in expert order; then the
            # non-members among the first k positions become the pad m (an index one past the columns)
            order = np.argsort(~self.X, axis=1, kind="stable")[:, :k]
            self._ids = np.where(np.take_along_axis(self.X, order, axis=1), order, self.X.shape[1])
        return self._ids

    @property
    def rows_of(self) -> list[np.ndarray]:
        """Per expert, the sets holding it."""
        if self._rows_of is None:
            # the inverse incidence: rows_of[e] lists the sets u with X[u, e]
            self._rows_of = [np.flatnonzero(self.X[:, e]) for e in range(self.X.shape[1])]
        return self._rows_of

    @property
    def Xf(self) -> np.ndarray:
        if self._Xf is None:
            self._Xf = self.X.astype(np.float32)
        return self._Xf

    def cover(self, G: np.ndarray) -> np.ndarray:
        """(k,) float64 cost of each group of G (k, m) bool: tokens meeting the group."""
        G = np.atleast_2d(G)
        # padding the group with a False column makes the pad index m of `ids` read "not in the group"
        if G.shape[0] <= 4:  # a few groups: through the sets' expert lists
            padded = np.concatenate([G, np.zeros((G.shape[0], 1), bool)], axis=1)
            # row[ids] is (U, k): which of each set's experts lie in the group; any() = the set meets the group
            return np.array([float(self.w @ row[self.ids].any(axis=1)) for row in padded])
        out = np.empty(G.shape[0])
        # groups per matmul: the (U, step) hit matrix stays near 2**24 entries (64 MiB of float32)
        step = max(1, (1 << 24) // max(1, self.X.shape[0]))
        for lo in range(0, G.shape[0], step):
            # (U, m) @ (m, step): hits[u, j] = |S_u & g_j| > 0, the set meets group j; w @ hits sums its tokens
            hits = (self.Xf @ G[lo : lo + step].T.astype(np.float32)) > 0.5
            out[lo : lo + step] = self.w @ hits
        return out

    def trivial_bound(self, group_size: int) -> float:
        """sum_S w_S ceil(|S| / s): a token of |S| experts reaches at least that many groups of s."""
        # ceil(|S| / s): the fewest groups of s experts that can hold all |S| of a token's experts
        return float(self.w @ np.ceil(self.X.sum(axis=1) / group_size))


@dataclass(frozen=True)
class LoadBound:
    """max over all `num_devices` devices of load <= beta * (offset + z) / num_devices (see the module
    docstring); z is the summed load of the groups being placed."""

    beta: float
    num_devices: int
    offset: float = 0.0
    other_max: float = 0.0

    def cap(self, z: float) -> float:
        # cap(z) = beta * mean device load, the mean taken over all D devices (offset covers those outside)
        return self.beta * (self.offset + z) / self.num_devices

    def min_total(self) -> float:
        """The least z for which the devices outside the sub-problem keep the bound."""
        # every device outside holds at most other_max, so cap(z) >= other_max needs z >= D other_max / beta - offset
        return max(0.0, self.num_devices * self.other_max / self.beta - self.offset)

    def keeps(self, loads: np.ndarray) -> bool:
        top = max(float(np.max(loads)) if len(loads) else 0.0, self.other_max)
        # relative + absolute slack: costs are sums of floats, equal loads must not fail the bound by rounding
        return top <= self.cap(float(np.sum(loads))) * (1 + 1e-9) + 1e-9


# ---- pricing -------------------------------------------------------------------------------------------
def local_descent(sets: TokenSets, g: np.ndarray, pi: np.ndarray, alpha: float, cap: float) -> np.ndarray:
    """Best-improvement swaps (one expert out, one in) on alpha c(g) - pi(g), keeping c(g) <= cap.

    With n_U = members of g in each set: removing e loses the sets where e is the only member, adding f
    gains the sets g misses that hold f, and a swap keeps covered the sets holding both e and f as their
    only members. Each step is a few bincounts over the sets' expert lists (`TokenSets.ids`)."""
    m = sets.num_experts
    ids_UK, w, rows_of = sets.ids, sets.w, sets.rows_of
    g = g.copy()
    cost = float(sets.cover(g)[0])
    # n_U[u] = members of g in set u (the pad index m reads False, so it counts nothing)
    n_U = np.concatenate([g, [False]])[ids_UK].sum(axis=1)

    def tally(rows: np.ndarray) -> np.ndarray:  # (m,) tokens of the sets `rows` per expert
        ids = ids_UK[rows]
        # the pad id m lands in bin m, which [:m] drops
        return np.bincount(ids.ravel(), weights=np.repeat(w[rows], ids.shape[1]), minlength=m + 1)[:m]

    for _ in range(2 * int(g.sum()) + 4):
        # gain[f]: tokens of the sets g misses that hold f; alone: the sets that only one member of g meets
        gain, alone = tally(np.flatnonzero(n_U == 0)), n_U == 1
        ins = np.flatnonzero(g)
        dc = np.empty((len(ins), m))
        for r, e in enumerate(ins):
            mine = rows_of[e][alone[rows_of[e]]]  # sets where e is g's only member
            # dc[r, f] = change of c(g) when e leaves and f joins: + gain of f - sets only e met + those of them f meets
            dc[r] = gain - w[mine].sum() + tally(mine)
        # drc[r, f] = alpha dc - (pi_f - pi_e): the change of the reduced cost alpha c(g) - pi(g) for the swap
        drc = alpha * dc - (pi[None, :] - pi[ins][:, None])
        # f already in g is no swap; a swap that breaks the cap is not allowed either
        drc[:, g] = np.inf
        drc[cost + dc > cap + 1e-9] = np.inf
        i, j = np.unravel_index(int(np.argmin(drc)), drc.shape)
        # no swap lowers the reduced cost by more than the tolerance: a local minimum
        if not drc[i, j] < -1e-9:
            break
        g[ins[i]], g[j] = False, True
        n_U[rows_of[j]] += 1
        n_U[rows_of[ins[i]]] -= 1
        cost += float(dc[i, j])
    return g


def greedy_groups(sets: TokenSets, pi: np.ndarray, alpha: float, size: int, cap: float) -> list[np.ndarray]:
    """One group per seed expert, grown by the expert of least alpha * (marginal cost) - pi (within cap):
    the pricing starts that follow the duals wherever they are large."""
    m, ids_UK, w = sets.num_experts, sets.ids, sets.w
    out = []
    for seed in range(m):
        g = np.zeros(m, bool)
        g[seed] = True
        # covered[u]: set u already meets g (and so adds nothing to c(g) as the group grows)
        covered = np.zeros(len(w), bool)
        covered[sets.rows_of[seed]] = True
        cost = float(w[covered].sum())
        for _ in range(size - 1):
            rows = np.flatnonzero(~covered)
            # gain[f] = tokens of the uncovered sets holding f: c(g + f) - c(g)
            gain = np.bincount(
                ids_UK[rows].ravel(), weights=np.repeat(w[rows], ids_UK.shape[1]), minlength=m + 1
            )[:m]
            score = alpha * gain - pi
            # members and experts that would break the cap are out of the choice
            score[g | (cost + gain > cap + 1e-9)] = np.inf
            f = int(np.argmin(score))
            if not np.isfinite(score[f]):
                break
            g[f] = True
            covered[sets.rows_of[f]] = True
            cost += float(gain[f])
        # a seed whose growth the cap stopped early gives no full group
        if g.sum() == size:
            out.append(g)
    return out


def price(
    sets: TokenSets,
    pi: np.ndarray,
    alpha: float,
    size: int,
    cap: float,
    threshold: float,
    *,
    collect: bool = False,
    deadline: float = float("inf"),
    limit: int = ENUMERATION_LIMIT,
    exclude: set[bytes] | None = None,
) -> tuple[float, list[np.ndarray], float, bool]:
    """Branch and bound over groups of `size` experts on rc(g) = alpha c(g) - pi(g), c(g) <= cap.

    The bound of a node (chosen P, candidates C, r still to choose) uses c(P + R) >= c(P) + sum_{e in R}
    sum_S w_S [S misses P, e in S] / |S & C| for alpha >= 0 (a token met by R counts at least |R & S| /
    |S & C| <= 1), and c(P + R) <= min(cap, c(P) + sum of marginal gains) for alpha < 0.

    Args:
        threshold: minimising (collect=False): nodes whose bound is >= min(best, threshold) are pruned, so
            the search certifies "no group below threshold" or finds the best one; collecting
            (collect=True): every group with rc <= threshold is returned (at most `limit`).
        exclude: `np.packbits` keys of groups to skip when minimising (the master's own columns, whose
            reduced cost the master keeps >= 0, band rows included).
    Returns:
        (best rc found, groups, lower bound of min rc (valid also when stopped early), complete).
    """
    search = _BranchAndBound(sets, pi, alpha, size, cap, threshold, collect, deadline, limit, exclude)
    # the root: nothing chosen, cost and dual sum 0, every set still unmet, all candidates from 0
    search.visit([], 0.0, 0.0, search.X, sets.w, 0, np.inf)
    return float(search.best), search.groups(), float(search.lower), not search.stopped


class _BranchAndBound:
    """The search tree of one `price` call.

    A node is (P chosen, candidates j >= i in `order`, r = size - |P| still to choose), with Xu (U', m)
    and wu (U',) the token sets P does not meet yet: a set P already meets adds nothing more to c, so a
    child drops the sets its new expert meets. `lower` is the least bound over the nodes pruned or left
    unvisited (and the leaves), a valid lower bound of min rc even when the deadline stops the search.
    """

    def __init__(self, sets: TokenSets, pi, alpha, size, cap, threshold, collect, deadline, limit, exclude):
        X, w = sets.X, sets.w
        self.m = X.shape[1]
        # candidates in order of their fair share of the cost less their dual: cheap groups are reached
        # first, so `best` falls early and the bound prunes more of the tail
        # share_root[e] = sum_S w_S [e in S] / |S|: each token's 1 split equally over its experts
        share_root = w / np.maximum(X.sum(axis=1), 1) @ X if alpha >= 0 else w @ X
        self.order = np.argsort(alpha * share_root - pi, kind="stable")
        self.X, self.pi = X[:, self.order], pi[self.order]  # columns and duals in the search order
        self.alpha, self.size, self.cap, self.threshold = alpha, size, cap, threshold
        self.collect, self.deadline, self.limit, self.exclude = collect, deadline, limit, exclude
        self.best = np.inf
        self.found: list[list[int]] = []  # positions in `order`: the best group, or every group collected
        self.lower = np.inf
        self.nodes = 0
        self.stopped = False

    def node_bound(
        self, r: int, base_c: float, base_pi: float, Xu: np.ndarray, wu: np.ndarray, i: int
    ) -> float:
        """A lower bound of rc over the completions of the node (see `price`)."""
        XC = Xu[:, i:]
        cand_pi = self.pi[i:]
        alpha = self.alpha
        # np.partition(v, r - 1)[:r] holds the r smallest entries of v (unsorted): their sum is the best
        # any r candidates can add under a bound that is a sum over candidates
        if alpha >= 0:
            cnt = XC.sum(axis=1)  # |S & C|: candidates each set could still be met by
            keep = cnt > 0
            share = (wu[keep] / cnt[keep]) @ XC[keep]  # (m - i,) each candidate's share of the sets left
            # the r smallest alpha share - pi over the candidates, added to what P already costs
            vals = alpha * share - cand_pi
            return alpha * base_c - base_pi + np.partition(vals, r - 1)[:r].sum()
        # alpha < 0: bounding rc from below needs c from above, through the sum of gains or the cap
        gain = wu @ XC  # marginal gain of each candidate given P: c(P + R) <= c(P) + sum of gains, <= cap
        by_gain = alpha * base_c - base_pi + np.partition(alpha * gain - cand_pi, r - 1)[:r].sum()
        by_cap = (
            # with alpha < 0 the cost term is at least alpha * cap; the r largest duals are subtracted
            alpha * self.cap - base_pi + np.partition(-cand_pi, r - 1)[:r].sum()
        )  # minus the r largest pi
        return max(by_gain, by_cap)

    def visit(
        self, P: list[int], base_c: float, base_pi: float, Xu: np.ndarray, wu: np.ndarray, i: int, path: float
    ) -> None:
        """Search the node; `path` is the least bound on the way down (what a stop leaves unproven)."""
        if self.stopped:
            return
        self.nodes += 1
        # the clock is read every 256 nodes only: a node takes microseconds, so the deadline slips by
        # milliseconds at most
        if self.nodes % 256 == 0 and time.perf_counter() > self.deadline:
            self.stopped = True
            self.lower = min(self.lower, path)
            return
        r = self.size - len(P)
        # a full group of `size` experts: a leaf with rc = alpha c - pi
        if r == 0:
            self._leaf(P, self.alpha * base_c - base_pi)
            return
        if self.m - i < r:  # fewer candidates left than experts to choose
            return
        bound = self.node_bound(r, base_c, base_pi, Xu, wu, i)
        # this subtree cannot beat best (or the threshold): its bound still counts towards `lower`
        if self._prunes(bound):
            self.lower = min(self.lower, bound)
            return
        for j in range(i, self.m - r + 1):  # j: the next expert; at least r - 1 must remain after it
            col = Xu[:, j]
            # the sets of Xu meet P not yet; those holding j now meet the group and add their tokens to the cost
            c_new = base_c + float(wu[col].sum())
            if c_new > self.cap + 1e-9:  # cost only grows with the group: no column below
                continue
            # the child drops the sets j meets: they cannot add to the cost again
            self.visit(P + [j], c_new, base_pi + self.pi[j], Xu[~col], wu[~col], j + 1, min(path, bound))
            if self.stopped:  # the siblings left unvisited are covered by this node's bound
                self.lower = min(self.lower, bound)
                return

    def _prunes(self, bound: float) -> bool:
        if self.collect:  # every group up to the threshold is wanted, ties included
            return bound > self.threshold + EPS
        return bound >= min(self.best, self.threshold)

    def _leaf(self, P: list[int], val: float) -> None:
        if self.exclude and not self.collect:
            # packbits of the (m,) mask: the same key as `_Pool` uses for its columns
            if np.packbits(self._mask(P)).tobytes() in self.exclude:
                # a column of the master: its reduced cost is >= 0 at the master's duals
                self.lower = min(self.lower, 0.0)
                return
        self.lower = min(self.lower, val)
        if self.collect:
            if val <= self.threshold + EPS:
                self.found.append(list(P))
                if len(self.found) > self.limit:  # one past the limit: the enumeration is incomplete
                    self.stopped = True
        elif val < self.best:
            self.best = val
            self.found[:] = [list(P)]

    def _mask(self, P: list[int]) -> np.ndarray:
        """(m,) bool: the group of the positions P, in the experts' own order."""
        g = np.zeros(self.m, bool)
        # positions in the search order map back to expert ids through `order`
        g[self.order[P]] = True
        return g

    def groups(self) -> list[np.ndarray]:
        return [self._mask(P) for P in (self.found[: self.limit] if self.collect else self.found)]
