"""`occult-ft bench` and occult_ft.bench: volumes by hand, a synthetic run and a tiny-model run on 2 gloo
processes, and one-line errors for bad inputs."""

import contextlib
import io
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import save_tiny_model

from occult_ft.bench import (
    BenchSettings,
    deepspeed_capacity,
    layer_volumes,
    pruned_name,
    routing_variants,
    synthetic_workload,
)
from occult_ft.bench.costmodel import rows_matrix, split_rows, token_ranks
from occult_ft.bench.exchanges import CollectiveClock, build_exchange
from occult_ft.cli import main
from occult_ft.metrics import contiguous_expert_device, device_counts, devices_per_token, expert_node

# DeepSpeed JIT-compiles a small op at its first distributed init; keep it in the repository's cache.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
)

REQUIRED = {"model", "devices", "tokens", "hidden", "dtype", "backends", "layers", "cost_model"}
TINY = ["--devices", 2, "--iters", 2, "--warmup", 1, "--json"]


def bench_json(*args) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["bench", *[str(a) for a in args]])
    assert status == 0
    return json.loads(out.getvalue())


def by_name(report: dict) -> dict:
    return {b["backend"]: b for b in report["backends"]}


# ---- volumes from the routing alone ---------------------------------------------------------------
def test_deepspeed_capacity_by_hand():
    # 2 ranks x 4 tokens, E=4, top-2. Rank 0 routes (0,1),(0,1),(0,2),(0,3): expert 0 gets 4 routes.
    # Rank 1 routes (2,3) four times. capacity = max(ceil(4 / 4 * 1.0 * 2), min_capacity 1) = 2.
    # Dropped: rank 0 expert 0 has 4 > 2 -> 2 dropped; rank 1 experts 2 and 3 have 4 each -> 2 + 2.
    ids = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]] + [[2, 3]] * 4)
    assert deepspeed_capacity(ids, 4, 2, 1.0, min_capacity=1) == (2, 6)
    # drop-free: the capacity is the largest (rank, expert) load, 4, and nothing is dropped
    assert deepspeed_capacity(ids, 4, 2, None) == (4, 0)
    # min_capacity wins for tiny batches (DeepSpeed's default 4 > 2)
    assert deepspeed_capacity(ids, 4, 2, 1.0)[0] == 4
    rows, dropped = layer_volumes(ids, "deepspeed_classic", 4, 2, capacity_factor=1.0, min_capacity=1)
    assert rows.tolist() == [[4, 4], [4, 4]] and dropped == 6  # C * E/D = 2 * 2 rows to each rank


def test_dedup_volume_is_comm_complexity_times_tokens():
    wl = synthetic_workload(num_experts=16, top_k=4, tokens=256, hidden=8, seed=3)
    ids = wl.layers[0].topk_ids_TK
    dev = contiguous_expert_device(16, 4)
    dedup, _ = layer_volumes(ids, "occult_dedup", 16, 4)
    naive, _ = layer_volumes(ids, "per_expert", 16, 4)
    assert int(dedup.sum()) == int(devices_per_token(ids, dev, 4).sum())
    assert int(naive.sum()) == 256 * 4


