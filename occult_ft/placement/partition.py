"""Set partitioning on HiGHS: one layer's (or a few devices') experts split into equal groups, to proven
optimality where the instance allows it, and always with a valid lower bound.

Formulation. The profiled tokens are merged into distinct expert sets S with weights w_S (`TokenSets`). A
column is a group g of s experts; its cost c_g = sum_S w_S [S meets g] is the number of tokens that reach
the device holding g, i.e. that device's load (rows it receives). A partition's cost, sum_g c_g, is the
objective: summed distinct devices per token (comm_complexity times T). The master problem over n groups:

    min  sum_g c_g x_g
    s.t. sum_{g containing e} x_g = 1                 every expert e                       (duals pi_e)
         z - sum_g c_g x_g = 0                         z: the summed load                    (dual mu)
         D c_g x_g - beta z <= beta offset             the load bound, rows for the columns
                                                       that can break it (`LoadBound`)
         c_g <= max_load                               columns above an absolute cap are left out
         x_g in {0, 1}

`LoadBound` is max over all D devices of load <= beta * mean load: with `offset` (summed) and `other_max`
(largest) loads of devices outside the sub-problem (both 0 for a whole layer) it reads c_g <= beta
(offset + z) / D for the groups placed and other_max <= beta (offset + z) / D, a lower bound on z.

Solution (`solve_partition`), within a deadline:
  1. column generation on the LP relaxation: heuristic pricing (swap descent on reduced cost from the
     basis columns) and, when it finds nothing, exact pricing by branch and bound (`price`);
  2. the Lagrangian bound z_LP + n * min(0, lowest reduced cost) is valid at any iteration where the
     lowest reduced cost has a valid lower bound (exact pricing gives one, also when it stops early);
  3. the MILP over the generated columns gives an incumbent; then every column whose reduced cost is
     at most (incumbent - z_LP) is enumerated (reduced-cost fixing: no other column can be in a
     better solution) and the MILP over those proves the optimum (when their number fits
     `ENUMERATION_LIMIT` and HiGHS finishes in time).
All costs are token counts (integers), so an incumbent less than 1 above the bound is optimal.

Shape legend: U distinct token sets, m experts of the sub-problem, n groups of s experts (n s = m),
k columns in the pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ENUMERATION_LIMIT",
    "LoadBound",
    "PartitionResult",
    "TokenSets",
    "price",
    "scipy_available",
    "solve_partition",
]

ENUMERATION_LIMIT = 15000  # reduced-cost-fixed columns the final MILP takes (HiGHS: seconds at this size)
_EPS = 1e-6


def scipy_available() -> bool:
    """True when scipy (HiGHS) can be imported: the `solver` extra (`pip install 'occult-ft[solver]'`)."""
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return False
    return True


# ---- tokens and column costs ----------------------------------------------------------------------
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
        x = x[x.any(axis=1)]
        if x.shape[0] == 0:
            return cls(np.zeros((0, x.shape[1]), bool), np.zeros(0))
        rows, counts = np.unique(x, axis=0, return_counts=True)
        return cls(rows, counts.astype(np.float64))

    def restrict(self, keep: np.ndarray) -> TokenSets:
        """The token sets on the experts `keep` (bool (m,)), merged again (sets left empty are dropped)."""
        x = self.X[:, keep]
        live = x.any(axis=1)
        rows, inv = np.unique(x[live], axis=0, return_inverse=True)
        return TokenSets(rows, np.bincount(inv.ravel(), weights=self.w[live], minlength=len(rows)))

    @property
    def num_experts(self) -> int:
        return self.X.shape[1]

    @property
    def ids(self) -> np.ndarray:
        """(U, k) int64 experts of each set, padded with m (sets hold at most k experts)."""
        if self._ids is None:
            k = int(self.X.sum(axis=1).max(initial=0))
            order = np.argsort(~self.X, axis=1, kind="stable")[:, :k]
            self._ids = np.where(np.take_along_axis(self.X, order, axis=1), order, self.X.shape[1])
        return self._ids

    @property
    def rows_of(self) -> list[np.ndarray]:
        """Per expert, the sets holding it."""
        if self._rows_of is None:
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
        if G.shape[0] <= 4:  # a few groups: through the sets' expert lists
            padded = np.concatenate([G, np.zeros((G.shape[0], 1), bool)], axis=1)
            return np.array([float(self.w @ row[self.ids].any(axis=1)) for row in padded])
        out = np.empty(G.shape[0])
        step = max(1, (1 << 24) // max(1, self.X.shape[0]))
        for lo in range(0, G.shape[0], step):
            hits = (self.Xf @ G[lo : lo + step].T.astype(np.float32)) > 0.5
            out[lo : lo + step] = self.w @ hits
        return out

    def trivial_bound(self, group_size: int) -> float:
        """sum_S w_S ceil(|S| / s): a token of |S| experts reaches at least that many groups of s."""
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
        return self.beta * (self.offset + z) / self.num_devices

    def min_total(self) -> float:
        """The least z for which the devices outside the sub-problem keep the bound."""
        return max(0.0, self.num_devices * self.other_max / self.beta - self.offset)

    def keeps(self, loads: np.ndarray) -> bool:
        top = max(float(np.max(loads)) if len(loads) else 0.0, self.other_max)
        return top <= self.cap(float(np.sum(loads))) * (1 + 1e-9) + 1e-9


@dataclass
class PartitionResult:
    """`groups`: n lists of local expert ids (sorted); `value`: their summed cost; `lower_bound`: a proven
    bound of the optimum under the same load bound; `optimal`: value is proven optimal; `status`: a word
    on how it ended (optimal, gap, time limit, ...)."""

    groups: list[list[int]]
    value: float
    lower_bound: float
    optimal: bool
    status: str


# ---- pricing -------------------------------------------------------------------------------------------
def _local_descent(sets: TokenSets, g: np.ndarray, pi: np.ndarray, alpha: float, cap: float) -> np.ndarray:
    """Best-improvement swaps (one expert out, one in) on alpha c(g) - pi(g), keeping c(g) <= cap.

    With n_U = members of g in each set: removing e loses the sets where e is the only member, adding f
    gains the sets g misses that hold f, and a swap keeps covered the sets holding both e and f as their
    only members. Each step is a few bincounts over the sets' expert lists (`TokenSets.ids`)."""
    m = sets.num_experts
    ids_UK, w, rows_of = sets.ids, sets.w, sets.rows_of
    g = g.copy()
    cost = float(sets.cover(g)[0])
    n_U = np.concatenate([g, [False]])[ids_UK].sum(axis=1)

    def tally(rows: np.ndarray) -> np.ndarray:  # (m,) tokens of the sets `rows` per expert
        ids = ids_UK[rows]
        return np.bincount(ids.ravel(), weights=np.repeat(w[rows], ids.shape[1]), minlength=m + 1)[:m]

    for _ in range(2 * int(g.sum()) + 4):
        gain, alone = tally(np.flatnonzero(n_U == 0)), n_U == 1
        ins = np.flatnonzero(g)
        dc = np.empty((len(ins), m))
        for r, e in enumerate(ins):
            mine = rows_of[e][alone[rows_of[e]]]  # sets where e is g's only member
            dc[r] = gain - w[mine].sum() + tally(mine)
        drc = alpha * dc - (pi[None, :] - pi[ins][:, None])
        drc[:, g] = np.inf
        drc[cost + dc > cap + 1e-9] = np.inf
        i, j = np.unravel_index(int(np.argmin(drc)), drc.shape)
        if not drc[i, j] < -1e-9:
            break
        g[ins[i]], g[j] = False, True
        n_U[rows_of[j]] += 1
        n_U[rows_of[ins[i]]] -= 1
        cost += float(dc[i, j])
    return g


