"""occult_ft.bench.costmodel: hand-worked all-to-all times, row matrices, presets and speed-up predictions."""

import math

import pytest
import torch

from occult_ft.bench.costmodel import (
    CLUSTER_PRESETS,
    ClusterShape,
    capacity_rows_matrix,
    get_cluster,
    predict_all_to_all_ms,
    predict_exchange_ms,
    predict_node_exchange,
    predict_speedup,
    predict_two_stage_exchange_ms,
    pruned_topk,
    rows_matrix,
    split_rows,
    token_ranks,
    two_stage_rows,
)
from occult_ft.metrics import contiguous_expert_device, devices_per_token, node_comm_complexity

MB = 1_000_000


def test_single_node_time_is_the_busiest_link_direction_plus_latency():
    # Device 0 sends 3 MB to device 1 and receives 1 MB from it; at 10 GB/s (= 10 MB/ms) that is
    # max(0.3, 0.1) = 0.3 ms for device 0, and max(0.1, 0.3) = 0.3 ms for device 1; + 10 us latency.
    shape = ClusterShape(
        "t", devices_per_node=2, nodes=1, intra_node_GBps=10, inter_node_GBps=1, latency_us=10
    )
    rows = [[5, 3], [1, 5]]
    assert predict_all_to_all_ms(rows, MB, shape) == pytest.approx(0.31)


def test_rows_a_device_keeps_cost_nothing():
    shape = ClusterShape("t", 2, 1, 10, 1, 0)
    assert predict_all_to_all_ms([[100, 0], [0, 100]], MB, shape) == 0.0


def test_two_nodes_add_intra_and_inter_node_time():
    # 2 nodes x 2 devices; intra 10 GB/s: 1 MB = 0.1 ms; inter 1 GB/s: 1 MB = 1 ms.
    # device 0: send 2 MB intra (0.2) + 1 MB inter (1.0) = 1.2; receive 1 MB intra (0.1) + 2 MB inter (2.0) = 2.1
    # device 1: send 0.1, receive 0.2; device 2: send 0.3, receive 1.0; device 3: send 2.0, receive 0.3
    # -> max 2.1 ms + 5 us latency
    shape = ClusterShape(
        "t", devices_per_node=2, nodes=2, intra_node_GBps=10, inter_node_GBps=1, latency_us=5
    )
    rows = torch.tensor([[9, 2, 1, 0], [1, 9, 0, 0], [0, 0, 9, 3], [2, 0, 0, 9]])
    assert predict_all_to_all_ms(rows, MB, shape) == pytest.approx(2.105)
    # the combine sends the transpose: sends and receives swap, the maxima stay -> twice the time
    assert predict_exchange_ms(rows, MB, shape) == pytest.approx(4.21)


def test_matrix_size_must_match_the_cluster():
    with pytest.raises(ValueError, match="covers 2 devices but cluster '8xH100-nvlink' has 8"):
        predict_all_to_all_ms([[1, 1], [1, 1]], 10, CLUSTER_PRESETS["8xH100-nvlink"])


def test_token_ranks_split_contiguously_like_tensor_split():
    assert token_ranks(5, 2).tolist() == [0, 0, 0, 1, 1]
    assert token_ranks(0, 3).tolist() == []


def test_rows_matrix_dedup_and_per_expert_by_hand():
    # E=4 experts on D=2 devices (experts 0,1 on device 0; 2,3 on device 1); 3 tokens, top-2.
    # Tokens 0 and 1 live on device 0, token 2 on device 1 (tensor_split of 3 over 2).
    ids = torch.tensor([[0, 1], [1, 2], [3, 2]])
    dev = contiguous_expert_device(4, 2)
    # dedup: token 0 -> {0}, token 1 -> {0, 1}, token 2 -> {1}
    assert rows_matrix(ids, dev, 2, dedup=True).tolist() == [[2, 1], [0, 1]]
    # per expert: token 0 sends 2 rows to device 0; token 1 one to each; token 2 two to device 1
    assert rows_matrix(ids, dev, 2, dedup=False).tolist() == [[3, 1], [0, 2]]
    assert rows_matrix(ids, dev, 2, dedup=True).sum() == devices_per_token(ids, dev, 2).sum()


def test_capacity_buffer_sends_equal_splits_whatever_the_routing():
    # E=8, D=2, C=5: each device sends C * E/D = 20 rows to each device
    assert capacity_rows_matrix(2, 8, 5).tolist() == [[20, 20], [20, 20]]
    with pytest.raises(ValueError, match="devices=3 must divide the 8 experts"):
        capacity_rows_matrix(3, 8, 5)


