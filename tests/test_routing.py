"""Collaboration pruning: criteria against slow references, budgets, kernels, gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from occult_ft.metrics import contiguous_expert_device, devices_per_token
from occult_ft.models import CORE_MODEL_TYPES, find_moe_layers, get_arch, tiny_config
from occult_ft.routing import (
    CRITERIA,
    PruningConfig,
    apply_pruning,
    collect_routing,
    fits_budget,
    limit_devices,
    limit_topk,
    remove_pruning,
    replace_by_similarity,
    router_selectable,
    set_recording,
)

# ---- slow, obviously correct references (one token at a time) -----------------------------------


def walk_score_reference(scores_E, k, dev_E, m):
    """The paper's wording: walk the top-k by descending score, admit devices until m are admitted,
    then top-k among experts on the admitted devices."""
    order = sorted(range(len(scores_E)), key=lambda e: -scores_E[e])[:k]
    admitted = []
    for e in order:
        d = int(dev_E[e])
        if d not in admitted and len(admitted) < m:
            admitted.append(d)
    allowed = [e for e in range(len(scores_E)) if int(dev_E[e]) in admitted]
    return sorted(sorted(allowed, key=lambda e: -scores_E[e])[:k])


def topk_sum_reference(scores_E, k, dev_E, num_devices, m):
    n = max(1, k // m)
    dev_score = []
    for d in range(num_devices):
        mine = sorted((scores_E[e] for e in range(len(scores_E)) if int(dev_E[e]) == d), reverse=True)
        dev_score.append(sum(mine[:n]))
    keep = sorted(range(num_devices), key=lambda d: -dev_score[d])[:m]
    allowed = [e for e in range(len(scores_E)) if int(dev_E[e]) in keep]
    return sorted(sorted(allowed, key=lambda e: -scores_E[e])[:k])


def similarity_reference(scores_E, topk, dev_E, m, sim, allowed_E=None):
    """Walk the selected top-k admitting devices; replace each selected expert outside them by the most
    similar admitted, unselected expert (one in an allowed group first, when `allowed_E` is given)."""
    chosen = sorted(topk, key=lambda e: -scores_E[e])
    admitted = []
    for e in chosen:
        d = int(dev_E[e])
        if d not in admitted and len(admitted) < m:
            admitted.append(d)
    allowed_E = allowed_E or [True] * len(scores_E)
    taken = {e for e in chosen if int(dev_E[e]) in admitted}
    out = []
    for e in chosen:
        if int(dev_E[e]) in admitted:
            out.append(e)
            continue
        cands = [f for f in range(len(scores_E)) if int(dev_E[f]) in admitted and f not in taken]
        best = max(cands, key=lambda f: (allowed_E[f], sim[e, f].item(), -f))
        taken.add(best)
        out.append(best)
    return sorted(out)


def group_walk_reference(scores_E, topk, k, dev_E, m, allowed_E):
    """`score` on a group-limited router: walk the router's own top-k, admit devices until m are
    admitted, then top-k among admitted experts in groups the router allowed (others only to fill up)."""
    admitted = []
    for e in sorted(topk, key=lambda e: -scores_E[e]):
        d = int(dev_E[e])
        if d not in admitted and len(admitted) < m:
            admitted.append(d)
    cands = [e for e in range(len(scores_E)) if int(dev_E[e]) in admitted]
    return sorted(sorted(cands, key=lambda e: (not allowed_E[e], -scores_E[e]))[:k])


def allowed_groups_reference(scores_E, n_group, topk_group, top2_sum):
    """The experts of the groups a DeepSeek router keeps for one token (V3: top-2 sum, V2: max)."""
    size = len(scores_E) // n_group
    groups = [sorted(scores_E[g * size : (g + 1) * size], reverse=True) for g in range(n_group)]
    group_score = [sum(g[:2]) if top2_sum else g[0] for g in groups]
    keep = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    return [e // size in keep for e in range(len(scores_E))]


@pytest.mark.parametrize("num_devices,m,k", [(4, 1, 2), (4, 2, 8), (8, 2, 8), (8, 3, 6)])
def test_score_criterion_matches_the_papers_walk(num_devices, m, k):
    torch.manual_seed(0)
    E = 32
    scores = torch.rand(200, E)
    dev = torch.randperm(E) // (E // num_devices)  # a non-contiguous placement
    ids, _ = limit_devices(scores, k, dev, num_devices, m, "max")
    for t in range(scores.shape[0]):
        assert sorted(ids[t].tolist()) == walk_score_reference(scores[t].tolist(), k, dev, m)


@pytest.mark.parametrize("num_devices,m,k", [(4, 2, 8), (8, 4, 8), (4, 1, 4)])
def test_topk_sum_criterion_matches_reference(num_devices, m, k):
    torch.manual_seed(1)
    E = 64
    scores = torch.rand(100, E)
    dev = contiguous_expert_device(E, num_devices)
    ids, _ = limit_devices(scores, k, dev, num_devices, m, "topk_sum")
    for t in range(scores.shape[0]):
        assert sorted(ids[t].tolist()) == topk_sum_reference(scores[t].tolist(), k, dev, num_devices, m)


def test_similarity_criterion_matches_reference():
    torch.manual_seed(2)
    E, k, D, m = 16, 4, 4, 2
    scores = torch.rand(150, E)
    sim = torch.rand(E, E)
    sim = (sim + sim.T) / 2
    dev = torch.randperm(E) // (E // D)
    topk = scores.topk(k, dim=-1).indices
    ids = replace_by_similarity(scores, topk, dev, D, m, sim)
    for t in range(scores.shape[0]):
        expected = similarity_reference(scores[t].tolist(), topk[t].tolist(), dev, m, sim)
        assert sorted(ids[t].tolist()) == expected


def _tiny(model_type, **kw):
    torch.manual_seed(0)
    cfg = tiny_config(model_type, **kw)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("model_type", list(CORE_MODEL_TYPES))
@pytest.mark.parametrize("criterion", CRITERIA)
def test_each_token_reaches_at_most_max_devices(model_type, criterion):
    model = _tiny(model_type)
    layers = find_moe_layers(model)
    E = layers[0].num_experts
    sim = {layer.index: torch.eye(E) + 0.01 * torch.rand(E, E) for layer in layers}
    apply_pruning(
        model, PruningConfig(num_devices=4, max_devices_per_token=1, criterion=criterion), similarity=sim
    )
    set_recording(model, True)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 16)))
    records = collect_routing(model)
    assert sorted(records) == [layer.index for layer in layers]
    dev = contiguous_expert_device(E, 4)
    for rec in records.values():
        assert devices_per_token(rec.topk_ids, dev, 4).max().item() == 1
        assert rec.topk_ids.shape[1] == layers[0].top_k


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v3", "gpt_oss"])
def test_pruning_works_under_every_experts_kernel_and_keeps_router_gradients(kernel, model_type):
    model = _tiny(model_type)
    model.set_experts_implementation(kernel)
    apply_pruning(model, PruningConfig(num_devices=4, max_devices_per_token=1))
    set_recording(model, True)
    x = torch.randint(0, 128, (2, 16))
    out = model(x, labels=x)
    out.loss.backward()
    for layer in find_moe_layers(model):
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    dev = contiguous_expert_device(8, 4)
    for rec in collect_routing(model).values():
        assert devices_per_token(rec.topk_ids, dev, 4).max().item() == 1


@pytest.mark.parametrize("criterion", ["score", "similarity", "device_max"])
def test_tokens_that_already_fit_keep_their_routing_and_weights(criterion):
    model = _tiny("olmoe", num_experts_per_tok=4)
    layers = find_moe_layers(model)
    layer = layers[0]
    h = torch.randn(400, 64)
    with torch.no_grad():
        logits, w0, ids0 = layer.router(h)
    sim = {i.index: torch.rand(8, 8) for i in layers}
    apply_pruning(model, PruningConfig(4, 2, criterion), similarity=sim)
    with torch.no_grad():
        _, w1, ids1 = layer.router(h)
    dev = contiguous_expert_device(8, 4)
    fits = devices_per_token(ids0, dev, 4) <= 2
    assert 0 < fits.sum() < len(fits)  # both kinds of token are present
    assert torch.equal(ids0[fits], ids1[fits]) and torch.equal(w0[fits], w1[fits])
    assert (devices_per_token(ids1, dev, 4) <= 2).all()
    assert not torch.equal(ids0[~fits].sort(-1).values, ids1[~fits].sort(-1).values)


GROUP_LIMITED = {  # 16 experts in 8 groups of 2, the router keeps 4 groups and picks top-4 inside
    "deepseek_v3": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=8, topk_group=4),
    "deepseek_v2": dict(
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=8,
        topk_group=4,
        topk_method="group_limited_greedy",
    ),
}


def _group_limited(model_type):
    model = _tiny(model_type, **GROUP_LIMITED[model_type])
    layers = find_moe_layers(model)
    if model_type == "deepseek_v3":  # a real correction bias: selection differs from the raw scores
        for layer in layers:
            layer.router.e_score_correction_bias.copy_(0.05 * torch.randn(16))
    return model, layers


@pytest.mark.parametrize("model_type", sorted(GROUP_LIMITED))
@pytest.mark.parametrize("criterion", ["score", "similarity", "device_max"])
@pytest.mark.parametrize("num_devices,m", [(8, 2), (4, 2), (4, 1)])
def test_group_limited_routers_prune_inside_their_own_selection(model_type, criterion, num_devices, m):
    model, layers = _group_limited(model_type)
    layer = layers[0]
    router, arch = layer.router, layer.arch
    # a placement that moves whole routing groups (as placement does for these routers): group g of
    # experts {2g, 2g+1} goes to slot perm[g], 16 / D experts per device
    perm = torch.randperm(8)
    dev = (perm.repeat_interleave(2) * 2 + torch.arange(16) % 2) // (16 // num_devices)
    h = torch.randn(400, 64)
    with torch.no_grad():
        logits, w0, ids0 = router(h)
    sim = torch.rand(16, 16)
    apply_pruning(
        model,
        PruningConfig(num_devices, m, criterion),
        similarity={x.index: sim for x in layers},
        expert_device={x.index: dev for x in layers},
    )
    with torch.no_grad():
        _, w1, ids1 = router(h)
    scores = arch.selection_scores(router, logits)
    fits = devices_per_token(ids0, dev, num_devices) <= m
    assert (~fits).any() and (
        fits.any() or m == 1
    )  # with m=1 a token fits only if its 2 groups share a device
    assert torch.equal(ids0[fits], ids1[fits]) and torch.equal(w0[fits], w1[fits])
    assert (devices_per_token(ids1, dev, num_devices) <= m).all()
    for t in (~fits).nonzero().flatten().tolist():
        s = scores[t].tolist()
        allowed = allowed_groups_reference(s, 8, 4, top2_sum=model_type == "deepseek_v3")
        assert all(allowed[e] for e in ids0[t].tolist())  # the reference reproduces the router's groups
        # every expert lies on a device that held one of the token's own selected experts
        assert {int(dev[e]) for e in ids1[t]} <= {int(dev[e]) for e in ids0[t]}
        if criterion == "similarity":
            expected = similarity_reference(s, ids0[t].tolist(), dev, m, sim, allowed)
        else:
            expected = group_walk_reference(s, ids0[t].tolist(), 4, dev, m, allowed)
        assert sorted(ids1[t].tolist()) == expected
        if (
            m >= 2
        ):  # each admitted device holds an allowed group (2 experts): 2 devices offer >= k = 4 of them
            assert all(allowed[e] for e in ids1[t].tolist())


def test_ranking_devices_by_their_best_expert_leaves_a_group_limited_selection():
    """Why the walk matters: DeepSeek-V3 with 8 groups on 8 devices, budget 2. Ranking devices by their
    best expert over all experts sends many pruned tokens to groups the router excluded."""
    model, layers = _group_limited("deepseek_v3")
    router, arch = layers[0].router, layers[0].arch
    with torch.no_grad():
        logits, _, ids = router(torch.randn(400, 64))
    scores = arch.selection_scores(router, logits)
    dev = contiguous_expert_device(16, 8)
    own_TD = torch.zeros(400, 8, dtype=torch.bool).scatter_(1, dev[ids], True)
    by_best, _ = limit_devices(scores, 4, dev, 8, 2, "max")
    walked = limit_topk(
        scores, ids, dev, 8, 2, "score", selectable_TE=router_selectable(arch, router, scores)
    )
    assert (~own_TD.gather(1, dev[by_best])).any(dim=1).sum() > 0
    assert not (~own_TD.gather(1, dev[walked])).any(dim=1).any()


def node_walk_reference(scores_E, topk, k, dev_E, m, per_node, mn):
    """The walk with a node budget: the token's top-k by score, then its other experts by score; a
    device is admitted while fewer than m are and its node is admitted or fewer than mn nodes are."""
    rest = [e for e in range(len(scores_E)) if e not in topk]
    order = sorted(topk, key=lambda e: -scores_E[e]) + sorted(rest, key=lambda e: -scores_E[e])
    admitted, nodes = [], set()
    for e in order:
        d = int(dev_E[e])
        if d in admitted or len(admitted) >= m:
            continue
        if d // per_node in nodes or len(nodes) < mn:
            admitted.append(d)
            nodes.add(d // per_node)
    allowed = [e for e in range(len(scores_E)) if int(dev_E[e]) in admitted]
    return sorted(sorted(allowed, key=lambda e: -scores_E[e])[:k])


def nodes_per_token(ids_TK, dev_E, per_node):
    return torch.tensor([len({int(dev_E[e]) // per_node for e in row}) for row in ids_TK.tolist()])


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("m,mn", [(None, 1), (None, 2), (2, 1), (3, 2), (4, 1)])
def test_node_budget_limits_nodes_and_devices(criterion, m, mn):
    # E=32 on D=8 devices (4 experts each) in N=4 nodes of 2 devices; top-4
    torch.manual_seed(4)
    E, D, N, k = 32, 8, 4, 4
    scores = torch.rand(300, E)
    topk = scores.topk(k, dim=-1).indices
    dev = torch.randperm(E) // (E // D)
    sim = torch.rand(E, E)
    ids = limit_topk(scores, topk, dev, D, m, criterion, sim, num_nodes=N, max_nodes=mn)
    assert (nodes_per_token(ids, dev, D // N) <= mn).all()
    assert (devices_per_token(ids, dev, D) <= (m or D)).all()
    fits = fits_budget(topk, dev, D, m, N, mn)
    assert 0 < fits.sum() < len(fits)
    if criterion != "device_topk_sum":
        assert torch.equal(ids[fits], topk[fits])
    if criterion in ("score", "device_max"):
        for t in (~fits).nonzero().flatten().tolist():
            expected = node_walk_reference(scores[t].tolist(), topk[t].tolist(), k, dev, m or D, D // N, mn)
            assert sorted(ids[t].tolist()) == expected


def test_node_budget_in_the_pruned_router_and_its_config():
    cfg = PruningConfig(num_devices=4, criterion="score", num_nodes=2, max_nodes_per_token=1)
    assert cfg.active and cfg.device_budget == 2
    assert cfg.to_dict()["max_nodes_per_token"] == 1 and cfg.to_dict()["num_nodes"] == 2
    assert not PruningConfig(4, num_nodes=2, max_nodes_per_token=2).active  # every node: no limit
    model = _tiny("qwen3_moe")
    apply_pruning(model, cfg)
    set_recording(model, True)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 16)))
    dev = contiguous_expert_device(8, 4)
    for rec in collect_routing(model).values():  # node 0 = devices 0, 1 = experts 0-3; node 1 = experts 4-7
        assert (nodes_per_token(rec.topk_ids, dev, 2) == 1).all()
    # 4 nodes of one device (2 experts each): one node cannot hold top-4 -> at least 2 nodes
    bad = PruningConfig(4, num_nodes=4, max_nodes_per_token=1)
    with pytest.raises(
        ValueError, match="max_nodes_per_token=1 holds only 2 experts .* use max_nodes_per_token >= 2"
    ):
        apply_pruning(_tiny("olmoe", num_experts_per_tok=4), bad)


def test_budget_of_all_devices_is_the_unpruned_model():
    model = _tiny("qwen2_moe")
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ref = model(x).logits
    apply_pruning(model, PruningConfig(num_devices=4, max_devices_per_token=4))
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)
    remove_pruning(model)
    assert not hasattr(find_moe_layers(model)[0].router, "occult_config")


@pytest.mark.parametrize("model_type", list(CORE_MODEL_TYPES))
def test_model_gate_weights_reproduce_the_router(model_type):
    model = _tiny(model_type)
    layer = find_moe_layers(model)[0]
    with torch.no_grad():
        logits, w, ids = layer.router(torch.randn(20, 64))
        again = get_arch(model).gate_weights(layer.router, logits, ids)
    torch.testing.assert_close(again.to(w.dtype), w)


def test_preserve_mass_keeps_each_tokens_weight_sum():
    model = _tiny("olmoe")  # olmoe does not renormalise top-k weights
    layer = find_moe_layers(model)[0]
    h = torch.randn(200, 64)
    with torch.no_grad():
        _, w0, _ = layer.router(h)
    apply_pruning(model, PruningConfig(4, 1, "score", gate_weights="preserve_mass"))
    with torch.no_grad():
        _, w1, _ = layer.router(h)
    torch.testing.assert_close(w1.sum(-1), w0.sum(-1))


def test_state_dict_names_do_not_change():
    model = _tiny("deepseek_v3")
    keys = set(model.state_dict())
    apply_pruning(model, PruningConfig(4, 2))
    assert set(model.state_dict()) == keys


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_devices=4, max_devices_per_token=0), "max_devices_per_token=0"),
        (dict(num_devices=4, max_devices_per_token=5), "max_devices_per_token=5"),
        (dict(num_devices=4, criterion="nope"), "criterion='nope'"),
        (dict(num_devices=4, gate_weights="x"), "gate_weights='x'"),
        (dict(num_devices=0), "devices=0"),
        (dict(num_devices=4, num_nodes=3), "nodes=3 does not divide devices=4"),
        (
            dict(num_devices=4, num_nodes=2, max_nodes_per_token=3),
            "max_nodes_per_token=3 must be between 1 and nodes=2",
        ),
        (dict(num_devices=4, max_devices_per_token=True), "max_devices_per_token=True"),
    ],
)
def test_bad_pruning_settings_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PruningConfig(**kwargs)


def test_budget_too_small_for_top_k_is_a_clear_error():
    model = _tiny("olmoe", num_experts=8, num_experts_per_tok=4)
    with pytest.raises(ValueError, match="max_devices_per_token=1 holds only 1 experts"):
        apply_pruning(model, PruningConfig(num_devices=8, max_devices_per_token=1))


def test_devices_must_divide_experts():
    model = _tiny("olmoe")
    with pytest.raises(ValueError, match="devices=3 does not divide the 8 experts"):
        apply_pruning(model, PruningConfig(num_devices=3, max_devices_per_token=1))


def test_similarity_without_table_is_a_clear_error():
    model = _tiny("olmoe")
    with pytest.raises(ValueError, match="similarity table"):
        apply_pruning(model, PruningConfig(4, 1, "similarity"))
