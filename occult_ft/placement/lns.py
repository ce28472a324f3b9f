"""Large-neighbourhood search over device pairs: re-solve two devices exactly at a time.

A move frees f experts of device a and f of device b (all of them when E/D <= `MAX_FREE`, else the f of
each most shared with the other device, drawn with a seeded chance) and puts back the best of all
C(2f, f) ways to split the 2f freed experts over the two devices, exactly: each way's loads come from the
tokens' freed experts (bit masks) and whether the experts kept on a or b already reach them. A way is
admissible when every device keeps the load bound (`LoadBound`, the same relative rule as the solver)
and the absolute cap; the best admissible way is taken when it lowers the objective (summed distinct
devices per token). A single swap is the case f = 1, so a pass of this search with f = E/D is a pass of
`search`'s swaps and much more.

`improve_pairs` sweeps the device pairs (most shared tokens first, then seeded order) until a sweep
finds nothing (with all experts freed, a local optimum of the neighbourhood) or the deadline passes.
It never makes the placement worse.

Shape legend: U distinct token sets, E experts, D devices, P distinct (mask, reach a, reach b) patterns,
W ways to split.
"""

from __future__ import annotations

import time
from functools import lru_cache
from itertools import combinations

import numpy as np

from .columns import LoadBound, TokenSets

__all__ = ["MAX_FREE", "improve_pairs", "pair_move"]

MAX_FREE = 8  # experts freed per device of a pair: C(16, 8) = 12870 ways to split, evaluated at once


@lru_cache(maxsize=16)
def _splits(f: int) -> np.ndarray:
    """(W,) int64 bit masks over 2f bits with f bits set: the experts that go to the first device (the
    set is closed under complement, so both devices' choices are in it)."""
    # each combination of f bit positions out of 2f is one way: C(2f, f) masks
    return np.array([sum(1 << i for i in c) for c in combinations(range(2 * f), f)], dtype=np.int64)


def _hits(mask_P: np.ndarray, ways_W: np.ndarray) -> np.ndarray:
    """(W, P) bool: way w meets pattern p's freed experts."""
    # bit i of a way = freed expert i goes to the first device; & with a pattern's mask: any of them there
    return (ways_W[:, None] & mask_P[None, :]) != 0


def pair_move(
    sets: TokenSets,
    dev_E: np.ndarray,
    loads_D: np.ndarray,
    a: int,
    b: int,
    free_a: np.ndarray,
    free_b: np.ndarray,
    bound: LoadBound | None,
    max_load: float,
) -> tuple[float, np.ndarray, np.ndarray] | None:
    """The best admissible split of free_a + free_b over devices a and b.

    Args:
        dev_E: (E,) device of each expert; loads_D: (D,) current loads (tokens reaching each device).
        free_a / free_b: equally many experts of a and of b.
        bound: relative load bound over all D devices (offset = the other devices), or None.
    Returns:
        (objective change < 0, new dev_E, new loads_D) for the best improving split, else None.
    """
    X, w = sets.X, sets.w
    # freed[:f] came from a, freed[f:] from b: bit i of every mask below means freed[i]
    freed = np.concatenate([free_a, free_b])
    f = len(free_a)
    kept_a, kept_b = dev_E == a, dev_E == b
    kept_a[free_a], kept_b[free_b] = False, False
    # (U,) whether each set already reaches a / b through the experts that stay there
    reach_a, reach_b = X[:, kept_a].any(axis=1), X[:, kept_b].any(axis=1)
    # (U,) the set's freed experts as a bit mask: bit i = freed[i] (2f <= 16 bits, int64 is ample)
    bits = X[:, freed].astype(np.int64) @ (np.int64(1) << np.arange(2 * f, dtype=np.int64))
    # what a and b carry whatever the split: the tokens of their kept experts
    base_a, base_b = float(w @ reach_a), float(w @ reach_b)
    live = bits != 0  # a set holding no freed expert loads a and b the same under every way
    # sets with the same (mask, reach a, reach b) load the devices alike: merged into P patterns
    key = np.stack([bits[live], reach_a[live], reach_b[live]], axis=1)  # type: ignore[index]
    pats, inv = np.unique(key, axis=0, return_inverse=True)
    # wp: summed token count of each pattern (sets merged by np.unique, weights summed by bincount)
    wp = np.bincount(inv.ravel(), weights=w[live], minlength=len(pats))
    mask, ra, rb = pats[:, 0], pats[:, 1].astype(bool), pats[:, 2].astype(bool)
    ways = _splits(f)
    full = (1 << (2 * f)) - 1  # all 2f bits: full ^ way is the experts that go to b
    # (W,) a's load under each way: the kept experts' tokens plus the patterns a way's experts newly reach
    # a pattern already reaching a (ra) adds nothing to a: only the others count, once per pattern
    load_a = base_a + _hits(mask, ways) @ (wp * ~ra)
    load_b = base_b + _hits(mask, full ^ ways) @ (wp * ~rb)
    # the other devices keep their loads: they enter the bound's max and mean unchanged
    others = np.delete(loads_D, [a, b])
    total = others.sum() + load_a + load_b  # (W,) summed load: the mean the bound is relative to
    top = np.maximum(np.maximum(load_a, load_b), others.max(initial=0.0))
    ok = top <= max_load + 1e-9
    if bound is not None:
        ok &= top <= bound.beta * total / bound.num_devices * (1 + 1e-9) + 1e-9
    change = load_a + load_b - loads_D[a] - loads_D[b]  # the objective moves only on devices a and b
    change[~ok] = np.inf
    best = int(np.argmin(change))
    if not change[best] < -0.5:  # token counts: an improvement is at least 1 (also rejects inf)
        return None
    new = dev_E.copy()
    to_a = (ways[best] >> np.arange(2 * f)) & 1  # (2f,) the way's bits back to one flag per freed expert
    new[freed[to_a == 1]], new[freed[to_a == 0]] = a, b
    new_loads = loads_D.astype(np.float64).copy()
    new_loads[a], new_loads[b] = load_a[best], load_b[best]
    return float(change[best]), new, new_loads


