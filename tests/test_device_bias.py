"""Device balancing without an auxiliary loss: the per-device selection bias of the pruned router
(`routing.rules.add_device_bias` / `update_device_bias`, `prune_topk(device_bias_D=...)`), its fit on
one batch (`fit_device_bias`, `fit_router_device_bias`, `device_bias_init="first_batch"`), its record in
the checkpoint (`OccultBlock.device_bias`, block version 3) and the trainer's update after each step.

The remote-code loader (stock `AutoModelForCausalLM(trust_remote_code=True)`) is checked on biased
checkpoints in tests/test_remote_code.py (cases `*-device-bias`).

Shape legend: T tokens, E experts, K top-k, D devices, L MoE layers.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from occult_ft.apply import apply_occult
from occult_ft.checkpoint import BLOCK_VERSION, CheckpointError, OccultBlock, model_block, save_pruned
from occult_ft.checkpoint.load import from_pretrained
from occult_ft.metrics import comm_complexity, contiguous_expert_device, devices_per_token
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.routing import (
    PruningConfig,
    add_device_bias,
    collect_routing,
    fit_device_bias,
    fit_router_device_bias,
    limit_topk,
    prune_topk,
    router_device_bias,
    set_recording,
    update_device_bias,
)
from occult_ft.trainer import OccultConfig


# ---- a slow, obviously correct reference (one token at a time) -------------------------------------
def biased_reference(scores_E, bias_D, dev_E, k, m, criterion="score", sim=None, nodes=1, max_nodes=None):
    """The bias ranks the devices a token keeps, never how many: take the unbiased top-k (it reaches C
    devices on N nodes); walk the top-k of score + bias of the expert's device (past it, the other experts
    in that order, only under a node budget), admitting a device while fewer than min(m, C) are admitted
    and its node is admitted or fewer than min(max_nodes, N) are. A token whose own experts all lie on
    admitted devices keeps them; otherwise `score` takes the unbiased top-k of the admitted experts and
    `similarity` replaces each own expert outside them (in descending score) by the most similar admitted
    expert not yet taken."""
    e_count, d_count = len(scores_E), int(max(dev_E)) + 1
    per_node = d_count // nodes
    own = sorted(range(e_count), key=lambda e: -scores_E[e])[:k]
    own_devices = {int(dev_E[e]) for e in own}
    cap = min(m, len(own_devices), (max_nodes or nodes) * per_node)
    own_nodes = len({d // per_node for d in own_devices})
    node_cap = nodes if max_nodes is None else min(max_nodes, own_nodes)  # no node budget: nodes are free
    biased = [float(s) + float(bias_D[int(d)]) for s, d in zip(scores_E, dev_E)]
    order = sorted(range(e_count), key=lambda e: -biased[e])
    admitted: list[int] = []
    for e in order if max_nodes is not None else order[:k]:
        d = int(dev_E[e])
        nodes_in = {a // per_node for a in admitted}
        if (
            len(admitted) < cap
            and d not in admitted
            and (d // per_node in nodes_in or len(nodes_in) < node_cap)
        ):
            admitted.append(d)
    if own_devices <= set(admitted):
        return sorted(own)
    allowed = [e for e in range(e_count) if int(dev_E[e]) in admitted]
    if criterion == "score":
        return sorted(sorted(allowed, key=lambda e: -scores_E[e])[:k])
    taken = {e for e in own if int(dev_E[e]) in admitted}
    out = []
    for e in own:
        if int(dev_E[e]) in admitted:
            out.append(e)
            continue
        best = max((a for a in allowed if a not in taken), key=lambda a: float(sim[e][a]))
        taken.add(best)
        out.append(best)
    return sorted(out)


def _ranked(scores, dev, bias, k):
    biased = add_device_bias(scores, dev, bias)
    return biased, biased.topk(k, dim=-1).indices


def test_add_device_bias_adds_each_device_value_to_its_experts():
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    dev = torch.tensor([1, 0, 1, 0])  # any equal-size mapping, not only contiguous blocks
    got = add_device_bias(scores, dev, torch.tensor([10.0, -1.0]))
    torch.testing.assert_close(got, torch.tensor([[-0.9, 10.2, -0.7, 10.4]]))


def test_a_bias_equal_on_every_device_selects_nothing_differently():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(64, 16, generator=g)
    dev = contiguous_expert_device(16, 4)
    ids = scores.topk(4, dim=-1).indices
    plain = limit_topk(scores, ids, dev, 4, 2, "score")
    biased = limit_topk(
        scores,
        ids,
        dev,
        4,
        2,
        "score",
        None,
        None,
        1,
        None,
        None,
        *_ranked(scores, dev, torch.full((4,), 0.37), 4),
    )
    assert torch.equal(plain.sort(dim=1).values, biased.sort(dim=1).values)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("criterion", ["score", "similarity"])
def test_biased_device_ranking_matches_the_reference(seed, criterion):
    g = torch.Generator().manual_seed(seed)
    e, k, d, m = 16, 4, 4, 2
    scores = torch.softmax(torch.randn(200, e, generator=g) * 2, dim=-1)
    sim = torch.rand(e, e, generator=g)
    dev = contiguous_expert_device(e, d)
    bias = torch.tensor([0.05, -0.02, 0.0, -0.03])
    ids = scores.topk(k, dim=-1).indices
    got = limit_topk(
        scores, ids, dev, d, m, criterion, sim, None, 1, None, None, *_ranked(scores, dev, bias, k)
    )
    want = [biased_reference(s.tolist(), bias, dev, k, m, criterion, sim) for s in scores]
    assert got.sort(dim=1).values.tolist() == want
    # the bias moved some tokens: the test is not the unbiased rule in disguise
    plain = limit_topk(scores, ids, dev, d, m, criterion, sim)
    assert not torch.equal(plain.sort(dim=1).values, got.sort(dim=1).values)


@pytest.mark.parametrize("max_devices, max_nodes", [(None, 1), (3, 1), (2, 2), (4, 1), (2, None)])
def test_biased_budgets_across_nodes_match_the_reference(max_devices, max_nodes):
    g = torch.Generator().manual_seed(5)
    e, k, d, nodes = 16, 4, 4, 2
    scores = torch.softmax(torch.randn(200, e, generator=g) * 2, dim=-1)
    dev = contiguous_expert_device(e, d)
    bias = torch.tensor([0.06, -0.04, 0.01, -0.03])
    ids = scores.topk(k, dim=-1).indices
    got = limit_topk(
        scores,
        ids,
        dev,
        d,
        max_devices,
        "score",
        None,
        None,
        nodes,
        max_nodes,
        None,
        *_ranked(scores, dev, bias, k),
    )
    m = max_devices or d
    want = [biased_reference(s.tolist(), bias, dev, k, m, "score", None, nodes, max_nodes) for s in scores]
    assert got.sort(dim=1).values.tolist() == want


def test_the_bias_never_adds_a_device():
    """Per token, however large the bias: under a device budget no more devices than the unbiased pruned
    routing reaches; under a node budget at most as many devices and nodes as the unbiased top-k reaches
    (within the budget); always k distinct experts."""
    g = torch.Generator().manual_seed(3)
    e, k, d, nodes = 32, 8, 8, 2
    scores = torch.softmax(torch.randn(500, e, generator=g) * 2, dim=-1)
    dev = contiguous_expert_device(e, d)
    node_of_E = dev // (d // nodes)
    bias = torch.randn(d, generator=g)  # large: it reorders most tokens' devices
    ids = scores.topk(k, dim=-1).indices
    own_devices, own_nodes = devices_per_token(ids, dev, d), devices_per_token(ids, node_of_E, nodes)
    for m, mn in [(2, None), (3, None), (4, 1), (None, 1), (3, 2)]:
        plain = limit_topk(scores, ids, dev, d, m, "score", None, None, nodes, mn)
        got = limit_topk(
            scores, ids, dev, d, m, "score", None, None, nodes, mn, None, *_ranked(scores, dev, bias, k)
        )
        assert (got.sort(dim=1).values.diff(dim=1) > 0).all()
        reached = devices_per_token(got, dev, d)
        if mn is None:
            assert (reached <= devices_per_token(plain, dev, d)).all()
        else:
            assert (reached <= own_devices.clamp(max=m or d)).all()
            assert (devices_per_token(got, node_of_E, nodes) <= own_nodes.clamp(max=mn)).all()
        assert not torch.equal(plain.sort(dim=1).values, got.sort(dim=1).values)


def test_ranking_arguments_go_together():
    scores = torch.rand(4, 8)
    ids = scores.topk(2, dim=-1).indices
    with pytest.raises(ValueError, match="ranked_scores_TE and ranked_ids_TK go together"):
        limit_topk(scores, ids, contiguous_expert_device(8, 4), 4, 2, "score", ranked_scores_TE=scores)


def test_update_moves_the_bias_against_the_load_and_centres_it():
    # loads (10, 2, 4, 4): mean 5 -> signs (-1, +1, +1, +1); bias 0 + 0.1 * signs = (-.1, .1, .1, .1),
    # mean 0.05 -> centred (-0.15, 0.05, 0.05, 0.05)
    new = update_device_bias(torch.zeros(4), torch.tensor([10.0, 2.0, 4.0, 4.0]), 0.1)
    torch.testing.assert_close(new, torch.tensor([-0.15, 0.05, 0.05, 0.05]))
    # a balanced layer keeps its bias; layers (rows) are independent
    bias_LD = torch.tensor([[0.2, -0.2], [0.0, 0.0]])
    new_LD = update_device_bias(bias_LD, torch.tensor([[3.0, 3.0], [5.0, 1.0]]), 0.01)
    torch.testing.assert_close(new_LD, torch.tensor([[0.2, -0.2], [-0.01, 0.01]]))
    torch.testing.assert_close(update_device_bias(bias_LD, torch.tensor([[9.0, 1.0]] * 2), 0.0), bias_LD)


def test_repeated_updates_balance_a_skewed_router_without_adding_devices():
    """Scores that prefer device 0's experts: the sign rule drives the max/mean load towards 1 by moving
    tokens off device 0, not by sending them to more devices."""
    g = torch.Generator().manual_seed(0)
    e, k, d, m = 16, 4, 4, 2
    dev = contiguous_expert_device(e, d)
    skew = torch.tensor([0.08] * 4 + [0.0] * 12)
    bias = torch.zeros(d)

    def route(bias):
        scores = torch.softmax(torch.randn(512, e, generator=g), dim=-1) + skew
        ids = scores.topk(k, dim=-1).indices
        new = limit_topk(
            scores, ids, dev, d, m, "score", None, None, 1, None, None, *_ranked(scores, dev, bias, k)
        )
        reached = torch.zeros(512, d).scatter_(1, dev[new], 1.0)
        load = reached.sum(dim=0)
        plain = limit_topk(scores, ids, dev, d, m, "score")
        return (
            load,
            float(load.max() / load.mean()),
            float(reached.sum(1).mean()),
            comm_complexity(plain, dev, d),
        )

    _, before, _, _ = route(bias)
    for _ in range(60):
        load, _, _, _ = route(bias)
        bias = update_device_bias(bias, load, 0.005)
    _, after, cx, plain_cx = route(bias)
    assert before > 1.4 and after < 1.1, (before, after)
    assert cx <= plain_cx + 1e-9
    assert bias[0] < bias[1:].min()  # the hot device is the one made less attractive


# ---- fitting the bias on one batch ---------------------------------------------------------------------
def _skewed_batch(seed: int, tokens: int = 2048):
    """(scores, ids, expert_device, loads_of, comm_of) of one layer whose scores prefer device 0's experts
    (and, less, device 2's), budget 2 of 4 devices; `loads_of` routes it under an (1, D) bias."""
    g = torch.Generator().manual_seed(seed)
    e, k, d, m = 16, 4, 4, 2
    dev = contiguous_expert_device(e, d)
    skew = torch.tensor([0.08] * 4 + [0.0] * 4 + [0.03] * 4 + [0.0] * 4)
    scores = torch.softmax(torch.randn(tokens, e, generator=g), dim=-1) + skew
    ids = scores.topk(k, dim=-1).indices

    def route(bias_LD):
        return limit_topk(
            scores, ids, dev, d, m, "score", None, None, 1, None, None, *_ranked(scores, dev, bias_LD[0], k)
        )

    def loads_of(bias_LD):
        reached = torch.zeros(tokens, d).scatter_(1, dev[route(bias_LD)], 1.0)
        return reached.sum(dim=0, keepdim=True)

    return route, loads_of, dev


def _imbalance(load_LD):
    return float(load_LD.max() / load_LD.mean())


def test_fitting_balances_a_skewed_batch_without_adding_devices():
    route, loads_of, dev = _skewed_batch(0)
    zeros = torch.zeros(1, 4)
    fitted = fit_device_bias(loads_of, zeros, rate=0.0007)
    before, after = _imbalance(loads_of(zeros)), _imbalance(loads_of(fitted))
    assert before > 1.4 and after < 1.02, (before, after)
    assert comm_complexity(route(fitted), dev, 4) <= comm_complexity(route(zeros), dev, 4) + 1e-9
    torch.testing.assert_close(fitted.sum(dim=-1), torch.zeros(1), atol=1e-6, rtol=0)  # centred
    assert fitted[0, 0] == fitted[0].min()  # the hot device is made the least attractive
    # what the fit buys on one batch holds on another batch of the same router
    _, other_loads_of, _ = _skewed_batch(1)
    assert _imbalance(other_loads_of(fitted)) < 1.05


def test_fitting_never_ends_less_even_than_its_start_and_calls_loads_a_fixed_number_of_times():
    calls = []
    route, loads_of, _ = _skewed_batch(2)

    def counted(bias_LD):
        calls.append(bias_LD.clone())
        return loads_of(bias_LD)

    # a start that is already the balance point (fitted before): the fit may only keep or improve it
    start = fit_device_bias(loads_of, torch.zeros(1, 4), rate=0.0007)
    refit = fit_device_bias(counted, start, rate=0.0007)
    assert _imbalance(loads_of(refit)) <= _imbalance(loads_of(start))
    assert len(calls) == 49  # FIT_ITERATIONS + 1, whatever the loads: collectives inside match up
    # layers are fitted independently: a balanced layer next to a skewed one stays where it is
    both = fit_device_bias(
        lambda b: torch.cat([loads_of(b[:1]), torch.full((1, 4), 7.0)]), torch.zeros(2, 4), 0.0007
    )
    torch.testing.assert_close(both[1], torch.zeros(4))


@pytest.mark.parametrize("rate", [0.0, -0.001])
def test_fitting_needs_a_positive_rate(rate):
    with pytest.raises(ValueError, match=f"rate={rate!r} must be > 0"):
        fit_device_bias(lambda b: torch.ones_like(b), torch.zeros(1, 4), rate)


def test_the_router_fit_sets_a_bias_that_balances_the_batch_it_saw():
    ids = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(5))
    model = apply_occult(
        _olmoe(), pruning=PruningConfig(4, 2, "score"), device_bias={i: torch.zeros(4) for i in (0, 1)}
    )
    set_recording(model, True)

    def imbalance_per_layer():
        with torch.no_grad():
            model(ids)
        out = {}
        for index, record in collect_routing(model).items():
            reached = torch.zeros(record.topk_ids.shape[0], 4).scatter_(1, record.topk_ids // 2, 1.0)
            out[index] = _imbalance(reached.sum(dim=0))
        return out

    before = imbalance_per_layer()
    fitted = fit_router_device_bias(model, lambda: model(ids), rate=0.001)
    after = imbalance_per_layer()
    assert set(fitted) == {0, 1} and all(v.abs().sum() > 0 for v in fitted.values())
    # layer 0 sees the same inputs whatever the bias: its fit is exact on this batch; layer 1's inputs
    # move with layer 0's routing, so it is only asked not to end much worse
    assert after[0] < before[0] and after[0] < 1.05, (before, after)
    assert after[1] < max(before[1], 1.1), (before, after)
    torch.testing.assert_close(router_device_bias(model)[0], fitted[0], atol=0, rtol=0)
    assert not any(hasattr(layer.router, "occult_capture") for layer in find_moe_layers(model))
    # a model whose routers hold no bias has nothing to fit (and runs no forward)
    plain = apply_occult(_olmoe(), pruning=PruningConfig(4, 2, "score"))
    assert fit_router_device_bias(plain, lambda: pytest.fail("no forward expected"), rate=0.001) == {}


# ---- the model-aware part: prune_topk on a real router -----------------------------------------------
def _olmoe(seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config("olmoe")).eval()


def test_prune_topk_ranks_devices_on_biased_scores_and_weights_from_the_unbiased_ones():
    model = _olmoe()
    layer = find_moe_layers(model)[0]
    router, arch = layer.router, layer.arch
    e, k, d = layer.num_experts, layer.top_k, 4
    hidden = torch.randn(300, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, weights, ids = router(hidden)
    dev = contiguous_expert_device(e, d)
    bias = torch.tensor([0.0, 0.06, -0.04, 0.0])
    pruning = PruningConfig(d, 2, "score")
    new_ids, new_w, changed = prune_topk(arch, router, logits, ids, weights, pruning, dev, device_bias_D=bias)
    probs = arch.probabilities(router, logits)
    want = [biased_reference(p.tolist(), bias, dev, k, 2) for p in probs]
    assert new_ids.sort(dim=1).values.tolist() == want
    assert changed.any()
    # gate weights: the model's own convention on the new selection, from the unbiased probabilities
    torch.testing.assert_close(new_w.float(), arch.gate_weights(router, logits, new_ids), atol=1e-6, rtol=0)
    # the unchanged tokens keep the router's weights exactly
    assert torch.equal(new_w[~changed], weights[~changed])


def test_the_router_applies_its_bias_only_under_a_budget():
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    biased = {0: torch.tensor([0.3, 0.0, 0.0, -0.3]), 1: torch.tensor([0.3, 0.0, 0.0, -0.3])}
    outs = {}
    for name, pruning, bias in [
        ("none", PruningConfig(4), None),
        ("none+bias", PruningConfig(4), biased),
        ("budget", PruningConfig(4, 2, "score"), None),
        ("budget+bias", PruningConfig(4, 2, "score"), biased),
    ]:
        model = apply_occult(_olmoe(), pruning=pruning, device_bias=bias)
        set_recording(model, True)
        with torch.no_grad():
            outs[name] = (model(ids).logits, collect_routing(model))
    torch.testing.assert_close(outs["none"][0], outs["none+bias"][0], atol=0, rtol=0)
    assert (outs["budget"][0] - outs["budget+bias"][0]).abs().max() > 1e-3
    # bias +0.3 on device 0, -0.3 on device 3: device 0 takes rows from device 3
    rows = {}
    for name in ("budget", "budget+bias"):
        record = outs[name][1][0]
        reached = torch.zeros(record.topk_ids.shape[0], 4).scatter_(1, record.topk_ids // 2, 1.0)
        rows[name] = reached.sum(dim=0)
    assert rows["budget+bias"][0] > rows["budget"][0] and rows["budget+bias"][3] < rows["budget"][3]


# ---- the checkpoint: block version 3 -----------------------------------------------------------------
def test_block_writes_and_reads_the_bias():
    block = OccultBlock.build(PruningConfig(4, 2, "score"), device_bias={1: torch.tensor([0.5, 0, 0, -0.5])})
    data = block.to_dict()
    assert data["version"] == BLOCK_VERSION >= 3 and data["device_bias"] == {"1": [0.5, 0.0, 0.0, -0.5]}
    again = OccultBlock.from_dict(json.loads(json.dumps(data)))
    assert again.device_bias == {1: (0.5, 0.0, 0.0, -0.5)} and again == block
    torch.testing.assert_close(again.device_bias_tensors()[1], torch.tensor([0.5, 0.0, 0.0, -0.5]))


def test_version_2_blocks_load_without_a_bias():
    data = OccultBlock.build(PruningConfig(4, 2, "score")).to_dict()
    data["version"] = 2
    block = OccultBlock.from_dict(data)
    assert block.version == 2 and block.device_bias is None and "device_bias" not in block.to_dict()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"device_bias": {"0": [0.1, 0.2]}}, r"device_bias of MoE layer 0 must be 4 finite numbers"),
        ({"device_bias": {"0": [0.1, 0.2, "x", 0]}}, "device_bias must map MoE layer indices to lists"),
        ({"device_bias": {"a": [0, 0, 0, 0]}}, "device_bias layer keys must be integers"),
        ({"device_bias": {"0": [0, 0, 0, 0]}, "max_devices_per_token": None}, "without a budget"),
    ],
)
def test_bad_bias_records_are_refused_in_one_line(change, message):
    data = {**OccultBlock.build(PruningConfig(4, 2, "score")).to_dict(), **change}
    with pytest.raises(CheckpointError, match=message):
        OccultBlock.from_dict(data, "ckpt/config.json")