def _greedy_groups(sets: TokenSets, pi: np.ndarray, alpha: float, size: int, cap: float) -> list[np.ndarray]:
    """One group per seed expert, grown by the expert of least alpha * (marginal cost) - pi (within cap):
    the pricing starts that follow the duals wherever they are large."""
    m, ids_UK, w = sets.num_experts, sets.ids, sets.w
    out = []
    for seed in range(m):
        g = np.zeros(m, bool)
        g[seed] = True
        covered = np.zeros(len(w), bool)
        covered[sets.rows_of[seed]] = True
        cost = float(w[covered].sum())
        for _ in range(size - 1):
            rows = np.flatnonzero(~covered)
            gain = np.bincount(
                ids_UK[rows].ravel(), weights=np.repeat(w[rows], ids_UK.shape[1]), minlength=m + 1
            )[:m]
            score = alpha * gain - pi
            score[g | (cost + gain > cap + 1e-9)] = np.inf
            f = int(np.argmin(score))
            if not np.isfinite(score[f]):
                break
            g[f] = True
            covered[sets.rows_of[f]] = True
            cost += float(gain[f])
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
    X, w, m = sets.X, sets.w, sets.X.shape[1]
    share_root = w / np.maximum(X.sum(axis=1), 1) @ X if alpha >= 0 else w @ X
    order = np.argsort(alpha * share_root - pi, kind="stable")
    Xo, pio = X[:, order], pi[order]
    best = [np.inf]
    found: list[list[int]] = []
    lower = [np.inf]
    state = {"nodes": 0, "stopped": False}

    def node_bound(r, base_c, base_pi, Xu, wu, i) -> float:
        XC = Xu[:, i:]
        cand_pi = pio[i:]
        if alpha >= 0:
            cnt = XC.sum(axis=1)
            keep = cnt > 0
            share = (wu[keep] / cnt[keep]) @ XC[keep]
            vals = alpha * share - cand_pi
            return alpha * base_c - base_pi + np.partition(vals, r - 1)[:r].sum()
        gain = wu @ XC  # marginal gain of each candidate given P: c(P + R) <= c(P) + sum of gains, <= cap
        by_gain = alpha * base_c - base_pi + np.partition(alpha * gain - cand_pi, r - 1)[:r].sum()
        by_cap = alpha * cap - base_pi + np.partition(-cand_pi, r - 1)[:r].sum()  # minus the r largest pi
        return max(by_gain, by_cap)

    def rec(P: list[int], base_c: float, base_pi: float, Xu: np.ndarray, wu: np.ndarray, i: int, path: float):
        if state["stopped"]:
            return
        state["nodes"] += 1
        if state["nodes"] % 256 == 0 and time.perf_counter() > deadline:
            state["stopped"] = True
            lower[0] = min(lower[0], path)
            return
        r = size - len(P)
        if r == 0:
            val = alpha * base_c - base_pi
            if exclude and not collect:
                g = np.zeros(m, bool)
                g[order[P]] = True
                if np.packbits(g).tobytes() in exclude:
                    lower[0] = min(lower[0], 0.0)
                    return
            lower[0] = min(lower[0], val)
            if collect:
                if val <= threshold + _EPS:
                    found.append(list(P))
                    if len(found) > limit:
                        state["stopped"] = True
            elif val < best[0]:
                best[0] = val
                found[:] = [list(P)]
            return
        if m - i < r:
            return
        bound = node_bound(r, base_c, base_pi, Xu, wu, i)
        cut = threshold + _EPS if collect else min(best[0], threshold)
        if (bound > cut) if collect else (bound >= cut):
            lower[0] = min(lower[0], bound)
            return
        for j in range(i, m - r + 1):
            col = Xu[:, j]
            c_new = base_c + float(wu[col].sum())
            if c_new > cap + 1e-9:  # cost only grows with the group: no column below
                continue
            rec(P + [j], c_new, base_pi + pio[j], Xu[~col], wu[~col], j + 1, min(path, bound))
            if state["stopped"]:
                lower[0] = min(lower[0], bound)
                return

    rec([], 0.0, 0.0, Xo, w, 0, np.inf)
    groups = []
    for P in found[:limit] if collect else found:
        g = np.zeros(m, bool)
        g[order[P]] = True
        groups.append(g)
    return float(best[0]), groups, float(lower[0]), not state["stopped"]