def test_presets_and_custom_specs():
    assert set(CLUSTER_PRESETS) >= {"8xH100-nvlink", "4xA6000-pcie", "4x8-ib"}
    ib = get_cluster("4x8-ib")
    assert ib.num_devices == 32 and ib.node_of(9) == 1 and ib.inter_node_GBps == 50.0
    custom = get_cluster("lab:devices_per_node=4,nodes=2,intra=100,inter=12.5,latency=8")
    assert (custom.name, custom.num_devices, custom.inter_node_GBps, custom.latency_us) == (
        "lab",
        8,
        12.5,
        8.0,
    )
    assert all(shape.source for shape in CLUSTER_PRESETS.values())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dgx-h900", "unknown cluster 'dgx-h900'; choose one of 8xH100-nvlink"),
        ("lab:dpn=4,speed=3", "cannot read 'speed=3'"),
        ("lab:dpn=four,intra=3", "dpn='four' is not a number"),
        ("lab:nodes=2", "lacks devices_per_node, intra_node_GBps"),
        ("lab:dpn=4,intra=0", "intra_node_GBps=0.0 must be a positive number"),
    ],
)
def test_bad_cluster_specs_give_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        get_cluster(spec)
    assert "\n" not in str(err.value)


def test_pruned_topk_keeps_fitting_tokens_and_limits_the_others():
    # E=4 on D=2. Token 0 picks experts 0,1 (device 0 only): unchanged under budget 1.
    # Token 1 picks 0 and 2 (devices 0 and 1); its best expert (2, score .5) is on device 1, so with
    # budget 1 it takes the top-2 of device 1: experts 2 and 3.
    scores = torch.tensor([[0.5, 0.4, 0.05, 0.05], [0.3, 0.05, 0.5, 0.15]])
    ids = scores.topk(2, dim=-1).indices
    out = pruned_topk(scores, ids, contiguous_expert_device(4, 2), 2, 1)
    assert sorted(out[0].tolist()) == [0, 1] and sorted(out[1].tolist()) == [2, 3]
    assert torch.equal(out[0], ids[0])  # a token that fits keeps its selection as it was, order included


def test_predict_speedup_orders_dispatch_kinds():
    gen = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(512, 16, generator=gen), dim=-1)
    shape = ClusterShape(
        "t", devices_per_node=4, nodes=1, intra_node_GBps=25, inter_node_GBps=25, latency_us=0
    )
    pred = predict_speedup(scores, 4, shape, bytes_per_row=4096, budgets=(2, 1))
    assert pred["per_expert"]["rows_per_token"] == 4
    assert pred["dedup_prune1"]["rows_per_token"] == 1
    assert pred["dedup_prune2"]["rows_per_token"] <= 2
    assert 1 < pred["dedup"]["speedup_vs_per_expert"] < pred["dedup_prune2"]["speedup_vs_per_expert"]
    assert pred["dedup_prune2"]["speedup_vs_per_expert"] < pred["dedup_prune1"]["speedup_vs_per_expert"]
    assert math.isclose(pred["per_expert"]["speedup_vs_per_expert"], 1.0)
    # what each routing is, as fields: the budget is never only in the name
    assert {name: (p["kind"], p["max_devices_per_token"]) for name, p in pred.items()} == {
        "per_expert": ("per_expert", None),
        "dedup": ("dedup", None),
        "dedup_prune2": ("dedup", 2),
        "dedup_prune1": ("dedup", 1),
    }
    with pytest.raises(
        ValueError, match="max_devices_per_token=1 cannot hold top-8 with 4 experts per device"
    ):
        predict_speedup(scores, 8, shape, 4096, budgets=(1,))


# 2 nodes x 2 devices, E=8 (P=2: node 0 = experts 0-3, node 1 = experts 4-7), one token per device.
#   t0 on device 0 (node 0, local 0): experts 0, 6 -> devices {0, 3}, nodes {0, 1}
#   t1 on device 1 (node 0, local 1): experts 4, 5 -> device {2},    node {1}
#   t2 on device 2 (node 1, local 0): experts 2, 3 -> device {1},    node {0}
#   t3 on device 3 (node 1, local 1): experts 7, 4 -> devices {3, 2}, node {1}
NODE_IDS = torch.tensor([[0, 6], [4, 5], [2, 3], [7, 4]])
NODE_DEV = contiguous_expert_device(8, 4)


