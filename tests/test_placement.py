"""Tests for occult_ft.placement: algorithms, the search guarantees, the placement file, weight permutation."""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from occult_ft.metrics import (
    comm_complexity,
    device_counts,
    devices_per_token,
    expert_device_from_groups,
    load_imbalance,
)
from occult_ft.models import CORE_MODEL_TYPES, find_moe_layers, tiny_config
from occult_ft.placement import (
    DEFAULT_ALGORITHM,
    PLACEMENT_ALGORITHMS,
    Placement,
    PlacementError,
    coactivation_matrix,
    compute_placement,
    merge_placements,
    permute_experts,
    place_layer,
    register_algorithm,
    sequential_placement,
    solve_layer,
)
from occult_ft.placement.algorithms import occult
from occult_ft.placement.columns import LoadBound, TokenSets, price
from occult_ft.placement.core import LayerResult, incidence, level_totals, two_level
from occult_ft.placement.layer import split_holdout
from occult_ft.placement.lns import pair_move
from occult_ft.placement.partition import solve_partition
from occult_ft.placement.pruned import admitted_devices, pruned_figures
from occult_ft.placement.search import SwapState, search


# ---- synthetic routings -----------------------------------------------------------------------------
def planted_routing(num_experts=64, num_groups=4, top_k=8, tokens=2048, inside=0.9, seed=0):
    """Tokens pick top_k experts, each expert of the token's hidden group boosted with probability `inside`
    (so ~90% of picks land in the group). Expert ids are shuffled: returns (topk_ids_TK, planted groups)."""
    gen = torch.Generator().manual_seed(seed)
    size = num_experts // num_groups
    group_T = torch.randint(num_groups, (tokens,), generator=gen)
    member_TE = (torch.arange(num_experts)[None, :] // size) == group_T[:, None]
    boost_TE = member_TE & (torch.rand(tokens, num_experts, generator=gen) < inside)
    score_TE = torch.rand(tokens, num_experts, generator=gen) + 2.0 * boost_TE
    perm_E = torch.randperm(num_experts, generator=gen)
    planted = {frozenset(perm_E[g * size : (g + 1) * size].tolist()) for g in range(num_groups)}
    return perm_E[score_TE.topk(top_k, dim=1).indices], planted


def random_routing(num_experts=64, top_k=8, tokens=2048, skew=0.0, seed=0):
    """Softmax-router-like top-k: logits N(0, 1) plus a per-expert popularity N(0, skew)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen) + skew * torch.randn(num_experts, generator=gen)
    return logits.topk(top_k, dim=1).indices


def cc(ids, groups, num_experts):
    return comm_complexity(ids, expert_device_from_groups(groups, num_experts), len(groups))


def imbalance(ids, groups, num_experts):
    return load_imbalance(ids, expert_device_from_groups(groups, num_experts), len(groups))


def assert_equal_partition(groups, num_experts, num_devices):
    assert len(groups) == num_devices
    assert all(len(g) == num_experts // num_devices and g == sorted(g) for g in groups)
    assert sorted(e for g in groups for e in g) == list(range(num_experts))


FAST = {"solver": dict(time_limit=5.0)}  # keeps the solver's share of the suite short


# ---- algorithms ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_experts,num_devices,expected",
    [
        (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (6, 3, [[0, 1], [2, 3], [4, 5]]),
        (4, 1, [[0, 1, 2, 3]]),
        (4, 4, [[0], [1], [2], [3]]),
    ],
)
def test_sequential_places_contiguous_blocks(num_experts, num_devices, expected):
    ids = random_routing(num_experts, top_k=2, tokens=64)
    assert place_layer(ids, num_experts, num_devices, "sequential") == expected


def test_registry_names_and_default():
    assert set(PLACEMENT_ALGORITHMS) == {"sequential", "occult", "greedy_pairs", "search", "solver"}
    assert DEFAULT_ALGORITHM == "solver"
    ids = random_routing(16, top_k=2, tokens=64)
    assert PLACEMENT_ALGORITHMS["occult"](ids, 16, 4) == place_layer(ids, 16, 4, "occult")


@pytest.mark.parametrize("algorithm", sorted(PLACEMENT_ALGORITHMS))
@pytest.mark.parametrize(
    "num_experts,num_devices,num_nodes,tokens",
    [
        (64, 4, 1, 512),
        (64, 8, 2, 512),
        (60, 6, 3, 512),
        (16, 1, 1, 64),
        (16, 16, 4, 64),
        (16, 4, 1, 0),
    ],
)
def test_every_algorithm_returns_a_partition_into_equal_groups(
    algorithm, num_experts, num_devices, num_nodes, tokens
):
    ids = random_routing(num_experts, top_k=4, tokens=tokens, skew=1.0)
    groups = place_layer(
        ids, num_experts, num_devices, algorithm, num_nodes=num_nodes, **FAST.get(algorithm, {})
    )
    assert_equal_partition(groups, num_experts, num_devices)


def test_coactivation_matrix_counts_pairs_and_load():
    ids = torch.tensor([[0, 1], [1, 2], [0, 1], [2, -1]])  # -1: empty slot
    # pairs: (0,1) twice, (1,2) once; loads: e0 2, e1 3, e2 2
    expected = torch.tensor([[2, 2, 0], [2, 3, 1], [0, 1, 2]])
    assert torch.equal(coactivation_matrix(ids, 3), expected)


@pytest.mark.parametrize("num_groups", [4, 8])
def test_search_recovers_planted_groups_and_beats_sequential(num_groups):
    ids, planted = planted_routing(num_groups=num_groups)
    groups = place_layer(ids, 64, num_groups, "search")
    assert {frozenset(g) for g in groups} == planted
    # ~90% of picks stay in the group: most tokens reach 1 device, the rest 2-3
    assert cc(ids, groups, 64) < 2.0
    assert cc(ids, place_layer(ids, 64, num_groups, "sequential"), 64) > 3.0


ROUTINGS = {
    "uniform": lambda: random_routing(64, top_k=8, tokens=2048),
    "skewed": lambda: random_routing(64, top_k=6, tokens=2048, skew=1.5, seed=1),
    "planted_noisy": lambda: planted_routing(num_groups=4, inside=0.35, seed=2)[0],
    "planted_small_groups": lambda: planted_routing(num_groups=16, top_k=4, inside=0.6, seed=3)[0],
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("num_devices", [4, 8])
def test_search_is_never_worse_than_the_constructive_algorithms(routing, num_devices):
    ids = ROUTINGS[routing]()
    placed = {alg: place_layer(ids, 64, num_devices, alg) for alg in PLACEMENT_ALGORITHMS if alg != "solver"}
    found = {alg: cc(ids, g, 64) for alg, g in placed.items()}
    # never worse than occult; never worse than any other start that respects the load bound
    bound = max(1.25, imbalance(ids, placed["occult"], 64))
    assert found["search"] <= found["occult"] + 1e-9
    for alg in ("greedy_pairs", "sequential"):
        if imbalance(ids, placed[alg], 64) <= bound:
            assert found["search"] <= found[alg] + 1e-9, alg
    assert imbalance(ids, placed["search"], 64) <= bound + 1e-9
    if routing == "uniform":  # no structure for the greedy starts to find: the swaps do the work
        assert found["search"] < min(found["occult"], found["greedy_pairs"]) - 0.02


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_search_keeps_the_automatic_load_bound_of_occult(routing):
    ids = ROUTINGS[routing]()
    occult = place_layer(ids, 64, 8, "occult")
    groups = place_layer(ids, 64, 8, "search")  # max_load_imbalance=None: max(1.25, occult's)
    assert imbalance(ids, groups, 64) <= max(1.25, imbalance(ids, occult, 64)) + 1e-9
    assert cc(ids, groups, 64) <= cc(ids, occult, 64)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_an_explicit_load_bound_is_kept_strictly_even_below_occults(routing):
    ids = ROUTINGS[routing]()
    occult = place_layer(ids, 64, 8, "occult")
    bound = 1.0 + 0.5 * (imbalance(ids, occult, 64) - 1.0)  # halfway between even and occult's load
    groups = place_layer(ids, 64, 8, "search", max_load_imbalance=bound)
    assert imbalance(ids, groups, 64) <= bound + 1e-9
    with pytest.raises(PlacementError, match="no placement found within max_load_imbalance=1.0: the lowest"):
        place_layer(ids, 64, 8, "search", max_load_imbalance=1.0)  # exactly even loads: out of reach here
    with pytest.raises(PlacementError, match="'occult' gives load imbalance .* > max_load_imbalance=1.01"):
        place_layer(ids, 64, 8, "occult", max_load_imbalance=1.01)  # constructive: checked, not optimised


def test_search_is_deterministic_for_a_seed():
    ids = random_routing(64, tokens=1024, skew=0.5)
    assert place_layer(ids, 64, 8, "search", seed=3) == place_layer(ids, 64, 8, "search", seed=3)


def test_swap_deltas_and_pair_gains_match_a_brute_force_recount():
    ids = random_routing(16, top_k=3, tokens=300, skew=1.0)
    x_TE, num_devices = incidence(ids, 16), 4
    state = SwapState(x_TE, torch.arange(16) // 4, num_devices)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        delta_EE, gain_EE = state.swap_deltas(bound=float("inf")), state.pair_gains()
        for a in range(16):
            for b in range(16):
                if state.dev_E[a] == state.dev_E[b]:
                    assert delta_EE[a, b] == float("inf")
                    continue
                dev = state.dev_E.clone()
                dev[a], dev[b] = dev[b].item(), dev[a].item()
                exact = devices_total(ids, dev, num_devices) - devices_total(ids, state.dev_E, num_devices)
                assert delta_EE[a, b] == exact
                assert gain_EE[a, b] == intra_pairs(ids, dev, num_devices) - intra_pairs(
                    ids, state.dev_E, num_devices
                )
        a, b = torch.randperm(16, generator=gen)[:2].tolist()
        if state.dev_E[a] != state.dev_E[b]:
            state.apply_swap(a, b)
        rebuilt = SwapState(x_TE, state.dev_E, num_devices)  # incremental bookkeeping == recomputation
        for name in ("count_TD", "xz_ED", "xo_ED", "a_EE", "xc_ED", "load_D"):
            assert torch.equal(getattr(state, name), getattr(rebuilt, name)), name


def devices_total(ids, dev_E, num_devices):
    return int(devices_per_token(ids, dev_E, num_devices).sum())


def intra_pairs(ids, dev_E, num_devices):
    counts = device_counts(ids, dev_E, num_devices)
    return int((counts * (counts - 1) // 2).sum())


def test_hierarchical_placement_keeps_each_node_on_consecutive_devices():
    ids, planted = planted_routing(num_groups=8, seed=4)
    nodes = place_layer(ids, 64, 2, "search")  # the node level alone: 2 groups of 32
    groups = place_layer(ids, 64, 8, "search", num_nodes=2)
    assert_equal_partition(groups, 64, 8)
    assert {frozenset(g) for g in groups} == planted
    node_E = expert_device_from_groups(groups, 64) // 4  # device d is on node d // (D/N)
    occult_node_E = expert_device_from_groups(place_layer(ids, 64, 8, "occult", num_nodes=2), 64) // 4
    assert comm_complexity(ids, node_E, 2) <= comm_complexity(ids, occult_node_E, 2)
    # the nodes-first candidate (node level = `nodes`) is no worse than occult at both levels here, so the
    # result is at least as good at the node level (here strictly: the devices-first candidate wins)
    assert comm_complexity(ids, node_E, 2) <= comm_complexity(ids, expert_device_from_groups(nodes, 64), 2)


# ---- validation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_devices=3), "devices=3 must divide the 64 experts; use one of [1, 2, 4, 8, 16, 32, 64]"),
        (dict(num_devices=0), "devices=0 must be a positive integer"),
        (dict(num_devices=8, num_nodes=3), "nodes=3 does not divide devices=8; use one of [1, 2, 4, 8]"),
        (
            dict(num_devices=8, algorithm="metis"),
            "unknown placement algorithm 'metis'; use one of greedy_pairs",
        ),
        (dict(num_devices=8, num_experts=32), "expert id"),
    ],
)
def test_invalid_requests_raise_one_line_placement_error(kwargs, message):
    ids = random_routing(64, tokens=32)
    kwargs = dict(dict(num_experts=64), **kwargs)
    with pytest.raises(PlacementError, match=re.escape(message)) as info:
        place_layer(ids, **kwargs)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def _wrong_type_calls():
    ids = random_routing(8, tokens=16)
    layer = SimpleNamespace(topk_ids=ids)
    return [
        (lambda: compute_placement({"not": "a profile"}, 4), r"profile is a dict \(\{'not': 'a profile'\}\) with no num_experts or layers; pass an occult_ft.profiling.Profile"),
        (lambda: compute_placement(None, 4), r"profile is a NoneType \(None\)"),
        (lambda: compute_placement(SimpleNamespace(num_experts="8", layers={0: layer}), 4), "profile.num_experts='8' must be a positive integer"),
        (lambda: compute_placement(SimpleNamespace(num_experts=8, layers=[layer]), 4), "profile.layers is a list; it must map layer index"),
        (lambda: compute_placement(SimpleNamespace(num_experts=8, layers={0: ids}), 4), r"profile.layers\[0\] has no topk_ids"),
        (lambda: compute_placement(SimpleNamespace(num_experts=8, layers={0: SimpleNamespace(topk_ids=ids.tolist())}), 4),
         r"profile.layers\[0\].topk_ids is a list .*; pass a \(tokens, top_k\) integer torch.Tensor"),
        (lambda: place_layer(ids.tolist(), 8, 4), "topk_ids_TK is a list"),
        (lambda: solve_layer(ids.float(), 8, 4), "topk_ids_TK is a 2-D torch.float32 tensor"),
        (lambda: PLACEMENT_ALGORITHMS["occult"].place(ids[:, 0], 8, 4), "topk_ids_TK is a 1-D torch.int64 tensor"),
        (lambda: place_layer(ids, "8", 4), "num_experts='8' must be a positive integer"),
        (lambda: coactivation_matrix(ids.tolist(), 8), "topk_ids_TK is a list"),
        (lambda: sequential_placement(8.0, 4, [0]), "num_experts=8.0 must be a positive integer"),
        (lambda: merge_placements(None), "merge_placements takes a list of Placements, not a NoneType"),
        (lambda: merge_placements([{"layers": {}}]), "part 0 is a dict"),
        (lambda: permute_experts(None, {"groups": {}}), "placement is a dict .*; pass a Placement"),
        (lambda: Placement.load({"format": "x"}), "Placement.load takes the path of a placement file, not a dict"),
    ]  # fmt: skip


def test_public_entry_points_name_an_argument_of_the_wrong_type_in_one_line():
    """Each public entry point of occult_ft.placement given the wrong kind of object (a dict for a profile,
    a list for a routing tensor, a float for a count) names the argument and what it must be, instead of
    an AttributeError or TypeError from deep inside."""
    for call, message in _wrong_type_calls():
        with pytest.raises(PlacementError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


# ---- the placement file -----------------------------------------------------------------------------------
def tiny_profile(num_experts=16, layers=(1, 3), tokens=256):
    return SimpleNamespace(
        model="tiny/olmoe",
        model_type="olmoe",
        num_experts=num_experts,
        top_k=4,
        layers={i: SimpleNamespace(topk_ids=random_routing(num_experts, 4, tokens, seed=i)) for i in layers},
    )


@pytest.mark.slow
def test_compute_placement_round_trips_through_json(tmp_path):
    placement = compute_placement(tiny_profile(), num_devices=4, num_nodes=2, time_limit=5.0)
    path = tmp_path / "placement.json"
    placement.save(path)
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], sorted(data["layers"])) == ("occult_ft.placement", 2, ["1", "3"])
    assert Placement.load(path) == placement
    assert placement.metrics["comm_complexity"] <= placement.metrics["comm_complexity_sequential"]
    for layer in (1, 3):
        order, device = placement.expert_order(layer), placement.expert_device(layer)
        assert torch.equal(device[order], torch.arange(16) // 4)  # new id j sits on device j // (E/D)


@pytest.mark.parametrize("budget", [{}, {"max_devices_per_token": 1, "criterion": "score"}])
def test_placing_shares_of_the_layers_and_merging_them_is_placing_them_all(budget):
    """What the trainer does over its processes (layer i on rank i % world): the same groups and per-layer
    figures, the overall figures recomputed over every layer."""
    profile = tiny_profile(layers=(0, 1, 3, 4, 6), tokens=1024)
    options = dict(
        num_devices=4, algorithm="search", holdout=0.5, bound_time_limit=0, **budget
    )  # no timed bound
    whole = compute_placement(profile, **options)
    shares = [
        compute_placement(profile, layers=[0, 3, 6], **options),
        compute_placement(profile, layers=[1, 4], **options),
    ]
    assert sorted(shares[1].groups) == [1, 4]
    merged = merge_placements(reversed(shares))
    assert merged.groups == whole.groups
    drop = ("seconds",)
    for layer, figures in whole.metrics["layers"].items():
        got = merged.metrics["layers"][layer]
        assert {k: v for k, v in got.items() if k not in drop} == {
            k: v for k, v in figures.items() if k not in drop
        }
    assert list(merged.metrics["layers"]) == ["0", "1", "3", "4", "6"]
    for key in ("comm_complexity", "comm_complexity_sequential", "load_imbalance", "held_out", "holdout"):
        assert merged.metrics[key] == pytest.approx(whole.metrics[key]), key
    assert merged.metrics.get("max_devices_per_token") == budget.get("max_devices_per_token")


def _place_on_ranks(rank, world):
    """The placement every rank applies, then what every rank sees when one rank's share fails."""
    from occult_ft.trainer.prepare import place_across_ranks

    profile = tiny_profile(layers=(0, 1, 2))
    placement = place_across_ranks(profile, 4, 1, "search", bound_time_limit=0)
    profile.layers[1].topk_ids[0, 0] = 99  # an expert id the model lacks: layer 1 is rank 1's share only
    try:
        place_across_ranks(profile, 4, 1, "search", bound_time_limit=0)
        failure = None
    except Exception as err:  # noqa: BLE001 - what each rank saw
        failure = f"{type(err).__name__}: {err}"
    return placement.groups, placement.metrics["comm_complexity"], failure


@pytest.mark.slow
def test_processes_place_a_share_of_the_layers_each_and_all_apply_the_same_placement():
    try:
        from .dist_utils import run_distributed
    except ImportError:
        from dist_utils import run_distributed

    whole = compute_placement(
        tiny_profile(layers=(0, 1, 2)), num_devices=4, algorithm="search", bound_time_limit=0
    )
    (groups0, cc0, failed0), (groups1, cc1, failed1) = run_distributed(_place_on_ranks, 2)
    assert groups0 == groups1 == whole.groups
    assert cc0 == cc1 == pytest.approx(whole.metrics["comm_complexity"])
    # rank 1's share failed: rank 0 raises the same error instead of waiting for a share that never comes
    assert failed0 == failed1 and failed0 is not None and "99" in failed0, (failed0, failed1)


def test_merge_placements_refuses_overlapping_or_mismatched_shares():
    profile = tiny_profile(layers=(0, 1))
    a = compute_placement(profile, num_devices=4, algorithm="occult", layers=[0])
    with pytest.raises(PlacementError, match=r"layers \[0\] are in two parts"):
        merge_placements([a, a])
    b = compute_placement(profile, num_devices=2, algorithm="occult", layers=[1])
    with pytest.raises(PlacementError, match="num_devices 2 != 4"):
        merge_placements([a, b])
    with pytest.raises(PlacementError, match=r"layers=\[2\]: place profiled layers"):
        compute_placement(profile, num_devices=4, algorithm="occult", layers=[2])
    with pytest.raises(PlacementError, match="at least one"):
        merge_placements([])


def test_sequential_placement_is_the_identity_order():
    placement = sequential_placement(8, 2, [0, 1], model_type="mixtral")
    assert placement.groups[1] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(placement.expert_order(0), torch.arange(8))


def _good_file():
    return json.loads(sequential_placement(8, 2, [0, 2], model="m", model_type="olmoe").to_json())


def _with(**changes):
    def make():
        data = _good_file()
        data.update(changes)
        return json.dumps(data)

    return make


def _with_layer(groups):
    return _with(layers={"0": groups, "2": [[0, 1, 2, 3], [4, 5, 6, 7]]})


BAD_FILES = {
    "invalid_json": (lambda: '{"format": "occult_ft.placement",', "not valid JSON at line 1"),
    "not_an_object": (lambda: "[1, 2]", "not an occult_ft placement file"),
    "wrong_format": (_with(format="something.else"), "format='something.else'"),
    "wrong_version": (_with(version=3), "placement version 3; this occult_ft reads versions 1, 2"),
    "missing_field": (
        lambda: json.dumps({k: v for k, v in _good_file().items() if k != "num_devices"}),
        "lacks the 'num_devices' field",
    ),
    "devices_not_dividing": (_with(num_devices=3), "devices=3 must divide the 8 experts"),
    "no_layers": (_with(layers={}), "no layers"),
    "bad_layer_key": (_with(layers={"mlp": [[0, 1, 2, 3], [4, 5, 6, 7]]}), "layer key 'mlp'"),
    "wrong_group_count": (_with_layer([[0, 1, 2, 3, 4, 5, 6, 7]]), "layer 0 has 1 device groups"),
    "unequal_groups": (_with_layer([[0, 1, 2], [3, 4, 5, 6, 7]]), "device 0 holds 3 experts"),
    "duplicate_expert": (_with_layer([[0, 1, 2, 3], [3, 4, 5, 6]]), "places expert 3 on two devices"),
    "id_out_of_range": (_with_layer([[0, 1, 2, 3], [4, 5, 6, 9]]), "expert id 9 outside 0..7"),
    "non_integer_id": (_with_layer([[0, 1, 2, 3], [4, 5, 6, "7"]]), "not a list of expert ids"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_load_rejects_bad_files_with_one_line(tmp_path, case):
    make, message = BAD_FILES[case]
    path = tmp_path / "placement.json"
    path.write_text(make())
    with pytest.raises(PlacementError, match=message) as info:
        Placement.load(path)
    assert "\n" not in str(info.value)


def test_load_reports_a_missing_file(tmp_path):
    with pytest.raises(PlacementError, match="placement file '.*nope.json' not found"):
        Placement.load(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "args,message",
    [
        ((8, [0, 2]), "placement was made for 64 experts, model has 8; re-run `occult-ft place`"),
        ((64, [0, 1]), r"placement covers MoE layers \[0, 2\], model has \[0, 1\]"),
        ((64, [0, 2], "mixtral"), "made for a olmoe model, this one is mixtral"),
    ],
)
def test_check_model_rejects_a_mismatched_model(args, message):
    placement = sequential_placement(64, 4, [0, 2], model_type="olmoe")
    placement.check_model(64, [2, 0], "olmoe")  # the matching model passes
    with pytest.raises(PlacementError, match=message):
        placement.check_model(*args)


# ---- permuting a model's weights ----------------------------------------------------------------------------
def tiny_model(model_type, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).float().eval()
    with torch.no_grad():  # random router tensors, correction bias included, so every one of them matters
        for layer in find_moe_layers(model):
            for name in layer.arch.router_params:
                getattr(layer.router, name).normal_(0.0, 0.5)
    return model


def shuffled_placement(model, num_devices, seed=0):
    layers = find_moe_layers(model)
    gen = torch.Generator().manual_seed(seed)
    num_experts = layers[0].num_experts
    groups = {}
    for layer in layers:
        perm = torch.randperm(num_experts, generator=gen).view(num_devices, -1)
        groups[layer.index] = [sorted(row) for row in perm.tolist()]
    return Placement(None, layers[0].arch.model_type, num_experts, num_devices, 1, "test", groups)


@pytest.mark.parametrize("model_type", list(CORE_MODEL_TYPES))
def test_permute_experts_keeps_the_model_function(model_type):
    model = tiny_model(model_type)
    placement = shuffled_placement(model, num_devices=4)
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    layer = find_moe_layers(model)[0]
    router_before = layer.router.weight.detach().clone()
    with torch.no_grad():
        before = model(input_ids).logits
        permute_experts(model, placement)
        after = model(input_ids).logits
    order = placement.expert_order(layer.index)
    assert not torch.equal(order, torch.arange(8))
    assert torch.equal(layer.router.weight, router_before[order])  # new expert j = original order[j]
    assert isinstance(layer.router.weight, torch.nn.Parameter)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_permute_experts_refuses_to_mix_deepseek_expert_groups():
    model = tiny_model("deepseek_v3", n_group=2, topk_group=1)  # 2 routing groups of 4 experts
    indices = [layer.index for layer in find_moe_layers(model)]
    mixing = Placement(
        None, "deepseek_v3", 8, 2, 1, "test", {i: [[0, 1, 2, 4], [3, 5, 6, 7]] for i in indices}
    )
    with pytest.raises(PlacementError, match="2 expert groups of 4"):
        permute_experts(model, mixing)
    # swapping whole groups (and reordering inside them) keeps the function
    input_ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    swapping = Placement(
        None, "deepseek_v3", 8, 2, 1, "test", {i: [[4, 5, 6, 7], [0, 1, 2, 3]] for i in indices}
    )
    with torch.no_grad():
        before = model(input_ids).logits
        permute_experts(model, swapping)
        torch.testing.assert_close(model(input_ids).logits, before, atol=1e-5, rtol=0)


def test_permute_experts_rejects_a_placement_for_another_model():
    model = tiny_model("olmoe")
    with pytest.raises(PlacementError, match="made for 64 experts, model has 8"):
        permute_experts(model, sequential_placement(64, 4, [0, 1]))


@pytest.mark.slow
def test_group_limited_models_are_placed_in_whole_routing_groups():
    """DeepSeek-V3 with n_group=4, topk_group=2: the profile records group size 4 and every placement
    moves whole groups, so the placed model is the same function (pruned or not)."""
    from occult_ft.profiling import profile_model

    model = tiny_model("deepseek_v3", num_experts_per_tok=2, n_group=4, topk_group=2, n_routed_experts=16)
    batches = [
        {"input_ids": torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(s))}
        for s in range(3)
    ]
    prof = profile_model(model, batches, progress=False)
    assert prof.group_size == 4
    input_ids = batches[0]["input_ids"]
    with torch.no_grad():
        before = model(input_ids).logits
    for algorithm in PLACEMENT_ALGORITHMS:
        placement = compute_placement(prof, 2, algorithm=algorithm, **FAST.get(algorithm, {}))
        for layer in placement.layers:
            for group in placement.groups[layer]:
                assert len(group) == 8 and all(sum(e // 4 == q for e in group) in (0, 4) for q in range(4))
        placed = tiny_model(
            "deepseek_v3", num_experts_per_tok=2, n_group=4, topk_group=2, n_routed_experts=16
        )
        permute_experts(placed, placement)
        with torch.no_grad():
            torch.testing.assert_close(placed(input_ids).logits, before, atol=1e-5, rtol=0)
    # 8 devices: each group of 4 spans 2 devices and keeps its slot; experts move only inside it
    for placement in (
        compute_placement(prof, 8, time_limit=5.0),
        compute_placement(prof, 8, algorithm="occult"),
    ):
        for layer in placement.layers:
            for d, group in enumerate(placement.groups[layer]):
                assert len(group) == 2 and {e // 4 for e in group} == {d // 2}
        placed = tiny_model(
            "deepseek_v3", num_experts_per_tok=2, n_group=4, topk_group=2, n_routed_experts=16
        )
        permute_experts(placed, placement)
        with torch.no_grad():
            torch.testing.assert_close(placed(input_ids).logits, before, atol=1e-5, rtol=0)
    assert compute_placement(prof, 16, time_limit=5.0).num_devices == 16  # one expert per device


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_search_on_a_token_subset_is_still_never_worse_than_occult_on_all_tokens(routing):
    ids = ROUTINGS[routing]()
    sub = place_layer(ids, 64, 8, "search", max_search_tokens=256)  # swaps see 256 of the 2048 tokens
    assert cc(ids, sub, 64) <= cc(ids, place_layer(ids, 64, 8, "occult"), 64) + 1e-9
    assert_equal_partition(sub, 64, 8)


def test_devices_that_would_split_routing_groups_unevenly_are_refused():
    ids = random_routing(24, top_k=2, tokens=64)
    prof = SimpleNamespace(
        model=None,
        model_type="deepseek_v3",
        num_experts=24,
        top_k=2,
        group_size=6,
        layers={0: SimpleNamespace(topk_ids=ids)},
    )
    with pytest.raises(PlacementError, match="4 groups of 6 experts.*devices dividing or divisible by 4"):
        compute_placement(
            prof, 6, algorithm="search"
        )  # 4 experts per device: neither whole groups nor an even split
    assert compute_placement(prof, 6, algorithm="sequential").num_devices == 6


# ---- the algorithm registry ---------------------------------------------------------------------------------
def test_registry_entries_declare_their_options():
    assert PLACEMENT_ALGORITHMS["search"].options == (
        "max_load_imbalance",
        "seed",
        "restarts",
        "max_swaps",
        "max_search_tokens",
    )
    assert PLACEMENT_ALGORITHMS["solver"].options == ("max_load_imbalance", "time_limit", "seed")
    for name in ("sequential", "occult", "greedy_pairs"):
        assert PLACEMENT_ALGORITHMS[name].options == ()
    with pytest.raises(ValueError, match="'occult' is registered already"):
        register_algorithm("occult", lambda x_TE, num_devices: [])


@pytest.mark.parametrize(
    "algorithm,options,message",
    [
        (
            "occult",
            dict(restarts=2),
            "'occult' has no option 'restarts'; it takes no options .*option of 'search'",
        ),
        ("sequential", dict(seed=1), "'sequential' has no option 'seed'"),
        (
            "search",
            dict(restart=2),
            "'search' has no option 'restart'; its options are max_load_imbalance, seed",
        ),
        ("search", dict(restarts=-1), "restarts=-1 must be an integer >= 0"),
        ("search", dict(max_load_imbalance=0.5), "max_load_imbalance=0.5 must be a number >= 1"),
        ("search", dict(max_search_tokens=0), "max_search_tokens=0 must be a positive integer"),
    ],
)
def test_an_option_the_algorithm_does_not_take_is_a_one_line_error(algorithm, options, message):
    ids = random_routing(16, top_k=2, tokens=64)
    for call in (
        lambda: place_layer(ids, 16, 4, algorithm, **options),
        lambda: place_layer(ids, 16, 4, algorithm, num_nodes=2, **options),
        lambda: PLACEMENT_ALGORITHMS[algorithm](ids, 16, 4, **options),
        lambda: compute_placement(tiny_profile(), 4, algorithm=algorithm, **options),
    ):
        with pytest.raises(PlacementError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(PLACEMENT_ALGORITHMS))
@pytest.mark.parametrize("num_nodes", [1, 2])
def test_every_registered_algorithm_runs_through_compute_placement(algorithm, num_nodes):
    placement = compute_placement(
        tiny_profile(), 4, num_nodes=num_nodes, algorithm=algorithm, **FAST.get(algorithm, {})
    )
    assert (placement.algorithm, placement.num_devices, placement.num_nodes) == (algorithm, 4, num_nodes)
    for layer in placement.layers:
        assert_equal_partition(placement.groups[layer], 16, 4)
        assert placement.groups[layer] == place_layer(
            tiny_profile().layers[layer].topk_ids,
            16,
            4,
            algorithm,
            num_nodes=num_nodes,
            **FAST.get(algorithm, {}),
        )


# ---- hierarchical search: never worse than hierarchical occult at either level -------------------------------
def test_hierarchical_search_is_never_worse_than_hierarchical_occult_at_either_level():
    """Skewed routing, 32 experts on 8 devices in 2 nodes, 8 layers. Searching the node level first
    (fewest distinct nodes) can leave the device level worse than occult's: it does on some layers here
    (checked below, so the guarantee is not vacuous); `search` then keeps another candidate."""
    profile = SimpleNamespace(
        model=None,
        model_type=None,
        num_experts=32,
        top_k=4,
        layers={
            i: SimpleNamespace(topk_ids=random_routing(32, top_k=4, tokens=512, skew=1.5, seed=i))
            for i in range(8)
        },
    )
    found = compute_placement(profile, 8, num_nodes=2, algorithm="search")
    occult = compute_placement(profile, 8, num_nodes=2, algorithm="occult")
    nodes_first_worse = 0
    for i in profile.layers:
        ids = profile.layers[i].topk_ids
        found_i, ref = found.metrics["layers"][str(i)], occult.metrics["layers"][str(i)]
        assert found_i["node_complexity"] <= ref["node_complexity"] + 1e-12, i
        assert found_i["comm_complexity"] <= ref["comm_complexity"] + 1e-12, i
        x_TE = incidence(ids, 32)
        plain = level_totals(x_TE, two_level(ids, 32, 8, 2, search, seed=0), 8, 2)
        nodes_first_worse += plain[1] > level_totals(x_TE, occult.groups[i], 8, 2)[1]
    assert nodes_first_worse >= 1


def test_two_level_takes_a_solver_that_returns_a_layer_result():
    # a registered `solve` may return groups or a LayerResult; the default N > 1 path (two_level, both
    # levels with `solve`) used to iterate the LayerResult itself and fail
    ids = random_routing(16, top_k=2, tokens=256, seed=0)

    def as_result(x_TE, num_devices):
        return LayerResult(occult(x_TE, num_devices), note="wrapped")

    expected = two_level(ids, 16, 4, 2, occult)
    assert two_level(ids, 16, 4, 2, as_result) == expected
    assert sorted(e for g in expected for e in g) == list(range(16))


# ---- file sizes, atomic save ------------------------------------------------------------------------------
def test_a_file_claiming_a_huge_expert_count_is_rejected_at_once(tmp_path):
    import time

    path = tmp_path / "placement.json"
    path.write_text(_with(num_experts=10**15)())
    start = time.perf_counter()
    with pytest.raises(
        PlacementError, match="layer 0 lists 8 experts but num_experts=1000000000000000"
    ) as info:
        Placement.load(path)
    assert time.perf_counter() - start < 1.0 and "\n" not in str(info.value)


def test_save_replaces_the_file_atomically_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text("old contents")
    placement = sequential_placement(8, 2, [0, 2])
    placement.save(path)
    assert Placement.load(path) == placement
    assert [p.name for p in tmp_path.iterdir()] == ["placement.json"]
    with pytest.raises(PlacementError, match="is a directory"):
        placement.save(tmp_path)


# ---- the exact solver against brute force -------------------------------------------------------------------
def equal_partitions(items, size):
    """Every partition of `items` into groups of `size` (unordered groups), by brute force."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [e for e in rest if e not in others]
        for tail in equal_partitions(left, size):
            yield [[first, *others], *tail]


def brute_force(ids, num_experts, num_devices, bound=None):
    """(least summed devices, its load imbalance) over all equal partitions whose load imbalance is within
    `bound` (None: any). A device's load is the tokens with an expert on it, counted from the routing."""
    size = num_experts // num_devices
    load = {
        g: int(torch.isin(ids, torch.tensor(g)).any(dim=1).sum())
        for g in itertools.combinations(range(num_experts), size)
    }
    best = (float("inf"), None)
    for groups in equal_partitions(list(range(num_experts)), size):
        loads = [load[tuple(g)] for g in groups]
        imb = max(loads) / (sum(loads) / num_devices)
        if bound is None or imb <= bound * (1 + 1e-9):
            best = min(best, (sum(loads), imb))
    return best


BRUTE_CASES = [  # (experts, devices, top_k, skew, seed): 35 to 2520 partitions each
    (8, 2, 2, 1.0, 0),
    (8, 2, 3, 0.0, 1),
    (8, 4, 2, 1.5, 2),
    (8, 4, 3, 0.5, 3),
    (9, 3, 2, 1.0, 4),
    (12, 3, 3, 1.0, 5),
]


@pytest.mark.parametrize("num_experts,num_devices,top_k,skew,seed", BRUTE_CASES)
@pytest.mark.parametrize("bounded", [False, True])
def test_solver_finds_the_brute_force_optimum_and_proves_it(
    num_experts, num_devices, top_k, skew, seed, bounded
):
    ids = random_routing(num_experts, top_k=top_k, tokens=300, skew=skew, seed=seed)
    unbounded = brute_force(ids, num_experts, num_devices)
    # a bound between even load and the unbounded optimum's, so that it binds where it can
    bound = 1.0 + 0.5 * (unbounded[1] - 1.0) if bounded else 1e9
    optimum, _ = brute_force(ids, num_experts, num_devices, bound)
    if optimum == float("inf"):
        pytest.skip(
            "no partition keeps this bound"
        )  # not reached for these seeds (checked by the count below)
    result = solve_layer(ids, num_experts, num_devices, "solver", max_load_imbalance=bound, time_limit=300.0)
    dev = expert_device_from_groups(result.groups, num_experts)
    assert devices_total(ids, dev, num_devices) == optimum
    assert load_imbalance(ids, dev, num_devices) <= bound + 1e-9
    assert result.optimal and result.lower_bound == optimum


@pytest.mark.parametrize("seed", range(4))
def test_partition_bound_never_exceeds_the_optimum_also_for_a_sub_problem(seed):
    """solve_partition on a few devices of a larger layer (offset and the other devices' largest load in
    the bound, an absolute cap): its value and bound bracket the brute-force optimum of that sub-problem."""
    gen = torch.Generator().manual_seed(seed)
    sets = TokenSets.from_incidence((torch.rand(200, 8, generator=gen) < 0.3).float())
    bound = LoadBound(1.2, 6, offset=float(sets.w.sum()) * 2.5, other_max=float(sets.w.sum()) * 0.9)
    cap = float(sets.w.sum()) * 0.95
    best = float("inf")
    for groups in equal_partitions(list(range(8)), 4):
        G = np.zeros((2, 8), bool)
        for i, g in enumerate(groups):
            G[i, g] = True
        cost = sets.cover(G)
        if cost.max() <= cap and bound.keeps(cost):
            best = min(best, float(cost.sum()))
    res = solve_partition(sets, 2, [], bound=bound, max_load=cap, seconds=300.0)
    if best == float("inf"):
        assert res.status == "infeasible" and not res.groups
        return
    assert res.lower_bound <= best + 1e-9 <= res.value + 1e-9
    assert res.optimal and res.value == best


def test_exact_pricing_matches_a_scan_of_every_group():
    gen = torch.Generator().manual_seed(7)
    sets = TokenSets.from_incidence((torch.rand(400, 10, generator=gen) < 0.25).float())
    pi = torch.rand(10, generator=gen).double().numpy() * 120.0
    groups = np.array([[e in c for e in range(10)] for c in itertools.combinations(range(10), 4)])
    rc = sets.cover(groups) - groups @ pi
    for cap in (float("inf"), float(np.median(sets.cover(groups)))):
        ok = sets.cover(groups) <= cap
        best_rc, found, lower, complete = price(sets, pi, 1.0, 4, cap, float("inf"))
        assert complete and abs(best_rc - rc[ok].min()) < 1e-6 and lower <= rc[ok].min() + 1e-6
        threshold = float(np.quantile(rc[ok], 0.2))
        _, collected, _, complete = price(sets, pi, 1.0, 4, cap, threshold, collect=True)
        assert complete
        assert {tuple(g) for g in collected} == {tuple(g) for g in groups[ok & (rc <= threshold + 1e-6)]}
    # alpha < 0 (a bound row's dual): the minimum still matches the scan
    best_rc, _, lower, _ = price(sets, pi, -0.5, 4, float("inf"), float("inf"))
    assert abs(best_rc - (-0.5 * sets.cover(groups) - groups @ pi).min()) < 1e-6


def test_a_pair_move_is_the_best_split_of_the_two_devices():
    ids = random_routing(16, top_k=3, tokens=500, skew=1.0, seed=3)
    sets = TokenSets.from_incidence(incidence(ids, 16))
    dev = (torch.arange(16) // 4).numpy()
    loads = sets.cover(np.array([dev == d for d in range(4)]))
    free_a, free_b = np.flatnonzero(dev == 0), np.flatnonzero(dev == 1)
    move = pair_move(sets, dev, loads, 0, 1, free_a, free_b, LoadBound(1.3, 4), float("inf"))
    best = float("inf")
    for part in itertools.combinations(range(8), 4):  # every split of devices 0 and 1
        new = dev.copy()
        new[[e for e in range(8) if e not in part]] = 1
        new[list(part)] = 0
        d = torch.as_tensor(new)
        if load_imbalance(ids, d, 4) <= 1.3 + 1e-9:
            best = min(best, devices_total(ids, d, 4))
    now = devices_total(ids, torch.as_tensor(dev), 4)
    if best < now:
        assert move is not None and devices_total(ids, torch.as_tensor(move[1]), 4) == best
        assert np.allclose(move[2], sets.cover(np.array([move[1] == d for d in range(4)])))
    else:
        assert move is None


# ---- the solver at layer level ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("routing", ["skewed", "planted_small_groups"])
def test_solver_is_never_worse_than_search_and_keeps_the_same_bound(routing):
    ids = ROUTINGS[routing]()
    found = solve_layer(ids, 64, 8, "solver", time_limit=4.0)  # it starts from search: never worse
    searched = place_layer(ids, 64, 8, "search")
    occult = place_layer(ids, 64, 8, "occult")
    bound = max(1.25, imbalance(ids, occult, 64))
    assert cc(ids, found.groups, 64) <= cc(ids, searched, 64) + 1e-12
    assert imbalance(ids, found.groups, 64) <= bound + 1e-9
    assert found.lower_bound <= devices_total(ids, expert_device_from_groups(found.groups, 64), 8)


def test_solver_keeps_an_explicit_bound_and_names_an_unreachable_one():
    ids = random_routing(32, top_k=4, tokens=1000, skew=1.5, seed=5)
    found = solve_layer(ids, 32, 8, "solver", max_load_imbalance=1.3, time_limit=10.0)
    assert imbalance(ids, found.groups, 32) <= 1.3 + 1e-9
    with pytest.raises(PlacementError, match="no placement found within max_load_imbalance=1.0") as info:
        solve_layer(ids, 32, 8, "solver", max_load_imbalance=1.0, time_limit=3.0)
    assert "\n" not in str(info.value)


def test_hierarchical_solver_keeps_the_bound_over_all_devices_and_bounds_both_levels():
    ids = random_routing(32, top_k=4, tokens=1000, skew=1.0, seed=6)
    found = solve_layer(ids, 32, 8, "solver", num_nodes=2, time_limit=6.0)
    occult = place_layer(ids, 32, 8, "occult", num_nodes=2)
    assert_equal_partition(found.groups, 32, 8)
    dev = expert_device_from_groups(found.groups, 32)
    assert imbalance(ids, found.groups, 32) <= max(1.25, imbalance(ids, occult, 32)) + 1e-9
    x = incidence(ids, 32)
    nodes, devices = level_totals(x, found.groups, 8, 2)
    assert found.node_lower_bound <= nodes and found.lower_bound <= devices
    assert devices == devices_total(ids, dev, 8)


def test_without_scipy_the_solver_runs_search_and_says_so(monkeypatch):
    import occult_ft.placement.solver as solver_module

    monkeypatch.setattr(solver_module, "scipy_available", lambda: False)
    monkeypatch.setitem(solver_module._warned, "scipy", False)
    ids = random_routing(16, top_k=2, tokens=200, seed=1)
    with pytest.warns(UserWarning, match=r"scipy is not installed: placed by `search` \(pip install"):
        found = solve_layer(ids, 16, 4, "solver")
    assert found.groups == place_layer(ids, 16, 4, "search") and found.lower_bound is None
    assert "scipy is not installed" in found.note


# ---- placement under a pruning budget ----------------------------------------------------------------------
@pytest.mark.parametrize("max_devices", [1, 2, 3])
def test_the_pruned_devices_are_those_of_the_routers_pruning_rule(max_devices):
    """`admitted_devices` reads the pruned routing from the top-k alone; the router's rule (`limit_topk`)
    needs scores: the top-k get descending scores, the other experts lower ones (random)."""
    from occult_ft.routing import limit_topk

    gen = torch.Generator().manual_seed(max_devices)
    scores_TE = torch.rand(400, 16, generator=gen)
    ids = scores_TE.topk(4, dim=1).indices  # best first, as routers return them
    dev_E = torch.randperm(16, generator=gen) // 4
    reach_TD, kept_TK = admitted_devices(ids, dev_E, 4, max_devices)
    for criterion in ("score", "device_max", "similarity"):
        similarity = torch.rand(16, 16, generator=gen)
        pruned = limit_topk(scores_TE, ids, dev_E, 4, max_devices, criterion, similarity_EE=similarity)
        reached = torch.zeros(400, 4, dtype=torch.bool).scatter_(1, dev_E[pruned], True)
        assert torch.equal(reached, reach_TD), criterion
        kept = (ids[:, :, None] == pruned[:, None, :]).any(dim=2)
        assert torch.equal(kept, kept_TK), criterion
    figures = pruned_figures(ids, dev_E, 4, max_devices)
    assert figures["comm_complexity"] <= max_devices
    assert figures["removed_share"] == pytest.approx(1 - kept_TK.float().mean().item())


@pytest.mark.slow
def test_placement_under_a_budget_keeps_the_pruned_load_bound_and_removes_fewer_choices():
    ids = random_routing(32, top_k=4, tokens=1500, skew=0.5, seed=8)  # occult's pruned imbalance: 2.54
    profile = SimpleNamespace(
        model=None, model_type=None, num_experts=32, top_k=4, layers={0: SimpleNamespace(topk_ids=ids)}
    )
    plain = compute_placement(profile, 8, algorithm="solver", time_limit=6.0)
    budget = compute_placement(
        profile, 8, algorithm="solver", time_limit=6.0, max_devices_per_token=2, max_load_imbalance=2.3
    )
    f = budget.metrics["layers"]["0"]["pruned"]
    assert f["load_imbalance"] <= 2.3 + 1e-9 and f["comm_complexity"] <= 2.0
    before = pruned_figures(ids, plain.expert_device(0), 8, 2)
    if before["load_imbalance"] <= 2.3:  # the refinement starts there and only takes improvements
        assert f["removed_share"] <= before["removed_share"] + 1e-12
    assert f == pytest.approx(
        dict(max_devices_per_token=2, criterion="score") | pruned_figures(ids, budget.expert_device(0), 8, 2)
    )
    with pytest.raises(PlacementError, match="pruned routing keeps max_load_imbalance=1.100: the lowest"):
        compute_placement(profile, 8, time_limit=3.0, max_devices_per_token=2, max_load_imbalance=1.1)
    with pytest.raises(
        PlacementError, match="'occult' gives the pruned routing load imbalance 2.537 > max_load"
    ):
        compute_placement(profile, 8, algorithm="occult", max_devices_per_token=2, max_load_imbalance=2.3)
    with pytest.raises(PlacementError, match="criterion='device_topk_sum': placement under a budget"):
        compute_placement(profile, 8, max_devices_per_token=2, criterion="device_topk_sum")
    with pytest.raises(PlacementError, match="max_devices_per_token=9 must be between 1 and devices=8"):
        compute_placement(profile, 8, max_devices_per_token=9)


# ---- figures, held-out tokens and the version-2 file --------------------------------------------------------
@pytest.mark.slow
def test_compute_placement_reports_bound_gap_and_held_out_figures(tmp_path):
    ids = random_routing(16, top_k=3, tokens=2048, skew=1.0, seed=9)
    profile = SimpleNamespace(
        model="m", model_type="olmoe", num_experts=16, top_k=3, layers={2: SimpleNamespace(topk_ids=ids)}
    )
    for algorithm in ("solver", "occult"):
        placement = compute_placement(profile, 4, algorithm=algorithm, holdout=0.5, **FAST.get(algorithm, {}))
        f = placement.figures(2)
        fit, held = split_holdout(2048, 0.5)
        assert (f["tokens"], f["held_out"]["tokens"]) == (1024, 1024) and len(fit) == len(held) == 1024
        assert not set(fit.tolist()) & set(held.tolist())
        dev = placement.expert_device(2)
        assert f["comm_complexity"] == pytest.approx(comm_complexity(ids[fit], dev, 4))
        assert f["held_out"]["comm_complexity"] == pytest.approx(comm_complexity(ids[held], dev, 4))
        assert f["held_out"]["load_imbalance"] == pytest.approx(load_imbalance(ids[held], dev, 4))
        assert f["lower_bound"] <= f["comm_complexity"] + 1e-12 and f["gap"] >= -1e-12
        assert f["load_bound"] >= 1.25 and f["seconds"] > 0
        path = tmp_path / f"{algorithm}.json"
        placement.save(path)
        assert Placement.load(path) == placement
    assert placement.metrics["held_out"]["tokens"] == 1024


def test_split_holdout_takes_every_other_block():
    fit, held = split_holdout(1000, 0.5)  # 4 blocks of 256: blocks 1 and 3 held out
    assert held.tolist() == list(range(256, 512)) + list(range(768, 1000))
    assert split_holdout(200, 0.5)[1].numel() == 0  # one block: nothing held out
    assert split_holdout(1000, 0.0)[0].numel() == 1000


def _v2_file(**layer_changes):
    placement = compute_placement(tiny_profile(), 4, algorithm="occult", bound_time_limit=0)
    data = json.loads(placement.to_json())
    data["metrics"]["layers"]["1"].update(layer_changes)
    return data


BAD_V2 = {
    "duplicate_layer_keys": (
        _with(layers={"1": [[0, 1, 2, 3], [4, 5, 6, 7]], "01": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
        "layer keys '1' and '01', both naming layer 1",
    ),
    "a_key_given_twice": (
        lambda: '{"format": "occult_ft.placement", "version": 2, "version": 2}',
        "the key 'version' is given twice",
    ),
    "bad_figure_type": (
        lambda: json.dumps(_v2_file(comm_complexity="low")),
        "figure 'comm_complexity' is 'low'",
    ),
    "unknown_figure": (lambda: json.dumps(_v2_file(speed=3)), "unknown figure 'speed'"),
    "figures_of_a_missing_layer": (
        lambda: json.dumps(dict(_v2_file(), metrics={"layers": {"7": {}}})),
        "figures for layer 7, which the placement lacks",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_V2))
def test_version_2_files_reject_ambiguous_layers_and_bad_figures(tmp_path, case):
    make, message = BAD_V2[case]
    path = tmp_path / "placement.json"
    text = make()
    path.write_text(text)
    with pytest.raises(PlacementError, match=message) as info:
        Placement.load(path)
    assert "\n" not in str(info.value)


def test_a_version_1_file_with_free_metrics_still_loads(tmp_path):
    data = _good_file()
    data.update(version=1, metrics={"comm_complexity": 2.5, "anything": [1, 2]})
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    placement = Placement.load(path)
    assert placement.groups[0] == [[0, 1, 2, 3], [4, 5, 6, 7]] and placement.figures(0) is None


@pytest.mark.slow
def test_place_command_prints_and_stores_the_figures(tmp_path, capsys):
    from occult_ft.cli import main
    from occult_ft.profiling import LayerProfile, Profile

    prof = Profile("tiny", "olmoe", 16, 3, 2048)
    for i in (0, 1):
        ids = random_routing(16, top_k=3, tokens=2048, skew=0.3, seed=i)
        co = coactivation_matrix(ids, 16).double()
        prof.layers[i] = LayerProfile(
            i, ids.to(torch.int16), co, co.diagonal().clone(), torch.eye(16).double()
        )
    prof.save(str(tmp_path / "p.safetensors"))
    out = tmp_path / "placement.json"
    args = [
        "place",
        str(tmp_path / "p.safetensors"),
        "--devices",
        "4",
        "--time-limit",
        "5",
        "--out",
        str(out),
    ]
    assert main(args + ["--max-load-imbalance", "1.3"]) == 0
    text = capsys.readouterr().out
    assert "layer    seq  placed  imbal  bound   lower     gap held cc held im" in text
    placement = Placement.load(out)
    for layer in (0, 1):
        f = placement.figures(layer)
        assert f["load_bound"] == 1.3 and f["load_imbalance"] <= 1.3 and f["held_out"]["tokens"] == 1024
        assert f"{f['comm_complexity']:7.3f}" in text and f"{f['lower_bound']:7.3f}" in text
    assert main(args + ["--max-load-imbalance", "0.9"]) == 2
    assert "max_load_imbalance=0.9 must be a number >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_the_figure_table_reads_stored_figures_and_says_when_there_are_none():
    from occult_ft.commands.place import format_figures

    assert "no per-layer figures" in format_figures(sequential_placement(8, 2, [0, 1]))
    placement = compute_placement(tiny_profile(tokens=1024), 4, num_nodes=2, time_limit=5.0, holdout=0.5)
    table = format_figures(placement)
    for layer in (1, 3):
        f = placement.figures(layer)
        assert f["node_lower_bound"] <= f["node_complexity"] + 1e-12
        assert f["lower_bound"] <= f["comm_complexity"] + 1e-12
        row = next(line for line in table.splitlines() if line.split()[0] == str(layer))
        assert f"{f['comm_complexity']:.3f}" in row and f"{f['held_out']['comm_complexity']:.3f}" in row