# ---- the master problem ----------------------------------------------------------------------------------
class _Pool:
    """The generated columns: G (k, m) bool and their costs, without duplicates."""

    def __init__(self, m: int, sets: TokenSets | None = None):
        self.G = np.zeros((0, m), bool)
        self.cost = np.zeros(0)
        self.keys: set[bytes] = set()
        # artificial costs: twice each expert's fair share of the tokens (a token's 1 split over its experts)
        share = np.ones(m) if sets is None else (sets.w / np.maximum(sets.X.sum(axis=1), 1)) @ sets.X
        self.share = np.maximum(share, 1e-9)
        self.art = 2.0 * np.maximum(share, 1.0)

    def add(self, sets: TokenSets, groups: list[np.ndarray]) -> int:
        new = []
        for g in groups:
            key = np.packbits(g).tobytes()
            if key not in self.keys:
                self.keys.add(key)
                new.append(g)
        if new:
            self.G = np.vstack([self.G, np.array(new)])
            self.cost = np.concatenate([self.cost, sets.cover(np.array(new))])
        return len(new)


def _solve_lp(G: np.ndarray, cost: np.ndarray, art: np.ndarray):
    """LP relaxation of the partition over the columns G plus an artificial per expert of cost `art[e]`
    (always feasible): (value, x, pi) or None.

    The artificials cap the duals (pi_e <= art[e]): the set-partitioning LP is highly degenerate and, from
    a few columns, HiGHS returns duals as large as the artificial cost, which no pricing can follow. A
    cheap artificial only relaxes the LP further, so the bound stays valid; `_column_generation` raises
    the cost of any artificial the LP still uses, so a converged LP uses none and is the real LP."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_array, hstack, identity

    k, m = G.shape
    A_eq = hstack([coo_array(G.T.astype(np.float64)), identity(m, format="coo")]).tocsr()
    c = np.concatenate([cost, art])
    res = linprog(c, A_eq=A_eq, b_eq=np.ones(m), bounds=(0, None), method="highs")
    if res.status != 0:
        return None
    return float(res.fun), res.x[:k], np.asarray(res.eqlin.marginals, dtype=np.float64)


def _solve_milp(G: np.ndarray, cost: np.ndarray, bound: LoadBound | None, z_low: float, seconds: float):
    """MILP over the columns G with the exact load bound; returns (chosen rows or None, value, HiGHS dual
    bound, proven optimal).

    The bound is linear through the summed load z: z = sum_g c_g x_g, z >= `LoadBound.min_total`, and for
    every column that could break it, z >= z_low + (D c_g / beta - offset - z_low) x_g (x_g = 1 needs
    offset + z >= D c_g / beta; z_low is a valid lower bound of z).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    k, m = G.shape
    if seconds < 0.5 or k == 0:  # no time left (or nothing to choose from): no solve
        return None, np.inf, -np.inf, False
    nvar = k + (bound is not None)
    part = coo_array(G.T.astype(np.float64), shape=(m, k))
    constraints = [LinearConstraint(coo_array((part.data, (part.row, part.col)), shape=(m, nvar)), 1, 1)]
    lo, hi = np.zeros(nvar), np.ones(nvar)
    if bound is not None:
        lo[k], hi[k] = bound.min_total(), np.inf
        z_row = np.zeros((1, nvar))
        z_row[0, :k], z_row[0, k] = -cost, 1.0
        constraints.append(LinearConstraint(z_row, 0, 0))
        slope = bound.num_devices * cost / bound.beta - bound.offset - z_low
        band = np.flatnonzero(slope > 1e-9)
        if len(band):
            r = np.arange(len(band))
            A = coo_array(
                (
                    np.concatenate([-slope[band], np.ones(len(band))]),
                    (np.concatenate([r, r]), np.concatenate([band, np.full(len(band), k)])),
                ),
                shape=(len(band), nvar),
            )
            constraints.append(LinearConstraint(A, z_low, np.inf))
    integrality = np.zeros(nvar)
    integrality[:k] = 1
    c = np.concatenate([cost, np.zeros(nvar - k)])
    res = milp(
        c,
        constraints=constraints,
        integrality=integrality,
        bounds=Bounds(lo, hi),
        options={"time_limit": seconds, "mip_rel_gap": 1e-9, "disp": False},
    )
    dual = getattr(res, "mip_dual_bound", None)
    dual = float(dual) if dual is not None and np.isfinite(dual) else -np.inf
    if res.x is None:
        return None, np.inf, dual, False
    chosen = np.flatnonzero(res.x[:k] > 0.5)
    return chosen, float(cost[chosen].sum()), dual, res.status == 0