def test_bias_is_saved_and_reloaded_with_identical_routing(tmp_path):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    pruning = PruningConfig(4, 2, "score")
    model = apply_occult(_olmoe(), pruning=pruning, device_bias={0: torch.zeros(4), 1: torch.zeros(4)})
    # the routers' bias moves after the block was recorded (as in training): the save takes the live one
    live = {0: torch.tensor([0.2, -0.1, 0.0, -0.1]), 1: torch.tensor([-0.3, 0.1, 0.1, 0.1])}
    for layer in find_moe_layers(model):
        layer.router.occult_device_bias.copy_(live[layer.index])
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "a")
    save_pruned(model, str(tmp_path / "b"))
    for path in (tmp_path / "a", tmp_path / "b"):
        config = json.loads((path / "config.json").read_text())
        assert config["occult"]["device_bias"] == {str(i): v.tolist() for i, v in live.items()}
        loaded = from_pretrained(str(path)).eval()
        assert {i: v.tolist() for i, v in router_device_bias(loaded).items()} == {
            i: v.tolist() for i, v in live.items()
        }
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, want, atol=1e-6, rtol=0)
        assert model_block(loaded).device_bias == {i: tuple(v.tolist()) for i, v in live.items()}


def test_a_biased_native_budget_is_saved_with_remote_code(tmp_path):
    """DeepSeek-V3 `device_topk_sum` is native (n_group/topk_group) without a bias; native fields cannot
    carry the bias, so the checkpoint routes through remote code instead."""
    from occult_ft.checkpoint import describe_checkpoint

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3")).eval()
    indices = [layer.index for layer in find_moe_layers(model)]
    pruning = PruningConfig(2, 1, "device_topk_sum")
    apply_occult(model, pruning=pruning, device_bias={i: torch.tensor([0.1, -0.1]) for i in indices})
    save_pruned(model, str(tmp_path))
    summary = describe_checkpoint(str(tmp_path))
    assert not summary.native_routing and summary.remote_code and summary.needs_occult_ft