def test_pruned_variants_respect_the_budget_and_keep_fitting_tokens():
    wl = synthetic_workload(num_experts=16, top_k=4, tokens=256, hidden=8, seed=1)
    variants = routing_variants(wl, 4, budgets=(2, 1))
    dev = contiguous_expert_device(16, 4)
    base_ids = wl.layers[0].topk_ids_TK
    for m in (2, 1):
        ids, weights = variants[pruned_name(m)][0]
        assert int(devices_per_token(ids, dev, 4).max()) <= m
        fits = devices_per_token(base_ids, dev, 4) <= m
        assert torch.equal(ids[fits].sort(dim=1).values, base_ids[fits].sort(dim=1).values)
        assert torch.allclose(weights.sum(dim=1), torch.ones(256))  # renormalised gate weights
    assert variants["per_expert"][0][0] is variants["occult_dedup"][0][0]  # peers replay the same routing


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_per_expert_and_capacity_replica_exchanges_on_one_process(one_process_group):
    group = one_process_group
    wl = synthetic_workload(num_experts=8, top_k=2, tokens=40, hidden=6, seed=2)
    ids, w = wl.layers[0].topk_ids_TK, wl.layers[0].weights_TK
    x = torch.randn(40, 6)
    ref = (x[:, None, :] * w[..., None]).sum(dim=1)  # identity experts: sum_k w_k x
    per_expert = build_exchange("per_expert", x, ids, w, 8, group)
    assert per_expert.send_rows_D == [80] and "PerExpertExchange" in per_expert.implementation
    original = dist.all_to_all_single
    with CollectiveClock() as clock:
        assert dist.all_to_all_single is not original
        torch.testing.assert_close(per_expert.run(), ref)
    # occult_ft's exchanges skip the collectives of a one-rank group: nothing to time
    assert (clock.calls, clock.bytes) == (0, 0)
    # DeepSpeed's buffer rebuilt without deepspeed: C = max(ceil(40 / 8 * 1.0 * 2), 4) = 10 -> 8 * 10 rows
    replica = build_exchange("deepspeed_classic", x, ids, w, 8, group, deepspeed_error="forced in a test")
    assert replica.send_rows_D == [80] and "forced in a test" in replica.implementation
    assert (replica.capacity, replica.dropped_routes) == deepspeed_capacity(ids, 8, 1, 1.0)
    with CollectiveClock() as clock:
        replica.run()
    # 80 rows out + 80 rows back (equal splits), fp32 rows of 6: 2 * 80 * 6 * 4 bytes, 2 collectives
    assert (clock.calls, clock.bytes) == (2, 2 * 80 * 6 * 4)
    assert dist.all_to_all_single is original  # the wrappers are removed again
    nodrop = build_exchange("deepspeed_classic_nodrop", x, ids, w, 8, group, deepspeed_error="forced")
    assert nodrop.dropped_routes == 0 and nodrop.capacity == deepspeed_capacity(ids, 8, 1, None)[0]
    torch.testing.assert_close(nodrop.run(), ref)


def test_two_stage_exchange_on_one_process(one_process_group):
    from occult_ft.dispatch import node_groups

    wl = synthetic_workload(num_experts=8, top_k=2, tokens=40, hidden=6, seed=2)
    ids, w = wl.layers[0].topk_ids_TK, wl.layers[0].weights_TK
    x = torch.randn(40, 6)
    groups = node_groups(1, one_process_group)
    two = build_exchange("occult_two_stage", x, ids, w, 8, one_process_group, node_groups=groups)
    # one node of one device: every token is one row in each stage, and comes back unchanged
    assert two.send_rows_D == [40] and two.stage2_rows_D == [40]
    torch.testing.assert_close(two.run(), x)
    with pytest.raises(RuntimeError, match="needs node groups"):
        build_exchange("occult_two_stage", x, ids, w, 8, one_process_group)


# ---- end to end, 2 gloo processes ----------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic_report():
    return bench_json("--synthetic", "--experts", 8, "--top-k", 2, "--tokens", 64, "--hidden", 16, *TINY)