# ---- the solve ------------------------------------------------------------------------------------------
def _to_groups(G: np.ndarray) -> list[list[int]]:
    return sorted(np.flatnonzero(g).tolist() for g in G)


def _random_group(rng: np.random.Generator, m: int, size: int) -> np.ndarray:
    g = np.zeros(m, bool)
    g[rng.choice(m, size, replace=False)] = True
    return g


@dataclass
class _LP:
    """A priced LP within a cap: value, x over `pool.G[inside]`, the duals pi of its best Lagrangian bound
    with the lower bound `lb_rc` of their least reduced cost, `bound` = sum(pi) + n min(0, lb_rc) (a proven
    bound of every partition within the cap), whether the LP value was proven (`converged`: the bound
    meets it), and whether artificials were needed (no partition within the cap among the columns)."""

    value: float
    x: np.ndarray
    inside: np.ndarray
    pi: np.ndarray
    lb_rc: float = -np.inf
    converged: bool = False
    artificial: bool = False
    bound: float = -np.inf


def _heuristic_columns(
    sets: TokenSets, pool: _Pool, inside, x, pi_price, pi_lp, size, cap
) -> list[np.ndarray]:
    """Columns priced negative against the LP duals `pi_lp`, searched at the duals `pi_price`: descents
    from the basis columns and from the best greedy groups."""
    basis = np.flatnonzero(x > 1e-9)
    starts = [pool.G[inside[i]] for i in basis[np.argsort(-x[basis])][:8]]
    greedy = _greedy_groups(sets, pi_price, 1.0, size, cap)
    rc = np.array([sets.cover(g)[0] - pi_price[g].sum() for g in greedy])
    starts += [greedy[i] for i in np.argsort(rc)[:8]]
    found = [_local_descent(sets, g, pi_price, 1.0, cap) for g in starts]
    return [g for g in found if sets.cover(g)[0] - pi_lp[g].sum() < -_EPS]


