"""Set partitioning on HiGHS: one layer's (or a few devices') experts split into equal groups, to proven
optimality where the instance allows it, and always with a valid lower bound.

Sections of this file (the columns, their costs and pricing are `occult_ft.placement.columns`):
    the master problem        `_Pool` of columns, the LP relaxation and the exact MILP with the load-bound
                              rows (`_solve_lp`, `_solve_milp`)
    the search                `_column_generation`, `_dive`, and `_PartitionSearch`, the steps of
                              `solve_partition` (the formulation and the steps are on that class)

A column is a group g of s experts; its cost c_g = sum_S w_S [S meets g] counts the tokens that reach
the device holding g (that device's load). A partition's cost, sum_g c_g, is the objective: summed
distinct devices per token (comm_complexity times T). All costs are token counts (integers), so an
incumbent less than 1 above the bound is optimal.

Shape legend: U distinct token sets, m experts of the sub-problem, n groups of s experts (n s = m),
k columns in the pool; pi (m,) duals of the partition rows, rc(g) = c(g) - pi(g) a reduced cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .columns import EPS, LoadBound, TokenSets, greedy_groups, local_descent, price

__all__ = [
    "PartitionResult",
    "scipy_available",
    "solve_partition",
]


def scipy_available() -> bool:
    """True when scipy (HiGHS) can be imported: the `solver` extra (`pip install 'occult-ft[solver]'`)."""
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return False
    return True


# ---- tokens and column costs ----------------------------------------------------------------------
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


# ---- the master problem ----------------------------------------------------------------------------------
class _Pool:
    """The generated columns: G (k, m) bool and their costs, without duplicates."""

    def __init__(self, m: int, sets: TokenSets | None = None):
        self.G = np.zeros((0, m), bool)
        self.cost = np.zeros(0)
        self.keys: set[bytes] = set()
        # artificial costs: twice each expert's fair share of the tokens (a token's 1 split over its experts)
        share = np.ones(m) if sets is None else (sets.w / np.maximum(sets.X.sum(axis=1), 1)) @ sets.X
        # share (m,): each token's weight split equally over its experts, summed per expert (>= 1e-9)
        self.share = np.maximum(share, 1e-9)
        # art[e] = 2 max(share_e, 1); `_column_generation` raises it while the LP still uses the artificial
        self.art = 2.0 * np.maximum(share, 1.0)

    def add(self, sets: TokenSets, groups: list[np.ndarray]) -> int:
        new = []
        for g in groups:
            # packbits of the (m,) bool mask: a compact hashable key, so a duplicate column is never added twice
            key = np.packbits(g).tobytes()
            if key not in self.keys:
                self.keys.add(key)
                new.append(g)
        if new:
            self.G = np.vstack([self.G, np.array(new)])
            # only the new columns' costs are computed (cover is the expensive part)
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

    # columns of A_eq: the k groups (row e of column g = [e in g]) and then the m artificials (identity)
    k, m = G.shape
    A_eq = hstack([coo_array(G.T.astype(np.float64)), identity(m, format="coo")]).tocsr()
    c = np.concatenate([cost, art])
    # sum_g [e in g] x_g + a_e = 1 per expert e: the partition rows, relaxed to x >= 0
    res = linprog(c, A_eq=A_eq, b_eq=np.ones(m), bounds=(0, None), method="highs")
    if res.status != 0:
        return None
    # eqlin.marginals are the duals of the partition rows: pi (m,)
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
    # one more variable, z (the summed load), when there is a load bound
    nvar = k + (bound is not None)
    part = coo_array(G.T.astype(np.float64), shape=(m, k))
    # the partition rows widened to nvar columns (z has no entry there): each expert in exactly one group
    constraints = [LinearConstraint(coo_array((part.data, (part.row, part.col)), shape=(m, nvar)), 1, 1)]
    lo, hi = np.zeros(nvar), np.ones(nvar)
    if bound is not None:
        # z >= min_total: the devices outside the sub-problem need a total at least this large
        lo[k], hi[k] = bound.min_total(), np.inf
        z_row = np.zeros((1, nvar))
        # z - sum_g c_g x_g = 0 defines z
        z_row[0, :k], z_row[0, k] = -cost, 1.0
        constraints.append(LinearConstraint(z_row, 0, 0))
        # slope_g > 0 only for a column that can break the bound: D c_g / beta > offset + z_low
        slope = bound.num_devices * cost / bound.beta - bound.offset - z_low
        # one row per such column: z - slope_g x_g >= z_low, i.e. z >= D c_g / beta - offset when x_g = 1
        band = np.flatnonzero(slope > 1e-9)
        if len(band):
            r = np.arange(len(band))
            A = coo_array(
                (
                    np.concatenate([-slope[band], np.ones(len(band))]),
                    # row r has -slope at column band[r] and 1 at column k (z)
                    (np.concatenate([r, r]), np.concatenate([band, np.full(len(band), k)])),
                ),
                shape=(len(band), nvar),
            )
            constraints.append(LinearConstraint(A, z_low, np.inf))
    integrality = np.zeros(nvar)
    # x binary (0/1 through the bounds), z continuous
    integrality[:k] = 1
    c = np.concatenate([cost, np.zeros(nvar - k)])
    res = milp(
        c,
        constraints=constraints,
        integrality=integrality,
        bounds=Bounds(lo, hi),
        # HiGHS's default relative gap (1e-4) stops short of a proof: ask for 1e-9
        options={"time_limit": seconds, "mip_rel_gap": 1e-9, "disp": False},
    )
    dual = getattr(res, "mip_dual_bound", None)
    dual = float(dual) if dual is not None and np.isfinite(dual) else -np.inf
    if res.x is None:
        return None, np.inf, dual, False
    # x of 0/1 variables comes back as floats near 0 or 1
    chosen = np.flatnonzero(res.x[:k] > 0.5)
    return chosen, float(cost[chosen].sum()), dual, res.status == 0


# ---- the solve ------------------------------------------------------------------------------------------
def _to_groups(G: np.ndarray) -> list[list[int]]:
    return sorted(np.flatnonzero(g).tolist() for g in G)


def _random_group(rng: np.random.Generator, m: int, size: int) -> np.ndarray:
    g = np.zeros(m, bool)
    # a random group of `size` distinct experts (a pricing start when no column fits the cap)
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
    # the LP's basis columns, largest x first: descents from the groups the LP already leans on
    basis = np.flatnonzero(x > 1e-9)
    starts = [pool.G[inside[i]] for i in basis[np.argsort(-x[basis])][:8]]
    greedy = greedy_groups(sets, pi_price, 1.0, size, cap)
    # reduced cost of each greedy group at the pricing duals: the 8 cheapest become starts
    rc = np.array([sets.cover(g)[0] - pi_price[g].sum() for g in greedy])
    starts += [greedy[i] for i in np.argsort(rc)[:8]]
    found = [local_descent(sets, g, pi_price, 1.0, cap) for g in starts]
    # keep only what prices negative at the LP's own duals: only those columns can improve the LP
    return [g for g in found if sets.cover(g)[0] - pi_lp[g].sum() < -EPS]


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
    # groups of equal size: s = m / n
    size = sets.num_experts // num_groups
    center, center_lb_rc, best = None, -np.inf, -np.inf
    alpha, rounds = 0.5, 0
    lp = None
    while time.perf_counter() < deadline:
        solved = _pool_lp(sets, num_groups, pool, cap, rng)
        if solved is None:
            return None
        inside, (value, x, pi) = solved
        short = pool.G[inside].T.astype(np.float64) @ x < 1 - 1e-6  # experts left to an artificial
        lp = _LP(value, x, inside, pi, -np.inf, False, bool(short.any()))
        if short.any():
            pool.art[short] *= 4.0  # the artificial is still in use: let its dual rise
            pool.add(sets, _heuristic_columns(sets, pool, inside, x, pi, pi, size, cap))
            continue
        tol = max(1e-6, 1e-6 * value)  # relative (1e-6 of the LP value), at least 1e-6
        if value - best < tol:  # the Lagrangian bound meets the LP value: the LP is solved
            lp.converged = True
            break
        rounds += 1
        if center is None:  # degenerate LP duals are far from any good ones
            center = _cost_split(pool, inside, x)
        # Wentges smoothing: duals between the centre (best bound so far) and the LP's own
        smooth = alpha * center + (1.0 - alpha) * pi
        added = pool.add(sets, _heuristic_columns(sets, pool, inside, x, smooth, pi, size, cap))
        if added and rounds % 8:  # heuristic columns found: exact pricing only every 8th round
            continue
        # exact pricing at the smoothed duals: a bound, the centre, and a column if one prices negative
        budget = min(deadline, time.perf_counter() + 5.0)  # 5 s per exact pricing: the bound stays valid
        # threshold -tol/n: when no column prices below it, n min(0, rc) >= -tol, the bound within tol
        best_rc, groups, lb_rc, complete = price(
            sets, smooth, 1.0, size, cap, -tol / num_groups, deadline=budget
        )
        # the Lagrangian bound at the smoothed duals (lb_rc is a valid lower bound of min rc even when stopped)
        bound = float(smooth.sum()) + num_groups * min(0.0, lb_rc)
        if bound > best:
            best, center, center_lb_rc = bound, smooth.copy(), lb_rc
        # a column helps the LP only if it prices negative at the LP's own duals pi, not just the smoothed ones
        useful = [g for g in groups if sets.cover(g)[0] - pi[g].sum() < -EPS]
        if useful and pool.add(sets, useful):
            continue
        if not added:  # nothing prices negative at the LP duals from the smoothed ones: price at the LP's
            if alpha == 0.0 and complete:
                best, center, center_lb_rc = max(best, bound), smooth.copy(), lb_rc
                lp.converged = True
                break
            # price at the LP's duals from now on: a complete pricing there with nothing negative proves the LP
            alpha = 0.0
    if lp is not None and center is not None:
        lp.pi, lp.lb_rc = center, center_lb_rc
        lp.bound = best
    return lp


def _pool_lp(sets: TokenSets, num_groups: int, pool: _Pool, cap: float, rng):
    """The LP over the pool's columns within `cap` (costlier ones would break the load bound): (their
    indices in the pool, (value, x, pi)); None when no column fits, random groups included, or the LP
    has no solution."""
    inside = np.flatnonzero(pool.cost <= cap + 1e-9)
    if len(inside) == 0:  # no column fits: random groups to start from
        size = sets.num_experts // num_groups
        pool.add(sets, [_random_group(rng, sets.num_experts, size) for _ in range(8 * num_groups)])
        inside = np.flatnonzero(pool.cost <= cap + 1e-9)
    if len(inside) == 0:
        return None
    res = _solve_lp(pool.G[inside], pool.cost[inside], pool.art)
    return None if res is None else (inside, res)


def _cost_split(pool: _Pool, inside: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(m,) duals from the LP solution's own cost split: each used column's cost spread over its experts
    in proportion to their fair share (`pool.share`), summed per expert; the first stabilisation centre."""
    used = pool.G[inside] * x[:, None]  # (columns, m) how much of each expert each column covers
    weight = used * pool.share[None, :]
    return ((weight / np.maximum(weight.sum(axis=1, keepdims=True), 1e-30)) * pool.cost[inside][:, None]).sum(
        axis=0
    )


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
    # n - 1 groups are fixed one by one; the experts left form the last group
    for level in range(num_groups - 1):
        if lp is None or lp.artificial or time.perf_counter() > deadline:
            return None
        # the column the LP uses most (largest x) is fixed
        g = cur_pool.G[lp.inside[int(np.argmax(lp.x))]]
        full = np.zeros(m, bool)
        # g is over the experts left (`rest`): rest[g] maps back to the original expert ids
        full[rest[g]] = True
        chosen.append(full)
        rest = rest[~g]
        cur_sets = cur_sets.restrict(~g)
        removed = np.ones(m, bool)
        removed[rest] = False
        # a pool column survives when it holds none of the removed experts
        within = ~pool.G[:, removed].any(axis=1)  # the top pool's columns among the experts left
        cur_pool = _Pool(len(rest), cur_sets)
        cur_pool.add(cur_sets, list(pool.G[within][:, rest]))
        # after the last fixing only one group (`last`) is left: no LP for it
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
    """Split the m experts of `sets` into `num_groups` groups of m / num_groups at least summed cost
    (`_PartitionSearch` holds the formulation and the steps).

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
    m = sets.num_experts
    # one group, groups of one, or no tokens: every partition costs the same (`_single_cost`)
    if num_groups == 1 or m // num_groups == 1 or sets.X.shape[0] == 0:
        return _single_cost(sets, num_groups, bound, max_load)
    search = _PartitionSearch(sets, num_groups, bound=bound, max_load=max_load, seconds=seconds, seed=seed)
    return search.run(starts)


def _keeps(cost: np.ndarray, bound: LoadBound | None, max_load: float) -> bool:
    """Whether groups of these costs keep the absolute cap and the load bound."""
    return bool(cost.max(initial=0.0) <= max_load + 1e-9) and (bound is None or bound.keeps(cost))


def _single_cost(
    sets: TokenSets, num_groups: int, bound: LoadBound | None, max_load: float
) -> PartitionResult:
    """One group, groups of one expert, or no tokens: every partition costs the same (one group: each
    token once; singletons: each token |S| times; no tokens: 0), so any partition is optimal."""
    m = sets.num_experts
    # one group of all experts, or the identity (each expert its own group)
    G = np.ones((1, m), bool) if num_groups == 1 else np.eye(m, dtype=bool)
    cost = sets.cover(G)
    value = float(cost.sum())
    if _keeps(cost, bound, max_load):
        return PartitionResult(_to_groups(G), value, value, True, "optimal")
    return PartitionResult([], np.inf, value, False, "infeasible")


class _PartitionSearch:
    """The partition search of `solve_partition`: the incumbent (`G`, `best`), the proven lower bound
    (`lower`), the column pool, and the steps of `run`.

    The master problem over n groups (x_g = 1: group g is one device's experts):

        min  sum_g c_g x_g
        s.t. sum_{g containing e} x_g = 1                 every expert e                       (duals pi_e)
             z - sum_g c_g x_g = 0                         z: the summed load                    (dual mu)
             D c_g x_g - beta z <= beta offset             the load bound, rows for the columns
                                                           that can break it (`LoadBound`)
             c_g <= max_load                               columns above an absolute cap are left out
             x_g in {0, 1}

    `LoadBound` is max over all D devices of load <= beta * mean load: with `offset` (summed) and
    `other_max` (largest) loads of devices outside the sub-problem (both 0 for a whole layer) it reads
    c_g <= beta (offset + z) / D for the groups placed and other_max <= beta (offset + z) / D, a lower
    bound on z.

    The load bound enters through caps. An optimum z* has every group within beta (offset + z*) / D, at
    most the cap of the incumbent UB, so the LP over the columns within that cap bounds z* from below;
    and no partition of value below z exists when the LP within cap(z) is >= z (such a partition stays
    within cap(its value) <= cap(z)), which a bisection on z raises further.

    Steps (`run`), within the deadline:
      1. `_root`: column generation on the LP relaxation within the incumbent's cap (heuristic pricing,
         then exact pricing by `price`); its Lagrangian bound sum(pi) + n min(0, least rc) is valid at
         any iteration where the least rc has a valid lower bound; a dive on the LP gives an incumbent;
      2. `_milp_over_pool`: the exact MILP over the generated columns, another incumbent;
      3. `_raise_bound` (with a load bound only): the bisection on z above;
      4. `_fix_and_prove`: every column whose reduced cost is at most (incumbent - z_LP) is enumerated
         (reduced-cost fixing: no other column can be in a better solution) and the MILP over those
         proves the optimum (when their number fits `ENUMERATION_LIMIT` and HiGHS finishes in time).
    """

    def __init__(
        self,
        sets: TokenSets,
        num_groups: int,
        *,
        bound: LoadBound | None,
        max_load: float,
        seconds: float,
        seed: int,
    ):
        self.sets, self.num_groups, self.bound, self.max_load = sets, num_groups, bound, max_load
        self.m = sets.num_experts
        self.size = self.m // num_groups
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds
        # integer token counts: costs are integers, so a gap below 1 is closed
        self.integral = bool(np.all(sets.w == np.round(sets.w)))
        self.G: np.ndarray | None = None  # (n, m) bool: the incumbent
        self.best = np.inf  # its summed cost
        self.lower = sets.trivial_bound(self.size)
        if bound is not None:  # the devices outside the sub-problem alone force z this high
            self.lower = max(self.lower, bound.min_total())
        self.pool = _Pool(self.m, sets)
        self.rng = np.random.default_rng(seed)

    def run(self, starts: list[list[list[int]]]) -> PartitionResult:
        for groups in starts:
            # a start given as expert-id lists becomes an (n, m) incidence matrix
            G = np.zeros((self.num_groups, self.m), bool)
            for i, g in enumerate(groups):
                G[i, g] = True
            self.offer(G)
        if self.G is not None:  # the incumbent's columns seed the pool: the LP starts feasible
            self.pool.add(self.sets, list(self.G))
        top = self._root()
        if self.closed():
            return self.result("optimal")
        if top is None or time.perf_counter() > self.deadline:
            return self.result("time limit")
        self._milp_over_pool()
        if self.bound is not None:
            top = self._raise_bound()
        # reduced-cost fixing needs the LP's duals with a proven least reduced cost, and a second to run
        if (
            self.closed()
            or top is None
            or not np.isfinite(top.lb_rc)
            or time.perf_counter() > self.deadline - 1.0
        ):
            return self.result("time limit")
        return self._fix_and_prove(top)

    # -- incumbent and bounds
    def offer(self, G: np.ndarray | None) -> None:
        """Take the partition G (n, m) as the incumbent when it keeps the bounds and is cheaper."""
        if G is None or len(G) != self.num_groups:
            return
        # cost[g] = tokens reaching group g's device: the loads the bounds are checked on
        cost = self.sets.cover(G)
        if _keeps(cost, self.bound, self.max_load) and cost.sum() < self.best - 1e-9:
            self.G, self.best = G.copy(), float(cost.sum())

    def cap(self, z: float) -> float:
        """The largest group cost a partition of summed cost z may hold."""
        return min(self.max_load, self.bound.cap(z) if self.bound is not None else np.inf)

    def upper(self) -> float:
        if np.isfinite(self.best):
            return self.best
        # no incumbent yet: every token on each of min(|S|, n) groups is the most any partition costs
        # a token of |S| experts reaches at most min(|S|, n) groups
        return float(self.sets.w @ np.minimum(self.sets.X.sum(axis=1), self.num_groups))

    def closed(self) -> bool:
        gap = self.best - self.lower
        # integer costs: a gap below 1 is closed; otherwise a relative 1e-6
        return gap < (1.0 - 1e-6 if self.integral else 1e-6 * max(1.0, self.best))

    def result(self, status: str) -> PartitionResult:
        # the lower bound can exceed the incumbent only by rounding: report min
        best, lower = self.best, min(self.lower, self.best)
        if self.G is None:
            return PartitionResult([], np.inf, lower, False, "infeasible")
        if self.closed():
            return PartitionResult(_to_groups(self.G), best, best, True, "optimal")
        return PartitionResult(_to_groups(self.G), best, lower, False, status)

    # -- the steps
    def _lp_at(self, z: float) -> _LP | None:
        return _column_generation(self.sets, self.num_groups, self.pool, self.cap(z), self.rng, self.deadline)

    def _learn(self, lp: _LP | None) -> None:
        if lp is not None and np.isfinite(lp.bound):
            self.lower = max(self.lower, lp.bound)

    def _root(self) -> _LP | None:
        """Step 1: the LP within the incumbent's cap, its bound, and a dive on it."""
        # the LP within the incumbent's cap (or the largest cost any partition can reach, with no incumbent)
        top = self._lp_at(self.upper())
        self._learn(top)
        if top is not None and not self.closed():
            self.offer(
                _dive(
                    self.sets,
                    self.num_groups,
                    top,
                    self.pool,
                    self.cap(self.upper()),
                    self.rng,
                    self.deadline,
                )
            )
        return top

    def _milp_over_pool(self) -> bool:
        """Step 2: the exact MILP over the pool's columns within the incumbent's cap; True when proven."""
        # columns costlier than the incumbent's cap cannot be in a partition better than the incumbent
        inside = self.pool.cost <= self.cap(self.upper()) + 1e-9
        G, cost = self.pool.G[inside], self.pool.cost[inside]
        # 90% of the time left: the steps after it still get a slice
        chosen, _, _, proven = _solve_milp(
            G, cost, self.bound, self.lower, 0.9 * (self.deadline - time.perf_counter())
        )
        if chosen is not None:
            self.offer(G[chosen])
        return proven

    def _raise_bound(self) -> _LP | None:
        """Step 3: bisection for the largest z whose cap's LP is >= z (a lower bound of the optimum),
        diving on the LPs below; returns the LP within the incumbent's cap, priced again."""
        # bisection on z between the proven bound and the incumbent (or the largest possible cost)
        lo, hi = self.lower, self.upper()
        reserve = self.deadline - 0.3 * self.seconds  # 30% of the budget is kept for step 4
        while hi - lo > max(1.0, 1e-4 * hi) and not self.closed() and time.perf_counter() < reserve:
            # the LP within cap(mid) >= mid proves that no partition costs less than mid: raise lo, else lower hi
            mid = 0.5 * (lo + hi)
            got = self._lp_at(mid)
            if got is None or not np.isfinite(got.bound):
                break
            if got.bound >= mid:  # no partition costs less than mid
                lo = self.lower = max(self.lower, mid)
            else:
                hi = mid
                self.offer(
                    _dive(self.sets, self.num_groups, got, self.pool, self.cap(mid), self.rng, reserve)
                )
        top = self._lp_at(self.upper())
        self._learn(top)
        return top

    def _fix_and_prove(self, top: _LP) -> PartitionResult:
        """Step 4: reduced-cost fixing and the MILP over every column a better partition could use."""
        # a column of a better partition has rc <= best - z_LP - (n - 1) min(0, lb_rc): the other n - 1
        # columns each have rc >= lb_rc, and the n reduced costs sum to (its cost) - sum(pi)
        delta = self.best - float(top.pi.sum()) - (self.num_groups - 1) * min(0.0, top.lb_rc)
        _, enumerated, _, complete = price(
            self.sets,
            top.pi,
            1.0,
            self.size,
            self.cap(self.upper()),
            delta,
            collect=True,
            deadline=self.deadline,
        )
        if not complete:
            self._milp_over_pool()
            late = time.perf_counter() >= self.deadline
            return self.result("time limit" if late else "gap (too many columns to enumerate)")
        # each enumerated column is an (m,) mask: stacked to (k, m)
        G = np.array(enumerated).reshape(-1, self.m)
        # the incumbent's columns join, so the MILP is never worse than the incumbent
        if self.G is not None:
            G = np.vstack([G, self.G])
        # the costs of the enumerated columns and the incumbent's, the MILP's objective coefficients
        cost = self.sets.cover(G)
        chosen, val, dual, proven = _solve_milp(
            G, cost, self.bound, self.lower, 0.9 * (self.deadline - time.perf_counter())
        )
        if chosen is not None:
            self.offer(G[chosen])
        # every better partition is among the enumerated columns: the MILP's bound there bounds the problem
        self.lower = max(self.lower, min(self.best, val if proven else dual))
        return self.result("optimal" if proven else "time limit")