def test_synthetic_json_has_the_contract_keys(synthetic_report):
    r = synthetic_report
    assert REQUIRED <= set(r)
    assert (r["model"], r["devices"], r["tokens"], r["hidden"], r["dtype"]) == (
        "synthetic",
        2,
        64,
        16,
        "bfloat16",
    )
    names = [b["backend"] for b in r["backends"]]
    assert names[:5] == [
        "deepspeed_classic",
        "deepspeed_classic_nodrop",
        "per_expert",
        "hf_native_ep",
        "occult_dedup",
    ]
    assert {"occult_dedup_prune2", "occult_dedup_prune1"} <= set(names)
    for b in r["backends"]:
        assert {"backend", "rows_per_token", "exchange_ms", "rows", "bytes", "speedup_vs_best_peer"} <= set(b)
        if b["measured"]:
            assert 0 < b["exchange_ms"] <= b["path_ms"]  # the collectives run inside the path
            assert b["collective_bytes"] >= b["bytes"]  # payload plus split sizes / ids / weights
        else:
            assert b["reason"]  # says why it was not measured
    for name in ("deepspeed_classic", "per_expert", "occult_dedup", "occult_dedup_prune1"):
        assert by_name(r)[name]["measured"], by_name(r)[name].get("reason")
    hf = by_name(r)["hf_native_ep"]
    if hf[
        "measured"
    ]:  # transformers' own AllToAllEP moves at least the per-expert payload (k rows per token)
        assert hf["collective_bytes"] >= by_name(r)["per_expert"]["bytes"]


def test_rows_per_token_is_k_for_per_expert_and_comm_complexity_for_dedup(synthetic_report):
    r = synthetic_report
    b = by_name(r)
    layer = r["layers"][0]
    assert b["per_expert"]["rows_per_token"] == 2 and b["hf_native_ep"]["rows_per_token"] == 2
    assert b["occult_dedup"]["rows_per_token"] == pytest.approx(layer["comm_complexity"], abs=1e-12)
    assert b["occult_dedup"]["rows"] == round(layer["comm_complexity"] * r["tokens"])
    assert r["targets"]["rows_equal_comm_complexity_x_tokens"] is True
    assert b["occult_dedup_prune2"]["rows_per_token"] <= 2
    assert b["occult_dedup_prune1"]["rows_per_token"] == 1
    # the same routing rebuilt in the test: rows == sum over tokens of C_T
    ids = synthetic_workload(8, 2, 64, 16, seed=0).layers[0].topk_ids_TK
    assert b["occult_dedup"]["rows"] == int(devices_per_token(ids, contiguous_expert_device(8, 2), 2).sum())
    # bytes are dispatch + combine payload: 2 x rows x hidden x 2 (bf16)
    assert b["occult_dedup"]["bytes"] == 2 * b["occult_dedup"]["rows"] * 16 * 2


def test_backends_carry_their_kind_and_budget(synthetic_report):
    # the budget is a field of every row (None when the backend does not prune), not only a name suffix
    kinds = {
        "deepspeed_classic": ("capacity", None),
        "deepspeed_classic_nodrop": ("capacity", None),
        "per_expert": ("per_expert", None),
        "hf_native_ep": ("per_expert", None),
        "occult_dedup": ("dedup", None),
        "occult_dedup_capacity": ("dedup_capacity", None),
        pruned_name(2): ("dedup", 2),
        pruned_name(1): ("dedup", 1),
    }
    got = {b["backend"]: (b["kind"], b["max_devices_per_token"]) for b in synthetic_report["backends"]}
    assert got == kinds
    for cluster in synthetic_report["cost_model"]["clusters"]:
        for p in cluster.get("backends", []):
            assert (p["kind"], p["max_devices_per_token"]) == kinds[p["backend"]]
    assert {"kind", "max_devices_per_token"} <= set(synthetic_report["definitions"])


def test_deepspeed_sends_its_dense_capacity_buffer(synthetic_report):
    b = by_name(synthetic_report)
    # 32 tokens per process, E=8, top-2: C = max(ceil(32 / 8 * 1.0 * 2), 4) = 8 -> E * C = 64 rows per process
    assert b["deepspeed_classic"]["rows"] == 2 * 64
    assert 0 <= b["deepspeed_classic"]["dropped_share"] < 1
    assert b["deepspeed_classic_nodrop"]["dropped_share"] == 0
    assert b["deepspeed_classic_nodrop"]["rows_per_token"] >= 2