def _column_generation(
    sets: TokenSets, num_groups: int, pool: _Pool, cap: float, rng, deadline: float
) -> _LP | None:
    """LP over the pool columns within `cap`, priced until its value is proven (or the deadline). None
    when no column fits the cap.

    Pricing is stabilised (Wentges smoothing): columns are searched at duals between the best
    Lagrangian centre and the LP's. For any duals pi, sum_e pi_e + n min_g rc_g(pi) bounds every
    partition from below (a partition covers each expert once); exact pricing (`price`) gives min rc, so
    each exact pricing gives a bound, the best one is the centre, and the LP is solved once the bound
    meets its value. The set-partitioning LP is highly degenerate, and the LP's own duals alone leave a
    long tail of columns that do not move it.
    """
    m = sets.num_experts
    size = m // num_groups
    center, center_lb_rc, best = None, -np.inf, -np.inf
    alpha, rounds = 0.5, 0
    lp = None
    while time.perf_counter() < deadline:
        inside = np.flatnonzero(pool.cost <= cap + 1e-9)
        if len(inside) == 0:
            pool.add(sets, [_random_group(rng, m, size) for _ in range(8 * num_groups)])
            inside = np.flatnonzero(pool.cost <= cap + 1e-9)
        if len(inside) == 0:
            return None
        res = _solve_lp(pool.G[inside], pool.cost[inside], pool.art)
        if res is None:
            return None
        value, x, pi = res
        short = pool.G[inside].T.astype(np.float64) @ x < 1 - 1e-6  # experts left to an artificial
        lp = _LP(value, x, inside, pi, -np.inf, False, bool(short.any()))
        if short.any():
            pool.art[short] *= 4.0  # the artificial is still in use: let its dual rise
            pool.add(sets, _heuristic_columns(sets, pool, inside, x, pi, pi, size, cap))
            continue
        tol = max(1e-6, 1e-6 * value)
        if value - best < tol:
            lp.converged = True
            break
        rounds += 1
        if center is None:  # start the centre at the LP's own cost split: each column's cost over its
            # experts in proportion to their fair share (degenerate LP duals are far from any good ones)
            used = pool.G[inside] * x[:, None]
            weight = used * pool.share[None, :]
            center = (
                (weight / np.maximum(weight.sum(axis=1, keepdims=True), 1e-30)) * pool.cost[inside][:, None]
            ).sum(axis=0)
        smooth = alpha * center + (1.0 - alpha) * pi
        added = pool.add(sets, _heuristic_columns(sets, pool, inside, x, smooth, pi, size, cap))
        if added and rounds % 8:
            continue
        # exact pricing at the smoothed duals: a bound, the centre, and a column if one prices negative
        budget = min(deadline, time.perf_counter() + 5.0)
        best_rc, groups, lb_rc, complete = price(
            sets, smooth, 1.0, size, cap, -tol / num_groups, deadline=budget
        )
        bound = float(smooth.sum()) + num_groups * min(0.0, lb_rc)
        if bound > best:
            best, center, center_lb_rc = bound, smooth.copy(), lb_rc
        useful = [g for g in groups if sets.cover(g)[0] - pi[g].sum() < -_EPS]
        if useful and pool.add(sets, useful):
            continue
        if not added:  # nothing prices negative at the LP duals from the smoothed ones: price at the LP's
            if alpha == 0.0 and complete:
                best, center, center_lb_rc = max(best, bound), smooth.copy(), lb_rc
                lp.converged = True
                break
            alpha = 0.0
    if lp is not None and center is not None:
        lp.pi, lp.lb_rc = center, center_lb_rc
        lp.bound = best
    return lp


