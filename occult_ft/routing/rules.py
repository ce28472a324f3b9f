"""The pruning criteria as pure tensor functions (no model, no router): what `occult_ft.routing` applies.

`limit_topk` applies one criterion to a router's selection: it keeps tokens that fit the budget,
admits devices by walking each other token's selected top-k (`walk_admitted_devices`, with an optional
node budget), then re-selects (`score`, `device_max`) or replaces by similarity (`similarity`);
`device_topk_sum` ranks devices (and nodes) by their top-n score sums for every token. The rules and
their reasons are described in docs/pruning.md.

Device balancing without an auxiliary loss (DeepSeek-V3's expert bias, Sec. 2.1.2, applied per device):
`add_device_bias` adds a per-device bias to the selection scores, `update_device_bias` moves it after
each optimizer step by `rate * sign(mean load - load)`, so an overloaded device becomes less attractive;
`fit_device_bias` runs the same rule on one batch's routing, with a shrinking step, to start a run balanced.
The biased scores only rank devices (`limit_topk`'s `ranked_scores_TE`): a token keeps at most as many
devices as its own top-k reaches, and its experts and gate weights come from the unbiased scores.

No function here reads a device value on the host (no `.any()`, `.item()`, `nonzero()` or boolean-mask
indexing): every token runs every step of a walk (fixed K iterations, finished tokens masked), and the
result is selected per token with `torch.where`, so the pruned router adds no host synchronisation to
a forward (a GPU keeps queueing kernels) and its results are the same bits as an early-exit loop's. `check_pruning_settings` is the one validation of
the pruning settings, shared by `PruningConfig` and `OccultConfig`.

Shape legend: T tokens, E experts, K top-k, D devices, N nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checks import check_nodes, choice_error, is_int

__all__ = [
    "CRITERIA",
    "add_device_bias",
    "fit_device_bias",
    "update_device_bias",
    "GATE_WEIGHT_POLICIES",
    "check_pruning_settings",
    "device_scores",
    "fits_budget",
    "limit_devices",
    "limit_topk",
    "replace_by_similarity",
    "walk_admitted_devices",
]

CRITERIA = ("score", "similarity", "device_max", "device_topk_sum")
GATE_WEIGHT_POLICIES = ("model", "preserve_mass")


def check_pruning_settings(
    num_devices,
    max_devices_per_token=None,
    criterion="score",
    gate_weights="model",
    num_nodes=1,
    max_nodes_per_token=None,
) -> None:
    """Raise a one-line ValueError for the first bad pruning setting (`PruningConfig` and `OccultConfig`).

    Args:
        num_devices: D, a positive integer. num_nodes: N, a positive divisor of D.
        max_devices_per_token: None or 1..D. max_nodes_per_token: None or 1..N.
        criterion: one of `CRITERIA`. gate_weights: one of `GATE_WEIGHT_POLICIES`.
    """
    if not is_int(num_devices) or num_devices < 1:
        raise ValueError(f"devices={num_devices!r} must be a positive integer, e.g. devices=4")
    if not is_int(num_nodes) or num_nodes < 1:
        raise ValueError(f"nodes={num_nodes!r} must be a positive integer, e.g. nodes=1")
    check_nodes(num_devices, num_nodes)
    m = max_devices_per_token
    if m is not None and (not is_int(m) or not 1 <= m <= num_devices):
        raise ValueError(
            f"max_devices_per_token={m!r} must be between 1 and devices={num_devices}; "
            "leave it unset (None) for no device budget"
        )
    n = max_nodes_per_token
    if n is not None and (not is_int(n) or not 1 <= n <= num_nodes):
        raise ValueError(
            f"max_nodes_per_token={n!r} must be between 1 and nodes={num_nodes}; "
            "leave it unset (None) for no node budget"
        )
    if criterion not in CRITERIA:
        raise choice_error("criterion", criterion, CRITERIA)
    if gate_weights not in GATE_WEIGHT_POLICIES:
        raise choice_error("gate_weights", gate_weights, GATE_WEIGHT_POLICIES)


# ---- pure routing maths ------------------------------------------------------------------------
def add_device_bias(
    scores_TE: torch.Tensor, expert_device_E: torch.Tensor, bias_D: torch.Tensor
) -> torch.Tensor:
    """(T, E) selection scores with the bias of each expert's device added (fp32).

    Every expert of device d gets bias_D[d], so a token's ranking of experts (its top-k) and of devices
    (the walk) shifts towards devices with a higher bias; a bias equal on all devices changes nothing."""
    # expert_device_E[e] is the device of expert e, so indexing bias_D with it gives the (E,) bias per expert;
    # fp32 so a bias of ~1e-3 is not lost against bf16 scores (bf16 keeps ~3 significant digits).
    bias_E = bias_D.to(scores_TE.device, torch.float32)[expert_device_E.to(scores_TE.device)]
    return scores_TE.float() + bias_E


def update_device_bias(bias_LD: torch.Tensor, load_LD: torch.Tensor, rate: float) -> torch.Tensor:
    """The bias after one optimizer step: bias_d + rate * sign(mean_load - load_d), per layer, centred.

    Args:
        bias_LD: (L, D) or (D,) current bias.
        load_LD: same shape, the rows each device received since the last update (any scale: only
            the sign of the difference to the layer's mean counts).
        rate: the step u (0 leaves the bias as it is).
    Returns:
        The new bias (fp32), each layer's mean subtracted: a shift shared by all devices selects
        nothing differently, so centring only keeps the values small and comparable."""
    load = load_LD.to(bias_LD.device, torch.float32)
    # sign() makes the step size independent of the load's scale: every device moves by exactly +-rate.
    step = torch.sign(load.mean(dim=-1, keepdim=True) - load)
    new = bias_LD.float() + rate * step
    return new - new.mean(dim=-1, keepdim=True)


FIT_ITERATIONS = 48
"""Rule steps `fit_device_bias` takes: the step shrinks by 2x every 8 of them, from 32 u down to u / 2."""


def fit_device_bias(
    loads_of: Callable[[torch.Tensor], torch.Tensor],
    bias_LD: torch.Tensor,
    rate: float,
    iterations: int = FIT_ITERATIONS,
) -> torch.Tensor:
    """The bias, per layer, under which one batch's routing is most even: `update_device_bias` iterated.

    Training moves the bias by `rate` once per optimizer step, so a run starting from zeros spends its
    first tens of steps unbalanced (docs/device-balance.md). This runs the same rule on one batch's
    routing before the first step, with a step shrinking geometrically from 32 * rate to rate / 2 (a sign
    rule with a fixed step circles the balance point at +-rate; a shrinking one closes in on it), and keeps
    for every layer the bias of the iteration with the lowest max / mean load (the start included, so the
    result is never less even than `bias_LD` on this batch).

    Args:
        loads_of: (L, D) bias -> (L, D) rows each device receives under it (summed over processes by the
            caller, so that every rank fits the same bias).
        bias_LD: (L, D) the start (zeros for a new run).
        rate: the training step u (> 0).
        iterations: rule steps.
    Returns:
        (L, D) fp32 bias, each layer centred.
    """
    if not rate > 0:
        raise ValueError(f"rate={rate!r} must be > 0 (the device_bias_rate the run trains with)")
    bias = bias_LD.float() - bias_LD.float().mean(dim=-1, keepdim=True)
    load = loads_of(bias).to(bias.device, torch.float32)
    best, best_imbalance = bias.clone(), _imbalance(load)
    # 32 u halved every 8 steps: 48 steps end at u / 2 (2 ** -(1 / 8) per step)
    step, shrink = 32.0 * rate, 2.0 ** (-1.0 / 8.0)
    for _ in range(iterations):
        bias = update_device_bias(bias, load, step)
        load = loads_of(bias).to(bias.device, torch.float32)
        imbalance = _imbalance(load)
        better = imbalance < best_imbalance  # per layer; strict, so ties keep the earlier (smaller) bias
        best = torch.where(better[:, None], bias, best)
        best_imbalance = torch.minimum(imbalance, best_imbalance)
        step *= shrink
    return best


def _imbalance(load_LD: torch.Tensor) -> torch.Tensor:
    """(L,) max / mean load per layer (1 for a layer that received nothing)."""
    mean = load_LD.mean(dim=-1)
    return torch.where(mean > 0, load_LD.max(dim=-1).values / mean.clamp_min(1e-12), torch.ones_like(mean))


def _grouped_by_device(x_TE: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int):
    """(T, D, E/D) view of per-expert values grouped by device, and the (E,) order used."""
    # stable argsort lists device 0's experts first, then device 1's, ... each in expert order, and every
    # device holds E/D experts, so after the gather column d*(E/D) + j is the j-th expert of device d.
    order_E = torch.argsort(expert_device_E, stable=True)
    return x_TE[:, order_E].reshape(x_TE.shape[0], num_devices, -1), order_E


def device_scores(
    scores_TE: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int, rank: str = "max", n: int = 1
) -> torch.Tensor:
    """(T, D) device ranking scores: best expert (`max`) or sum of the top-n experts (`topk_sum`)."""
    grouped_TDX, _ = _grouped_by_device(scores_TE, expert_device_E, num_devices)
    # grouped_TDX[t, d, j]: the score of device d's j-th expert for token t (X = E/D experts per device).
    if rank == "max":
        return grouped_TDX.max(dim=-1).values
    if rank == "topk_sum":
        # n may exceed E/D (a small device): clamp it so topk does not fail, i.e. sum all of the device's experts.
        return grouped_TDX.topk(min(n, grouped_TDX.shape[-1]), dim=-1).values.sum(dim=-1)
    raise ValueError(f"rank={rank!r}: use 'max' or 'topk_sum'")


def _admitted_expert_mask(device_mask_TD: torch.Tensor, expert_device_E: torch.Tensor) -> torch.Tensor:
    return device_mask_TD[:, expert_device_E.to(device_mask_TD.device)]


def _order_desc(primary_TE: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
    """(T, E) expert indices of each row sorted by `primary` (descending), ties by score (descending)."""
    # Two stable sorts = a lexicographic sort: first by score, then by primary; the second sort keeps the
    # score order among rows with equal primary, so ties on `primary` are broken by score.
    by_score = scores_TE.argsort(dim=1, descending=True, stable=True)
    by_primary = primary_TE.gather(1, by_score).argsort(dim=1, descending=True, stable=True)
    return by_score.gather(1, by_primary)


def limit_devices(
    scores_TE: torch.Tensor,
    top_k: int,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int,
    rank: str = "max",
    n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the best `max_devices` devices of each token, devices ranked over all experts.

    This is the DeepSeek rule on a plain top-k router (for `score`/`device_max` on a group-limited
    router use `limit_topk`, which walks the router's own selection).

    Args:
        rank: `max` (devices ranked by their best expert) or `topk_sum` (by the sum of their top `n`
            scores; default n = max(1, k // max_devices)).
    Returns:
        topk_ids_TK (long, sorted by descending score) and device_mask_TD (bool, admitted devices).
    """
    n = n or max(1, top_k // max_devices)
    # n defaults to k / max_devices: the number of experts each admitted device has to supply on average.
    dev_TD = device_scores(scores_TE, expert_device_E, num_devices, rank, n)
    # each token keeps its max_devices best devices by that ranking (topk over the D column scores)
    keep = dev_TD.topk(max_devices, dim=-1).indices
    # one-hot of the kept device indices: device_mask_TD[t, d] is True when d is among token t's best devices.
    device_mask_TD = torch.zeros_like(dev_TD, dtype=torch.bool).scatter_(1, keep, True)
    allowed_TE = _admitted_expert_mask(device_mask_TD, expert_device_E)
    # experts on other devices get -inf: topk reaches them only if the kept devices hold fewer than k experts.
    masked = scores_TE.masked_fill(~allowed_TE, float("-inf"))
    return masked.topk(top_k, dim=-1).indices, device_mask_TD


def fits_budget(
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int | None,
    num_nodes: int = 1,
    max_nodes: int | None = None,
) -> torch.Tensor:
    """(T,) bool: the token's experts already lie on <= max_devices devices and <= max_nodes nodes."""
    # dev_TK[t, j]: device of the token's j-th selected expert; scatter marks each device once, however many
    # of the token's experts it holds (the de-duplication rule: one copy per device).
    dev_TK = expert_device_E.to(topk_ids_TK.device)[topk_ids_TK]
    t = topk_ids_TK.shape[0]
    on_TD = torch.zeros(t, num_devices, dtype=torch.bool, device=dev_TK.device).scatter_(1, dev_TK, True)
    fits_T = on_TD.sum(dim=1) <= (max_devices or num_devices)
    if max_nodes is not None:
        # devices are numbered node-major (node n holds devices n*D/N .. (n+1)*D/N - 1), so a view groups them.
        on_TN = on_TD.view(t, num_nodes, num_devices // num_nodes).any(dim=2)
        fits_T &= on_TN.sum(dim=1) <= max_nodes
    return fits_T


def walk_admitted_devices(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int | None,
    num_nodes: int = 1,
    max_nodes: int | None = None,
    selectable_TE: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, D) bool: the devices the paper's walk admits for each token.

    The walk visits the token's selected experts (`topk_ids_TK`) in descending score, then its other
    experts (those the router could select first) in descending score, and admits an expert's device
    while fewer than `max_devices` devices are admitted and its node is admitted or fewer than
    `max_nodes` nodes are. It stops when min(max_devices, max_nodes * D / N) devices are admitted, which
    for a device budget alone happens inside the top-k of any token that does not fit.
    """
    return _admit(
        scores_TE,
        topk_ids_TK,
        expert_device_E,
        num_devices,
        max_devices,
        num_nodes,
        max_nodes,
        selectable_TE,
        True,
    )


def _admit(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int | None,
    num_nodes: int,
    max_nodes: int | None,
    selectable_TE: torch.Tensor | None,
    beyond_topk: bool,
    reached_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """`walk_admitted_devices`; `beyond_topk=False` skips the walk past the top-k, which admits nothing
    for a token that does not fit a device budget alone (its top-k already reaches the cap) and so cannot
    change what `limit_topk` or `replace_by_similarity` return for such a budget. With `reached_TK` (a
    selection, e.g. the unbiased one) every token admits at most as many devices and nodes as that
    selection reaches (`_reach_caps`)."""
    t = scores_TE.shape[0]
    dev_of_E = expert_device_E.to(scores_TE.device)
    # the walk stops adding devices once `cap` are admitted: the device budget, or all devices of the
    # max_nodes nodes the node budget allows, whichever is smaller.
    per_node = num_devices // num_nodes
    # no node budget = all N nodes allowed, so the node test below always passes
    mn = max_nodes or num_nodes
    cap = min(max_devices or num_devices, mn * per_node)
    caps = _reach_caps(reached_TK, dev_of_E, num_devices, num_nodes, cap, mn, max_nodes is not None, t)
    state = (
        torch.zeros(t, num_devices, dtype=torch.bool, device=scores_TE.device),  # admitted devices
        torch.zeros(t, num_nodes, dtype=torch.bool, device=scores_TE.device),  # admitted nodes
        torch.zeros(t, dtype=torch.long, device=scores_TE.device),  # admitted device count
        torch.zeros(t, dtype=torch.long, device=scores_TE.device),  # admitted node count
    )
    ids_TK = topk_ids_TK.long()
    # the router's top-k is not necessarily sorted: re-order each row by its experts' scores, best first,
    # so the walk admits devices in the order the paper's rule visits them.
    by_score_TK = ids_TK.gather(1, scores_TE.gather(1, ids_TK).argsort(dim=1, descending=True))
    # rows_R for the full walk: every token is a row (a sub-walk could pass a subset of tokens)
    rows = torch.arange(t, device=scores_TE.device)
    _walk(dev_of_E[by_score_TK], rows, state, caps, per_node)
    if (
        beyond_topk and t
    ):  # a node budget can leave room after the top-k: walk on (full rows at cap admit nothing)
        # rank 3/2/1 (below) + _order_desc sorts each row: selected experts, then selectable ones, then the
        # rest, each group by descending score; re-visiting the selected ones admits nothing new.
        rank_TE = torch.ones(t, scores_TE.shape[1], dtype=torch.long, device=scores_TE.device)
        if selectable_TE is not None:
            rank_TE = rank_TE + selectable_TE.long()
        rank_TE.scatter_(1, ids_TK, 3)  # selected (3) > selectable (2) > the rest (1)
        _walk(dev_of_E[_order_desc(rank_TE, scores_TE)], rows, state, caps, per_node)
    return state[0]


def _reach_caps(
    reached_TK: torch.Tensor | None,
    dev_of_E: torch.Tensor,
    num_devices: int,
    num_nodes: int,
    cap: int,
    mn: int,
    node_budget: bool,
    t: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) device and node caps of the walk: the budget's (`cap`, `mn`), lowered per token to the devices
    `reached_TK` reaches when given, and under a node budget to its nodes. (Without a node budget the node
    count is free: capping it would leave a walk of the top-k short of k experts.)"""
    device = dev_of_E.device
    cap_T = torch.full((t,), cap, dtype=torch.long, device=device)
    mn_T = torch.full((t,), mn, dtype=torch.long, device=device)
    if reached_TK is None:
        return cap_T, mn_T
    # on_TD[t, d]: token t's own (unbiased) top-k has an expert on device d
    on_TD = torch.zeros(t, num_devices, dtype=torch.bool, device=device)
    on_TD.scatter_(1, dev_of_E[reached_TK.long()], True)
    # devices are numbered node-major, so a (T, N, D/N) view groups each node's devices
    on_TN = on_TD.view(t, num_nodes, num_devices // num_nodes).any(dim=2)
    # the biased walk may choose *which* devices, never more of them than the token reaches unbiased:
    # that is what keeps comm_complexity from rising under the device bias
    cap_T = cap_T.clamp(max=on_TD.sum(dim=1))
    return cap_T, mn_T.clamp(max=on_TN.sum(dim=1)) if node_budget else mn_T


def _walk(walk_RJ: torch.Tensor, rows_R: torch.Tensor, state, caps, per_node: int) -> None:
    """Admit the devices `walk_RJ` visits (row r of token rows_R[r]) into `state`, in place.

    `caps` holds each token's (T,) device and node caps. Every column is visited (no early exit: that
    would read the device); a token at its cap admits nothing more, so the result is that of a walk that
    stops there."""
    device_mask_TD, node_mask_TN, n_dev_T, n_node_T = state
    cap_R, mn_R = caps[0][rows_R], caps[1][rows_R]
    for j in range(walk_RJ.shape[1]):
        # a token (row) can still admit a device while fewer than its cap of devices are admitted.
        open_R = n_dev_T[rows_R] < cap_R
        d_R = walk_RJ[:, j]
        # node of a device: devices are numbered node-major, per_node = D/N per node.
        node_R = d_R // per_node
        node_in_R = node_mask_TN[rows_R, node_R]
        # admit d if the token is open, d is new, and d's node is already admitted or a new node still fits.
        ok_R = open_R & ~device_mask_TD[rows_R, d_R] & (node_in_R | (n_node_T[rows_R] < mn_R))
        # rows_R holds each token once: the (token, device) pairs are distinct, so the writes are exact
        device_mask_TD.index_put_((rows_R, d_R), device_mask_TD[rows_R, d_R] | ok_R)
        node_mask_TN.index_put_((rows_R, node_R), node_in_R | ok_R)
        # bool ok_R counts as 0/1: one more admitted device, and one more node when the node was new.
        n_dev_T[rows_R] += ok_R
        n_node_T[rows_R] += ok_R & ~node_in_R


def _top_admitted(
    scores_TE: torch.Tensor,
    device_mask_TD: torch.Tensor,
    expert_device_E: torch.Tensor,
    top_k: int,
    selectable_TE: torch.Tensor | None,
) -> torch.Tensor:
    """Top-k among the admitted experts, those the router could select first (sorted by score)."""
    allowed_TE = _admitted_expert_mask(device_mask_TD, expert_device_E)
    preferred_TE = allowed_TE if selectable_TE is None else allowed_TE & selectable_TE
    # sort-free top-k: -inf outside the preferred experts; rows with < k preferred experts get -inf picks,
    # which the torch.where below replaces.
    ids_TK = scores_TE.masked_fill(~preferred_TE, float("-inf")).topk(top_k, dim=-1).indices
    # tokens with fewer than k preferred experts fill up with the other admitted ones
    short_T = preferred_TE.sum(dim=1) < top_k
    # rank 2 = admitted and preferred, 1 = admitted only, 0 = outside; ties broken by score.
    rank_TE = allowed_TE.long() + preferred_TE.long()
    return torch.where(short_T[:, None], _order_desc(rank_TE, scores_TE)[:, :top_k], ids_TK)


def _replace_outside(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    device_mask_TD: torch.Tensor,
    expert_device_E: torch.Tensor,
    similarity_EE: torch.Tensor,
    selectable_TE: torch.Tensor | None,
) -> torch.Tensor:
    """The similarity replacement on given admitted devices; slots come back in descending score order."""
    n_tok, k = topk_ids_TK.shape
    allowed_TE = _admitted_expert_mask(device_mask_TD, expert_device_E)
    preferred_TE = allowed_TE if selectable_TE is None else allowed_TE & selectable_TE
    # process slots best-first, so a better slot gets first pick of the similar experts.
    slot_scores = scores_TE.gather(1, topk_ids_TK)
    ids_TK = topk_ids_TK.gather(1, slot_scores.argsort(dim=1, descending=True)).clone()
    # ok_TK[t, j]: slot j's expert already lies on an admitted device and stays as it is.
    ok_TK = allowed_TE.gather(1, ids_TK)
    # taken_TE: experts already in the selection (kept slots), which a replacement must not duplicate;
    # scatter_add + "> 0" rather than scatter_ so a False never overwrites a True for a repeated id.
    taken_TE = torch.zeros(allowed_TE.shape, dtype=torch.long, device=ids_TK.device)
    taken_TE = taken_TE.scatter_add_(1, ids_TK, ok_TK.long()) > 0
    rows = torch.arange(n_tok, device=ids_TK.device)
    sim = similarity_EE.to(scores_TE.device, torch.float32)
    for j in range(k):  # every token, every slot; only slots outside the admitted devices change
        bad_T = ~ok_TK[:, j]
        # sim[e] is expert e's similarity row: the candidates for slot j are ranked by their likeness to it.
        row_sim = sim[ids_TK[:, j]]
        first = row_sim.masked_fill(~preferred_TE | taken_TE, float("-inf"))
        other = row_sim.masked_fill(~allowed_TE | taken_TE, float("-inf"))
        # prefer an expert the router could select; fall back to any admitted one when none is left.
        has_first = (preferred_TE & ~taken_TE).any(dim=-1)
        new_T = torch.where(has_first, first.argmax(dim=-1), other.argmax(dim=-1))
        ids_TK[:, j] = torch.where(bad_T, new_T, ids_TK[:, j])
        # mark the new expert taken only where the slot was replaced (bad_T), so later slots skip it.
        taken_TE.index_put_((rows, new_T), taken_TE[rows, new_T] | bad_T)
    return ids_TK


def replace_by_similarity(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int,
    similarity_EE: torch.Tensor,
    selectable_TE: torch.Tensor | None = None,
) -> torch.Tensor:
    """The paper's similarity criterion (docs/pruning.md); returns the new topk_ids_TK.

    Devices are admitted by walking `topk_ids_TK` (`walk_admitted_devices`). Slots are processed in
    descending score order; a slot whose expert sits outside the admitted devices takes the most similar
    admitted, not yet selected expert (one the router could select, when `selectable_TE` is given and
    such an expert is left).
    """
    device_mask_TD = _admit(
        scores_TE, topk_ids_TK, expert_device_E, num_devices, max_devices, 1, None, selectable_TE, False
    )
    return _replace_outside(
        scores_TE, topk_ids_TK, device_mask_TD, expert_device_E, similarity_EE, selectable_TE
    )


def _topk_sum_devices(
    scores_TE: torch.Tensor,
    top_k: int,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int | None,
    num_nodes: int,
    max_nodes: int | None,
    topn: int | None,
    ranked_TE: torch.Tensor,
) -> torch.Tensor:
    """`device_topk_sum` for every token: keep the best max_nodes nodes (then the best max_devices
    devices on them), nodes and devices ranked by the sum of their top-n `ranked_TE` scores; top-k of
    `scores_TE` inside."""
    dev_of_E = expert_device_E.to(scores_TE.device)
    per_node = num_devices // num_nodes
    m = max_devices or num_devices
    # each device is scored by its top-n experts: n defaults to k / max_devices, the share of the k picks
    # each admitted device has to supply.
    dev_TD = device_scores(ranked_TE, dev_of_E, num_devices, "topk_sum", topn or max(1, top_k // m))
    if max_nodes is not None and max_nodes < num_nodes:
        # nodes are ranked the same way, with each expert mapped to its node (device // D/N).
        node_TN = device_scores(
            ranked_TE, dev_of_E // per_node, num_nodes, "topk_sum", topn or max(1, top_k // max_nodes)
        )
        keep_nodes = node_TN.topk(max_nodes, dim=-1).indices
        node_mask_TN = torch.zeros_like(node_TN, dtype=torch.bool).scatter_(1, keep_nodes, True)
        # repeat_interleave expands the (T, N) node mask to (T, D): node n covers columns n*D/N .. (n+1)*D/N - 1.
        dev_TD = dev_TD.masked_fill(~node_mask_TN.repeat_interleave(per_node, dim=1), float("-inf"))
        # the node budget caps the devices too: max_nodes nodes hold at most max_nodes * D/N devices.
        m = min(m, max_nodes * per_node)
    # the m best devices left (those of unkept nodes are -inf, so they come last)
    keep = dev_TD.topk(m, dim=-1).indices
    device_mask_TD = torch.zeros_like(dev_TD, dtype=torch.bool).scatter_(1, keep, True)
    masked = scores_TE.masked_fill(~_admitted_expert_mask(device_mask_TD, dev_of_E), float("-inf"))
    return masked.topk(top_k, dim=-1).indices


def limit_topk(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int | None,
    criterion: str = "score",
    similarity_EE: torch.Tensor | None = None,
    selectable_TE: torch.Tensor | None = None,
    num_nodes: int = 1,
    max_nodes: int | None = None,
    topn: int | None = None,
    ranked_scores_TE: torch.Tensor | None = None,
    ranked_ids_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """One criterion applied to a router's selection: the pure core of `prune_topk`.

    Args:
        scores_TE: (T, E) selection scores (higher is better; top-k of them is the router's choice).
        topk_ids_TK: (T, K) the router's unpruned selection.
        expert_device_E: (E,) device of each expert; device d sits on node d // (D / num_nodes).
        max_devices / max_nodes: the budgets (None = no limit of that kind).
        criterion: one of `CRITERIA`; `similarity` needs `similarity_EE` (E, E).
        selectable_TE: optional (T, E) bool, the experts the model's router could select (its group
            mask, `router_selectable`); re-selection prefers them.
        topn: scores summed per device by `device_topk_sum` (default max(1, k // max_devices)).
        ranked_scores_TE / ranked_ids_TK: the device ranking, given together (the device-biased scores
            and their top-k, `add_device_bias`): the walk visits `ranked_ids_TK` in descending
            `ranked_scores_TE` and admits no more devices than `topk_ids_TK` reaches (under a node
            budget: nor nodes), within the budget; the experts are then chosen on `scores_TE` inside the admitted devices. Default: the
            walk of `topk_ids_TK` itself.
    Returns:
        (T, K) long: the new selection. Except under `device_topk_sum`, a token whose own experts all lie
        on admitted devices keeps `topk_ids_TK` exactly (without a ranking: the tokens that fit the
        budget); the others' experts lie on devices the walk admitted.
    """
    ids_TK = topk_ids_TK.long()
    k = ids_TK.shape[1]
    dev_of_E = expert_device_E.to(scores_TE.device)
    if (ranked_scores_TE is None) != (ranked_ids_TK is None):
        raise ValueError("ranked_scores_TE and ranked_ids_TK go together: give both or neither")
    ranked = ranked_scores_TE is not None
    walk_scores_TE = scores_TE if ranked_scores_TE is None else ranked_scores_TE
    walk_ids_TK = ids_TK if ranked_ids_TK is None else ranked_ids_TK.long()
    if criterion == "device_topk_sum":
        return _topk_sum_devices(
            scores_TE, k, dev_of_E, num_devices, max_devices, num_nodes, max_nodes, topn, walk_scores_TE
        )
    if criterion not in CRITERIA:
        raise choice_error("criterion", criterion, CRITERIA)
    if criterion == "similarity" and similarity_EE is None:
        raise ValueError(
            "criterion='similarity' needs an expert similarity table; profile the model first "
            "(occult-ft profile) or choose criterion='score'"
        )
    selectable = (
        None
        if selectable_TE is None
        else selectable_TE | torch.zeros_like(selectable_TE).scatter_(1, ids_TK, True)
    )  # the router's own choice is selectable whatever the mask says
    # every token is walked (no host read to pick the ones over budget). beyond_topk only with a node
    # budget: a device budget alone fills inside the top-k of a token over it (see `_admit`), and a
    # ranked walk's (biased) top-k always holds k experts on the devices it admits.
    device_mask_TD = _admit(
        walk_scores_TE,
        walk_ids_TK,
        dev_of_E,
        num_devices,
        max_devices,
        num_nodes,
        max_nodes,
        selectable,
        max_nodes is not None,
        ids_TK if ranked else None,
    )
    if criterion == "similarity":
        assert similarity_EE is not None  # refused above
        new = _replace_outside(scores_TE, ids_TK, device_mask_TD, dev_of_E, similarity_EE, selectable)
    else:
        new = _top_admitted(scores_TE, device_mask_TD, dev_of_E, k, selectable)
    # a token whose own experts were all admitted keeps the router's choice bit for bit (without a
    # ranking: exactly the tokens that fit the budget), the rest the pruned one.
    kept_T = _admitted_expert_mask(device_mask_TD, dev_of_E).gather(1, ids_TK).all(dim=1)
    return torch.where(kept_T[:, None], ids_TK, new)