def test_cost_model_covers_the_presets(synthetic_report):
    clusters = {c["name"]: c for c in synthetic_report["cost_model"]["clusters"]}
    assert set(clusters) == {"8xH100-nvlink", "4xA6000-pcie", "2x8-ib", "4x8-ib"}
    assert "skipped" in clusters["4x8-ib"] and "skipped" in clusters["2x8-ib"]  # 32, 16 devices, 8 experts
    preds = {p["backend"]: p for p in clusters["4xA6000-pcie"]["backends"]}
    assert preds["occult_dedup"]["predicted_ms"] < preds["per_expert"]["predicted_ms"]
    assert preds["occult_dedup_prune1"]["rows_per_token"] == 1


# ---- end to end, 4 gloo processes as 2 nodes x 2 ----------------------------------------------------
NODE_BACKENDS = "per_expert,occult_dedup,occult_two_stage,occult_two_stage_prune2"


@pytest.fixture(scope="module")
def nodes_report():
    return bench_json(
        "--synthetic",
        *("--experts", 16, "--top-k", 3, "--tokens", 64, "--hidden", 16, "--devices", 4, "--nodes", 2),
        *("--iters", 1, "--warmup", 0, "--json", "--backends", NODE_BACKENDS),
        *("--cluster", "2x8-ib", "--cluster", "lab:dpn=2,nodes=2,intra=100,inter=10"),
    )


@pytest.mark.slow
def test_two_stage_rows_crossing_nodes_are_the_node_level_count(nodes_report):
    r, b = nodes_report, by_name(nodes_report)
    assert r["nodes"] == 2 and list(b) == NODE_BACKENDS.split(",")
    ids = synthetic_workload(16, 3, 64, 16, seed=0).layers[0].topk_ids_TK
    dev = contiguous_expert_device(16, 4)
    # node level, by hand from the routing: N_T per token, and the nodes other than the token's own
    present_TN = device_counts(ids, expert_node(dev, 4, 2), 2) > 0
    own_T = token_ranks(64, 4) // 2
    node_rows = int(present_TN.sum())
    remote_node_rows = node_rows - int(present_TN[torch.arange(64), own_T].sum())
    two = b["occult_two_stage"]
    assert two["measured"], two.get("reason")
    assert two["rows"] == node_rows == round(r["layers"][0]["node_comm_complexity"] * 64)
    assert two["node_comm_complexity"] == pytest.approx(node_rows / 64)
    assert two["cross_node_rows"] == remote_node_rows
    assert two["stage2_rows"] == int(devices_per_token(ids, dev, 4).sum())  # fan-out: one row per device
    assert r["targets"]["cross_node_rows_equal_node_count"] is True
    # flat and per-expert exchanges: their cross-node rows are those of their (D, D) matrices
    for name, dedup in (("occult_dedup", True), ("per_expert", False)):
        split = split_rows(rows_matrix(ids, dev, 4, dedup=dedup), 2)
        assert (b[name]["cross_node_rows"], b[name]["intra_node_rows"]) == (
            split["cross_node"],
            split["intra_node"],
        )
        assert b[name]["cross_node_bytes"] == 2 * split["cross_node"] * 16 * 2  # both ways, bf16 rows of 16
    assert two["cross_node_rows"] < b["occult_dedup"]["cross_node_rows"] < b["per_expert"]["cross_node_rows"]
    assert b["occult_two_stage_prune2"]["cross_node_rows"] <= two["cross_node_rows"]
    lab = next(c for c in r["cost_model"]["clusters"] if c["name"] == "lab")
    preds = {p["backend"]: p for p in lab["backends"]}
    assert preds["occult_two_stage"]["cross_node_MB"] < preds["occult_dedup"]["cross_node_MB"]
    assert preds["occult_two_stage"]["cross_node_MB"] == pytest.approx(2 * remote_node_rows * 32 / 1e6)