def _dive(
    sets: TokenSets,
    num_groups: int,
    top: _LP,
    pool: _Pool,
    cap: float,
    rng,
    deadline: float,
) -> np.ndarray | None:
    """Primal heuristic: fix the column the LP uses most, re-price the LP on the experts left (within the
    same cap), repeat; returns the n groups (the caller checks the load bound) or None."""
    m = sets.num_experts
    chosen: list[np.ndarray] = []
    rest = np.arange(m)
    cur_sets, cur_pool = sets, pool
    lp: _LP | None = top
    for level in range(num_groups - 1):
        if lp is None or lp.artificial or time.perf_counter() > deadline:
            return None
        g = cur_pool.G[lp.inside[int(np.argmax(lp.x))]]
        full = np.zeros(m, bool)
        full[rest[g]] = True
        chosen.append(full)
        rest = rest[~g]
        cur_sets = cur_sets.restrict(~g)
        removed = np.ones(m, bool)
        removed[rest] = False
        within = ~pool.G[:, removed].any(axis=1)  # the top pool's columns among the experts left
        cur_pool = _Pool(len(rest), cur_sets)
        cur_pool.add(cur_sets, list(pool.G[within][:, rest]))
        if level < num_groups - 2:
            lp = _column_generation(cur_sets, num_groups - level - 1, cur_pool, cap, rng, deadline)
    last = np.zeros(m, bool)
    last[rest] = True
    return np.array(chosen + [last])