def _loads(sets: TokenSets, dev_E: np.ndarray, num_devices: int) -> np.ndarray:
    onehot = np.eye(num_devices, dtype=np.float32)[dev_E]  # (E, D)
    return sets.w @ ((sets.Xf @ onehot) > 0.5)  # (D,) tokens reaching each device


def improve_pairs(
    sets: TokenSets,
    dev_E: np.ndarray,
    num_devices: int,
    *,
    bound: LoadBound | None = None,
    max_load: float = float("inf"),
    deadline: float = float("inf"),
    seed: int = 0,
    max_free: int = MAX_FREE,
) -> np.ndarray:
    """Pair moves until a sweep over all device pairs improves nothing or the deadline passes.

    Args:
        sets: token sets over all E experts; dev_E: (E,) the start (kept when nothing improves).
        bound: `LoadBound` over the D devices (offset 0), or None; max_load: absolute cap per device.
        max_free: experts freed per device; below E/D the freed ones are drawn per move (seeded), and the
            sweeps stop after one that improves nothing.
    Returns:
        (E,) the improved device of each expert.
    """
    rng = np.random.default_rng(seed)
    dev_E = np.asarray(dev_E).copy()
    per = len(dev_E) // num_devices
    f = min(per, max_free)
    loads = _loads(sets, dev_E, num_devices)
    while time.perf_counter() < deadline:
        # reach[u, d]: set u has an expert on device d under the current placement
        reach = (sets.Xf @ np.eye(num_devices, dtype=np.float32)[dev_E]) > 0.5
        shared = (reach * sets.w[:, None]).T @ reach  # tokens reaching both devices
        # pairs sharing the most tokens first (most to gain); the seeded draw orders ties
        pairs = sorted(combinations(range(num_devices), 2), key=lambda p: (-shared[p], rng.random()))
        improved = False
        for a, b in pairs:
            if time.perf_counter() > deadline:
                break
            # f experts of each device are freed; the pair move re-splits those 2f between a and b
            free_a, free_b = _pick(sets, dev_E, a, b, f, rng), _pick(sets, dev_E, b, a, f, rng)
            move = pair_move(sets, dev_E, loads, a, b, free_a, free_b, bound, max_load)
            if move is not None:
                # the move is taken at once: later pairs start from the improved placement and loads
                _, dev_E, loads = move
                improved = True
        if not improved:
            break
    return dev_E


def _pick(sets: TokenSets, dev_E: np.ndarray, a: int, b: int, f: int, rng) -> np.ndarray:
    """f experts of device a: all of them when a holds f, else drawn with weight 1 + tokens shared with b."""
    members = np.flatnonzero(dev_E == a)
    if len(members) == f:
        # a device of exactly f experts frees all of them: the pair is re-solved exactly
        return members
    # the sets that reach b: an expert of a sharing them is the one a move to b can save tokens on
    reach_b = sets.X[:, dev_E == b].any(axis=1)
    # 1 +: an expert sharing no token with b can still be drawn
    score = 1.0 + sets.w @ (sets.X[:, members] & reach_b[:, None])  # type: ignore[index]
    return np.sort(rng.choice(members, f, replace=False, p=score / score.sum()))