@pytest.mark.slow
def test_bench_on_a_tiny_saved_model(tmp_path, tiny_tokenizer, text_file):
    model_dir = save_tiny_model(tmp_path / "olmoe", "olmoe", tiny_tokenizer)
    plot = tmp_path / "bench.png"
    r = bench_json(
        model_dir,
        "--data",
        text_file,
        "--max-tokens",
        96,
        "--seq-len",
        32,
        "--cluster",
        "4xA6000-pcie",
        "--cluster",
        "lab:devices_per_node=2,intra=50",
        "--plot",
        plot,
        *TINY,
    )
    assert REQUIRED <= set(r)
    assert r["model"] == model_dir and r["hidden"] == 64 and r["moe_layers"] == [0, 1] and r["tokens"] == 96
    b = by_name(r)
    assert b["per_expert"]["rows_per_token"] == 2
    cc = sum(layer["comm_complexity"] for layer in r["layers"]) / 2
    assert b["occult_dedup"]["rows_per_token"] == pytest.approx(cc, abs=1e-12)
    assert b["occult_dedup_prune1"]["rows_per_token"] == 1
    assert all(b[n]["measured"] for n in ("per_expert", "occult_dedup", "occult_dedup_prune1"))
    assert all(math.isfinite(b[n]["exchange_ms"]) for n in b if b[n]["measured"])
    assert [c["name"] for c in r["cost_model"]["clusters"]] == ["4xA6000-pcie", "lab"]
    assert plot.stat().st_size > 0


# ---- bad inputs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--synthetic", "--devices", 3, "--experts", 8],
            "devices=3 must divide the 8 experts; use one of [1, 2, 4, 8]",
        ),
        (["--synthetic", "--devices", 1], "the exchange needs at least 2 processes"),
        (
            ["--synthetic", "--devices", 2, "--cluster", "dgx-h900"],
            "unknown cluster 'dgx-h900'; choose one of",
        ),
        (["--synthetic", "--devices", 2, "--tokens", 1], "1 tokens cannot be shared by 2 processes"),
        (
            ["--synthetic", "--devices", 4, "--nodes", 3],
            "nodes=3 does not divide devices=4; use one of [1, 2, 4]",
        ),
        (
            ["--synthetic", "--devices", 2, "--experts", 8, "--tokens", 8, "--backends", "occult_two_stage"],
            "unknown or unmeasurable backends ['occult_two_stage']",
        ),
        (["--synthetic", "some/model", "--devices", 2], "--synthetic takes no MODEL"),
        (["--devices", 2], "give MODEL --data DATA, or --synthetic"),
        (
            ["--synthetic", "--devices", 2, "--experts", 8, "--tokens", 8, "--backends", "tutel"],
            "unknown or unmeasurable backends ['tutel']",
        ),
    ],
)
def test_bad_inputs_give_one_line_errors(args, message, capsys):
    assert main(["bench", *[str(a) for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_devices_default_to_4_or_one_process_per_node():
    from occult_ft.commands.bench import default_devices

    assert [default_devices(n) for n in (1, 2, 4)] == [4, 4, 4]  # 1 x 4, 2 x 2, 4 x 1
    assert [default_devices(n) for n in (3, 8)] == [3, 8]  # one process per node


@pytest.mark.parametrize(
    "args, message",
    [
        # the errors name the D chosen without --devices: 4, and 3 for 3 nodes
        (
            ["--train", "--tokens", "512"],
            "micro_batch_tokens=512 must be a multiple of devices x seq_len = 1024",
        ),
        (["--train", "--nodes", "3"], "devices=3 must divide the 64 experts"),
        (["--synthetic", "--experts", "6"], "devices=4 must divide the 6 experts"),
    ],
)
def test_devices_is_optional_and_resolved_before_the_settings_are_checked(args, message, capsys):
    assert main(["bench", *args, "--cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_model_without_data_and_bad_settings_are_rejected(capsys, tmp_path):
    assert main(["bench", str(tmp_path / "nowhere"), "--devices", "2"]) == 2
    assert "needs --data" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype='int8' is unknown"):
        BenchSettings(devices=2, dtype="int8")