def solve_partition(
    sets: TokenSets,
    num_groups: int,
    starts: list[list[list[int]]],
    *,
    bound: LoadBound | None = None,
    max_load: float = float("inf"),
    seconds: float = 60.0,
    seed: int = 0,
) -> PartitionResult:
    """Split the m experts of `sets` into `num_groups` groups of m / num_groups at least summed cost.

    The load bound enters through caps. An optimum z* has every group within beta (offset + z*) / D, at
    most the cap of the incumbent UB, so the LP over the columns within that cap bounds z* from below;
    and no partition of value below z exists when the LP within cap(z) is >= z (such a partition stays
    within cap(its value) <= cap(z)), which a bisection on z raises further. Incumbents come from the
    starts, a dive on the LP and the exact MILP (band rows, see `_solve_milp`) over the generated columns;
    the last step enumerates every column a better partition could use (reduced-cost fixing) and solves
    the exact MILP over them.

    Args:
        sets: the sub-problem's token sets (local expert ids 0..m-1).
        starts: partitions to start from (the best one that keeps the bounds is the first incumbent; the
            result is never worse than it).
        bound: the relative load bound (None: none); max_load: an absolute cap on every group's cost.
        seconds: wall-clock budget (each stage gets what is left; a stage past it is skipped).
        seed: of the random pricing starts.
    Returns:
        The best partition found with a proven lower bound (status "infeasible" and no groups when no start
        keeps the bounds and none was found).
    """
    started = time.perf_counter()
    deadline = started + seconds
    m = sets.num_experts
    size = m // num_groups
    integral = bool(np.all(sets.w == np.round(sets.w)))

    def keeps(cost: np.ndarray) -> bool:
        return bool(cost.max(initial=0.0) <= max_load + 1e-9) and (bound is None or bound.keeps(cost))

    if num_groups == 1 or size == 1 or sets.X.shape[0] == 0:  # one cost for every partition
        G = np.ones((1, m), bool) if num_groups == 1 else np.eye(m, dtype=bool)
        cost = sets.cover(G)
        value = float(cost.sum())
        if keeps(cost):
            return PartitionResult(_to_groups(G), value, value, True, "optimal")
        return PartitionResult([], np.inf, value, False, "infeasible")

    state: dict[str, Any] = {"G": None, "best": np.inf, "lower": sets.trivial_bound(size)}  # G: (n, m) bool
    if bound is not None:
        state["lower"] = max(state["lower"], bound.min_total())

    def offer(G: np.ndarray | None) -> None:
        if G is None or len(G) != num_groups:
            return
        cost = sets.cover(G)
        if keeps(cost) and cost.sum() < state["best"] - 1e-9:
            state["G"], state["best"] = G.copy(), float(cost.sum())

    for groups in starts:
        G = np.zeros((num_groups, m), bool)
        for i, g in enumerate(groups):
            G[i, g] = True
        offer(G)

    def cap(z: float) -> float:
        return min(max_load, bound.cap(z) if bound is not None else np.inf)

    def upper() -> float:
        if np.isfinite(state["best"]):
            return state["best"]
        return float(sets.w @ np.minimum(sets.X.sum(axis=1), num_groups))  # every token on every group

    def closed() -> bool:
        return state["best"] - state["lower"] < (1.0 - 1e-6 if integral else 1e-6 * max(1.0, state["best"]))

    def done(status: str) -> PartitionResult:
        best, lower = state["best"], min(state["lower"], state["best"])
        if state["G"] is None:
            return PartitionResult([], np.inf, lower, False, "infeasible")
        if closed():
            return PartitionResult(_to_groups(state["G"]), best, best, True, "optimal")
        return PartitionResult(_to_groups(state["G"]), best, lower, False, status)

    pool = _Pool(m, sets)
    if state["G"] is not None:
        pool.add(sets, list(state["G"]))
    rng = np.random.default_rng(seed)

    def lp_at(z: float) -> _LP | None:
        return _column_generation(sets, num_groups, pool, cap(z), rng, deadline)

    def learn(lp: _LP | None) -> None:
        if lp is not None and np.isfinite(lp.bound):
            state["lower"] = max(state["lower"], lp.bound)

    def milp_over_pool() -> bool:
        inside = pool.cost <= cap(upper()) + 1e-9
        chosen, _, dual, proven = _solve_milp(
            pool.G[inside], pool.cost[inside], bound, state["lower"], 0.9 * (deadline - time.perf_counter())
        )
        if chosen is not None:
            offer(pool.G[inside][chosen])
        return proven

    top = lp_at(upper())
    learn(top)
    if top is not None and not closed():
        offer(_dive(sets, num_groups, top, pool, cap(upper()), rng, deadline))
    if closed():
        return done("optimal")
    if top is None or time.perf_counter() > deadline:
        return done("time limit")
    milp_over_pool()
    if bound is not None:  # raise the bound: the largest z whose cap's LP is >= z
        lo, hi = state["lower"], upper()
        reserve = deadline - 0.3 * seconds
        while hi - lo > max(1.0, 1e-4 * hi) and not closed() and time.perf_counter() < reserve:
            mid = 0.5 * (lo + hi)
            got = lp_at(mid)
            if got is None or not np.isfinite(got.bound):
                break
            if got.bound >= mid:
                lo = state["lower"] = max(state["lower"], mid)
            else:
                hi = mid
                offer(_dive(sets, num_groups, got, pool, cap(mid), rng, reserve))
        top = lp_at(upper())
        learn(top)
    if closed() or top is None or not np.isfinite(top.lb_rc) or time.perf_counter() > deadline - 1.0:
        return done("time limit")
    # reduced-cost fixing: a column of a better partition has rc <= best - z_LP - (n - 1) min(0, lb_rc)
    delta = state["best"] - float(top.pi.sum()) - (num_groups - 1) * min(0.0, top.lb_rc)
    _, enumerated, _, complete = price(
        sets, top.pi, 1.0, size, cap(upper()), delta, collect=True, deadline=deadline
    )
    if not complete:
        milp_over_pool()
        return done("gap (too many columns to enumerate)" if time.perf_counter() < deadline else "time limit")
    G = np.array(enumerated).reshape(-1, m)
    if state["G"] is not None:
        G = np.vstack([G, state["G"]])
    cost = sets.cover(G)
    chosen, val, dual, proven = _solve_milp(
        G, cost, bound, state["lower"], 0.9 * (deadline - time.perf_counter())
    )
    if chosen is not None:
        offer(G[chosen])
    # every better partition is among the enumerated columns: the MILP's bound there bounds the problem
    state["lower"] = max(state["lower"], min(state["best"], val if proven else dual))
    return done("optimal" if proven else "time limit")
