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
    intra_share,
    load_imbalance,
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