def test_two_stage_rows_by_hand():
    stage1, stage2 = two_stage_rows(NODE_IDS, NODE_DEV, 4, nodes=2)
    # stage 1 goes to the gateway of the sender's local index: t0 0->0 (home) and 0->2; t1 1->3;
    # t2 2->0; t3 3->3 (home). 5 rows = sum of N_T (2 + 1 + 1 + 1).
    assert stage1.tolist() == [[1, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 1]]
    # stage 2 fans out inside the node: t0 at gateway 0 -> 0, at gateway 2 -> 3; t1 at 3 -> 2;
    # t2 at 0 -> 1; t3 at 3 -> 3 and 3 -> 2. 6 rows = sum of C_T (2 + 1 + 1 + 2).
    assert stage2.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 2, 1]]
    assert split_rows(stage1, 2) == {"kept": 2, "intra_node": 0, "cross_node": 3}
    assert split_rows(stage2, 2) == {"kept": 2, "intra_node": 4, "cross_node": 0}
    # flat: t0 0->0, 0->3; t1 1->2; t2 2->1; t3 3->3, 3->2: 3 rows cross nodes, 1 stays inside one
    assert split_rows(rows_matrix(NODE_IDS, NODE_DEV, 4), 2) == {"kept": 2, "intra_node": 1, "cross_node": 3}
    with pytest.raises(ValueError, match="nodes=3 does not divide devices=4"):
        two_stage_rows(NODE_IDS, NODE_DEV, 4, nodes=3)


def test_two_stage_prices_each_stage_on_its_link():
    shape = get_cluster("lab:dpn=2,nodes=2,intra=100,inter=10,latency=5")
    stage1, stage2 = two_stage_rows(NODE_IDS, NODE_DEV, 4, nodes=2)
    # 1 MB rows. Stage 1: every device sends and receives at most 1 row across nodes: 1 MB / 10 GB/s
    # = 0.1 ms, and its transpose the same. Stage 2: device 3 sends 2 rows to device 2 inside the node:
    # 2 MB / 100 GB/s = 0.02 ms, transpose the same. Four all-to-alls, 5 us latency each.
    expected = 0.1 + 0.1 + 0.02 + 0.02 + 4 * 0.005
    assert predict_two_stage_exchange_ms(stage1, stage2, MB, shape) == pytest.approx(expected)


def test_node_presets_and_predictions_order_the_exchanges():
    assert {"2x8-ib", "4x8-ib"} <= set(CLUSTER_PRESETS) and get_cluster("2x8-ib").num_devices == 16
    gen = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(2048, 64, generator=gen), dim=-1)
    shape = get_cluster("4x8-ib")
    out = predict_node_exchange(scores, 8, shape, 4096, node_budgets=(1, 2))
    ids = scores.topk(8, dim=-1).indices
    dev = contiguous_expert_device(64, 32)
    assert out["two_stage"]["rows_per_token"] == pytest.approx(node_comm_complexity(ids, dev, 32, 4))
    assert out["dedup"]["rows_per_token"] == pytest.approx(
        float(devices_per_token(ids, dev, 32).float().mean())
    )
    # across nodes: K > C_T-on-other-nodes > N_T-on-other-nodes
    cross = {k: v["cross_node_rows_per_token"] for k, v in out.items()}
    assert cross["per_expert"] > cross["dedup"] > cross["two_stage"] > cross["two_stage_nodes2"]
    assert out["two_stage_nodes1"]["rows_per_token"] == 1.0  # node budget 1: one node per token
    # without latency (bandwidth only) the two-stage exchange is fastest; with it, it pays 4 latencies
    # against 2 (64 tokens per device are few: here 4 x 30 us outweighs the bytes saved)
    bare = predict_node_exchange(scores, 8, get_cluster("bare:dpn=8,nodes=4,intra=450,inter=50"), 4096)
    assert bare["two_stage"]["exchange_ms"] < bare["dedup"]["exchange_ms"] < bare["per_expert"]["exchange_ms"]
    assert out["two_stage"]["exchange_ms"] - bare["two_stage"]["exchange_ms"] == pytest.approx(4 * 0.030)
    assert out["dedup"]["exchange_ms"] - bare["dedup"]["exchange_ms"] == pytest.approx(2 * 0.030)
    with pytest.raises(ValueError, match="node budget 0 cannot hold top-8"):
        predict_node_exchange(scores, 8, shape, 4096, node_budgets=(0,))