# ---- configuration -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-0.001, float("nan"), float("inf"), True, "0.1"])
def test_device_bias_rate_is_validated(tmp_path, value):
    with pytest.raises(ValueError, match="device_bias_rate="):
        OccultConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", device_bias_rate=value)


@pytest.mark.parametrize(
    "value, message",
    [
        ("ones", "device_bias_init='ones' is unknown; choose one of zeros, first_batch"),
        ("first-batch", "device_bias_init='first-batch' is unknown \\(did you mean 'first_batch'\\?\\)"),
        (None, "device_bias_init=None must be a string"),
    ],
)
def test_device_bias_init_is_validated(tmp_path, value, message):
    with pytest.raises(ValueError, match=message):
        OccultConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", device_bias_init=value)


# ---- the trainer: the bias moves after each step and is saved --------------------------------------
def _embedded_trainer(tmp_path, rate, **overrides):
    from occult_ft.checkpoint.load import load_model_and_tokenizer
    from occult_ft.trainer import OccultTrainer
    from occult_ft.trainer.pipeline import load_run_dataset

    fields = dict(
        output_dir=str(tmp_path),
        model_name_or_path="embedded",
        seq_len=64,
        devices=4,
        placement="sequential",  # the embedded model's own order: its trained routers are skewed
        max_devices_per_token=2,
        criterion="score",
        balance_loss_coef=0.0,
        device_bias_rate=rate,
        learning_rate=0.0,  # the weights stay: whatever the routing does is the bias's doing
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=20,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    config = OccultConfig(**(fields | overrides))
    model, tokenizer = load_model_and_tokenizer("embedded")
    train_rows = load_run_dataset("embedded", None, tokenizer, config)
    eval_rows = load_run_dataset("embedded", None, tokenizer, config, evaluation=True)
    eval_rows = eval_rows.select(range(min(32, len(eval_rows))))
    return OccultTrainer(model, args=config, train_dataset=train_rows, eval_dataset=eval_rows)


@pytest.mark.slow
def test_training_with_device_bias_lowers_the_load_imbalance_and_saves_the_bias(tmp_path):
    trainer = _embedded_trainer(tmp_path / "run", rate=0.01)
    before = trainer.evaluate()["eval_load_imbalance"]
    trainer.train()
    after = trainer.evaluate()["eval_load_imbalance"]
    bias = router_device_bias(trainer.model)
    assert set(bias) == {layer.index for layer in find_moe_layers(trainer.model)}
    # measured: 1.415 -> 1.333 in 20 steps (rate 0.01, the same 32 held-out rows before and after)
    assert before > 1.2 and after < before - 0.05, (before, after)
    # the hottest device of each layer ends with the lowest bias: the rule pushes rows away from it
    assert all(torch.allclose(v.sum(), torch.zeros(())) for v in bias.values())  # centred
    trainer.save_model(str(tmp_path / "out"))
    block = model_block(from_pretrained(str(tmp_path / "out")))
    assert block.device_bias == {i: tuple(v.tolist()) for i, v in bias.items()}


@pytest.mark.slow
def test_a_zero_rate_keeps_no_bias_and_the_routing(tmp_path):
    trainer = _embedded_trainer(tmp_path / "run", rate=0.0)
    before = trainer.evaluate()["eval_load_imbalance"]
    trainer.train()
    assert router_device_bias(trainer.model) is None
    assert trainer.evaluate()["eval_load_imbalance"] == pytest.approx(before, abs=1e-9)


@pytest.mark.slow
def test_a_bias_fitted_on_the_first_batch_starts_the_run_balanced(tmp_path):
    """One step without weight updates: from zeros the rule moves each device by u once; fitted on the
    first micro-batch, the held-out imbalance falls at once (measured 1.411 from zeros, 1.303 fitted)."""
    plain = _embedded_trainer(tmp_path / "zeros", rate=0.0007, max_steps=1)
    fitted = _embedded_trainer(tmp_path / "fit", rate=0.0007, max_steps=1, device_bias_init="first_batch")
    for trainer in (plain, fitted):
        trainer.train()
    zeros, fit = (t.evaluate() for t in (plain, fitted))
    assert fit["eval_load_imbalance"] < zeros["eval_load_imbalance"] - 0.05, (zeros, fit)
    assert fit["eval_comm_complexity"] <= zeros["eval_comm_complexity"] + 1e-6  # the bias never adds a device
    bias = router_device_bias(fitted.model)
    assert max(float(v.abs().max()) for v in bias.values()) > 0.01  # far past one step of u = 0.0007
    assert not fitted._fit_bias_pending  # fitted once per run


@pytest.mark.slow
def test_a_resumed_run_keeps_its_saved_bias(tmp_path):
    """`first_batch` fits before the first step of a run, never on resume: the bias saved at step 2 goes
    on from there, as in the uninterrupted run."""
    run = dict(rate=0.0007, device_bias_init="first_batch", save_strategy="steps", save_steps=2)
    whole = _embedded_trainer(tmp_path / "whole", max_steps=3, **run)
    whole.train()
    first = _embedded_trainer(tmp_path / "resumed", max_steps=2, **run)
    first.train()
    again = _embedded_trainer(tmp_path / "resumed", max_steps=3, **run)
    fits = []
    again._fit_device_bias = lambda *a, **k: fits.append(1)  # type: ignore[method-assign]
    again.train(resume_from_checkpoint=True)
    assert fits == []
    for index, value in router_device_bias(whole.model).items():
        torch.testing.assert_close(router_device_bias(again.model)[index], value, atol=1e-7, rtol=0)
