"""Metrics worked out by hand."""

import math

import pytest
import torch

from occult_ft.metrics import (
    comm_complexity,
    comm_complexity_lower_bound,
    contiguous_expert_device,
    device_histogram,
    device_load,
    devices_per_token,
    expert_device_from_groups,
    expert_node,
    intra_share,
    load_imbalance,
    node_comm_complexity,
    nodes_per_token,
    random_placement_comm_complexity,
    routing_report,
)

# 8 experts on 4 devices: device d holds experts {2d, 2d+1}
DEV = contiguous_expert_device(8, 4)
# token 0 -> experts 0,1 (device 0 only)          -> 1 device, 1 intra pair of 1
# token 1 -> experts 0,2 (devices 0, 1)           -> 2 devices, 0 intra pairs
# token 2 -> experts 1,7 (devices 0, 3)           -> 2 devices, 0 intra pairs
IDS = torch.tensor([[0, 1], [0, 2], [1, 7]])


def test_contiguous_placement():
    assert DEV.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_devices_per_token_and_comm_complexity():
    assert devices_per_token(IDS, DEV, 4).tolist() == [1, 2, 2]
    assert comm_complexity(IDS, DEV, 4) == pytest.approx(5 / 3)


def test_intra_share_counts_pairs_on_one_device():
    # 3 tokens x 1 pair each; one of them intra
    assert intra_share(IDS, DEV, 4) == pytest.approx(1 / 3)


def test_histogram_and_load():
    assert device_histogram(IDS, DEV, 4) == [0, 1, 2, 0, 0]
    # device 0 receives tokens 0,1,2; device 1 token 1; device 3 token 2
    assert device_load(IDS, DEV, 4).tolist() == [3, 1, 0, 1]
    assert load_imbalance(IDS, DEV, 4) == pytest.approx(3 / (5 / 4))


def test_zero_tokens_give_zero_metrics():
    empty = torch.zeros(0, 2, dtype=torch.long)
    assert comm_complexity(empty, DEV, 4) == 0.0
    assert intra_share(empty, DEV, 4) == 0.0
    assert load_imbalance(empty, DEV, 4) == 0.0


def test_reference_points_from_the_paper():
    # OLMoE: 64 experts, top-8, 4 devices: random expectation 4 * (1 - C(48,8)/C(64,8))
    expected = 4 * (1 - math.comb(48, 8) / math.comb(64, 8))
    assert random_placement_comm_complexity(64, 8, 4) == pytest.approx(expected)
    assert 3.6 < expected < 3.8  # the paper's plain OLMoE measurement was 3.68
    assert comm_complexity_lower_bound(64, 8, 4) == 1
    assert comm_complexity_lower_bound(64, 8, 16) == 2


def test_random_placement_expectation_matches_simulation():
    torch.manual_seed(0)
    ids = torch.stack([torch.randperm(64)[:8] for _ in range(4000)])
    sim = comm_complexity(ids, contiguous_expert_device(64, 4), 4)
    assert sim == pytest.approx(random_placement_comm_complexity(64, 8, 4), abs=0.03)


def test_groups_to_expert_device():
    dev = expert_device_from_groups([[3, 1], [0, 2]])
    assert dev.tolist() == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="without a device"):
        expert_device_from_groups([[0], [1]], num_experts=3)


def test_devices_must_divide_experts():
    with pytest.raises(ValueError, match="devices=3 must divide the 8 experts"):
        contiguous_expert_device(8, 3)


def test_report_weights_layers_by_tokens():
    rep = routing_report({0: IDS, 1: torch.tensor([[0, 1]])}, DEV, 4, 8)
    assert [m.layer for m in rep.layers] == [0, 1]
    assert rep.comm_complexity == pytest.approx((5 / 3 * 3 + 1) / 4)
    assert rep.layers[0].naive_rows_per_token == 2
    assert rep.devices_histogram == [0, 2, 2, 0, 0]


def test_node_comm_complexity_by_hand():
    # 2 nodes of 2 devices: node 0 = devices 0, 1 = experts 0-3; node 1 = devices 2, 3 = experts 4-7.
    # token 0 -> devices {0} -> node {0}: 1;  token 1 -> devices {0, 1} -> node {0}: 1 (C_T 2, N_T 1)
    # token 2 -> devices {0, 3} -> nodes {0, 1}: 2.   mean N_T = 4 / 3, mean C_T = 5 / 3
    assert expert_node(DEV, 4, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert nodes_per_token(IDS, DEV, 4, 2).tolist() == [1, 1, 2]
    assert node_comm_complexity(IDS, DEV, 4, 2) == pytest.approx(4 / 3)
    assert node_comm_complexity(IDS, DEV, 4, 4) == pytest.approx(
        comm_complexity(IDS, DEV, 4)
    )  # 1 device/node
    assert node_comm_complexity(IDS, DEV, 4, 1) == 1.0
    assert node_comm_complexity(IDS[:0], DEV, 4, 2) == 0.0
    with pytest.raises(ValueError, match=r"nodes=3 does not divide devices=4; use one of \[1, 2, 4\]"):
        nodes_per_token(IDS, DEV, 4, 3)


def test_report_gives_node_comm_complexity_beside_the_device_one():
    rep = routing_report({0: IDS, 1: torch.tensor([[0, 7]])}, DEV, 4, 8, nodes=2)
    # layer 0: 4 / 3 (above); layer 1: experts 0 and 7 -> nodes {0, 1}: 2. Token-weighted: (4 + 2) / 4
    assert [m.node_comm_complexity for m in rep.layers] == [pytest.approx(4 / 3), 2.0]
    assert (rep.nodes, rep.node_comm_complexity) == (2, pytest.approx(6 / 4))
    assert rep.to_dict()["node_comm_complexity"] == pytest.approx(1.5)
    single = routing_report({0: IDS}, DEV, 4, 8)
    assert single.node_comm_complexity is None and single.layers[0].node_comm_complexity is None
