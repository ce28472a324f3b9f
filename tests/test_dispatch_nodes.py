"""The two-stage (node-aware) exchange: a token crosses the network once per node.

Single-process tests check the stage-2 (fan-out) plan on a worked example. The multi-process tests run 4 gloo
processes as 2 nodes x 2 devices (ranks 0, 1 on node 0; ranks 2, 3 on node 1) with 8 experts (P = 2,
node 0 holds experts 0-3, node 1 experts 4-7): the two-stage layer must equal the flat exchange and
the single-process oracle in outputs and gradients (fp32, 1e-5), and the rows it sends must be the
ones the pure simulator `occult_ft.bench.costmodel.two_stage_rows` predicts, with exactly sum over tokens of
N_T rows on the inter-node stage. Two cases also run on 8 processes as 2 nodes x 4 devices (P = 1).

Shape legend: T tokens, K experts per token, H hidden size, E experts, D ranks, N nodes, L = D / N.
"""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch

try:
    from .dist_utils import run_distributed
    from .test_dispatch_dist import NUM_EXPERTS, _close, _full_experts, _gather_dim0, _grad
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import run_distributed
    from test_dispatch_dist import NUM_EXPERTS, _close, _full_experts, _gather_dim0, _grad

NODES = 2
# name -> case; "tokens" lists each rank's token count (len = world size 4).
CASES_2X2 = {
    "random_routing_top3": dict(arch="qwen3_moe", tokens=[3, 5, 4, 6], top_k=3, routing="random"),
    "all_experts_on_own_node": dict(arch="olmoe", tokens=[4, 3, 5, 2], top_k=3, routing="own_node"),
    "all_experts_on_other_node": dict(arch="olmoe", tokens=[2, 4, 3, 3], top_k=2, routing="other_node"),
    "zero_tokens_on_a_rank": dict(arch="olmoe", tokens=[5, 0, 3, 4], top_k=2, routing="random"),
    "gpt_oss_layout": dict(arch="gpt_oss", tokens=[2, 3, 1, 4], top_k=2, routing="random"),
}
# 8 processes as 2 nodes x 4 devices (P = 1: node 0 holds experts 0-3 on ranks 0-3)
CASES_2X4 = {
    "random_routing_top3": dict(arch="olmoe", tokens=[3, 2, 4, 1, 2, 3, 0, 2], top_k=3, routing="random"),
    "all_experts_on_other_node": dict(
        arch="olmoe", tokens=[1, 2, 1, 2, 2, 1, 2, 1], top_k=2, routing="other_node"
    ),
}


def test_fanout_plan_worked_example():
    from occult_ft.dispatch.plan import layout_from_plan, row_plan
    from occult_ft.layout import ExpertLayout

    # A gateway of a node with L=2 devices, P=2 experts each (node-local ids 0..3), 3 received rows:
    #   row 0: ids [1, -1] -> device 0 only          row 1: ids [2, 0] -> devices 0 and 1
    #   row 2: ids [-1, 3] -> device 1 only
    ids_RK = torch.tensor([[1, -1], [2, 0], [-1, 3]])
    w_RK = torch.tensor([[0.6, 0.0], [0.3, 0.7], [0.0, 0.5]])
    # what TwoStageExchange.dispatch plans at a gateway: node-local ids, -1 for other nodes' experts
    plan = row_plan(ids_RK, w_RK, ExpertLayout(4, 2), rank=1, sentinel_in=True)
    layout = layout_from_plan(plan, tuple(plan.meta_DC[:, 0].tolist()))
    assert plan.meta_DC[:, -1].tolist() == [0, 0]  # -1 is no bad id in a fan-out stage
    # device-major: device 0 gets rows 0, 1; device 1 gets rows 1, 2
    assert layout.send_token_idx_S.tolist() == [0, 1, 1, 2]
    assert layout.send_splits == (2, 2) and layout.rows_sent == 4 and layout.rows_kept_local == 2
    # local ids on the destination: row 1 on device 0 keeps slot 1 (expert 0), on device 1 slot 0 (2 -> 0)
    assert layout.send_local_ids_SK.tolist() == [[1, -1], [-1, 0], [0, -1], [-1, 1]]
    expected_weights = torch.tensor([[0.6, 0], [0, 0.7], [0.3, 0], [0, 0.5]])
    torch.testing.assert_close(layout.send_weights_SK, expected_weights)


def test_single_process_two_stage_equals_local_layer():
    """Without torch.distributed (D = 1, N = 1) the two-stage layer is the single-device layer."""
    from occult_ft.dispatch import TwoStageExchange, local_moe_forward, moe_forward, node_groups
    from occult_ft.layout import ExpertLayout

    experts = _full_experts("olmoe", seed=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, experts.down_proj.shape[1], generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=gen)
    exchange = TwoStageExchange(ExpertLayout(NUM_EXPERTS, 1, 1), node_groups(1))
    out = moe_forward(x, ids, w, experts, exchange)
    torch.testing.assert_close(out, local_moe_forward(x, ids, w, experts), rtol=1e-5, atol=1e-5)
    _, _, handle = exchange.dispatch(x, ids, w)
    assert handle.node_rows == 5 and handle.cross_node_rows == 0 and handle.intra_node_rows == 0


def test_nodes_must_divide_the_ranks():
    from occult_ft.dispatch import TwoStageExchange, node_groups
    from occult_ft.layout import ExpertLayout

    with pytest.raises(ValueError, match=r"nodes=2 does not divide devices=1; use one of \[1\]"):
        node_groups(2)
    with pytest.raises(ValueError, match=r"node groups of 1 x 1 ranks do not match the layout's 2 nodes"):
        TwoStageExchange(ExpertLayout(NUM_EXPERTS, 2, 2), node_groups(1))


# ---- multi-process (run inside the workers) -----------------------------------------------------
def _routing(routing: str, token_rank: list[int], top_k: int, world: int, gen: torch.Generator):
    per_node = NUM_EXPERTS // NODES
    rows = []
    for rank in token_rank:
        node = rank // (world // NODES)
        if routing == "random":
            rows.append(torch.randperm(NUM_EXPERTS, generator=gen)[:top_k])
        elif routing in ("own_node", "other_node"):
            target = node if routing == "own_node" else 1 - node
            rows.append(target * per_node + torch.randperm(per_node, generator=gen)[:top_k])
        else:
            raise ValueError(routing)
    return torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.long)


def _case(rank: int, world: int, case: dict) -> list[str]:
    import torch.distributed as dist

    from occult_ft.bench.costmodel import split_rows, two_stage_rows
    from occult_ft.dispatch import (
        FlatExchange,
        TwoStageExchange,
        experts_module_fn,
        moe_forward,
        node_groups,
        reference_moe,
        shard_experts_module,
    )
    from occult_ft.layout import ExpertLayout
    from occult_ft.metrics import contiguous_expert_device, nodes_per_token
    from occult_ft.models import get_arch

    failures: list[str] = []
    full = _full_experts(case["arch"], seed=1)
    hidden_size = full.down_proj.shape[2] if full.is_transposed else full.down_proj.shape[1]
    gen = torch.Generator().manual_seed(2)
    total, top_k = sum(case["tokens"]), case["top_k"]
    token_rank = [r for r, n in enumerate(case["tokens"]) for _ in range(n)]
    x_all = torch.randn(total, hidden_size, generator=gen)
    ids_all = _routing(case["routing"], token_rank, top_k, world, gen)
    w_all = torch.rand(total, top_k, generator=gen) + 0.1
    g_all = torch.randn(total, hidden_size, generator=gen)

    x_ref, w_ref = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    out_ref = reference_moe(x_ref, ids_all, w_ref, experts_module_fn(full))
    (out_ref * g_all).sum().backward()

    start = sum(case["tokens"][:rank])
    mine = slice(start, start + case["tokens"][rank])
    names = get_arch(case["arch"]).expert_params
    results = {}
    for mode in ("flat", "two_stage"):
        local = copy.deepcopy(full)
        local.zero_grad(set_to_none=True)
        shard_experts_module(local, names)
        x, w = x_all[mine].clone().requires_grad_(), w_all[mine].clone().requires_grad_()
        if mode == "flat":
            exchange = FlatExchange(ExpertLayout(NUM_EXPERTS, world))
        else:
            exchange = TwoStageExchange(ExpertLayout(NUM_EXPERTS, world, NODES), node_groups(NODES))
        out = moe_forward(x, ids_all[mine], w, local, exchange)
        (out * g_all[mine]).sum().backward()
        _, _, handle = exchange.dispatch(x_all[mine], ids_all[mine], w_all[mine])
        grads = {}
        for name in names:
            grad = getattr(local, name).grad
            if grad is None:
                failures.append(f"{mode}: expert shard {name} got no gradient")
                grad = torch.zeros_like(getattr(local, name))
            grads[name] = _gather_dim0(grad, world)
        results[mode] = (out.detach(), _grad(x), _grad(w), grads, handle)

    # Volumes: this rank's stage-1 and stage-2 rows against the pure simulator (all tokens, all ranks).
    handle = results["two_stage"][4]
    stage1_DD, stage2_DD = two_stage_rows(
        ids_all, contiguous_expert_device(NUM_EXPERTS, world), world, NODES, torch.tensor(token_rank)
    )
    local_size = world // NODES
    node, local_rank = rank // local_size, rank % local_size
    gateways = [m * local_size + local_rank for m in range(NODES)]
    if list(handle.node_layout.send_splits) != stage1_DD[rank, gateways].tolist():
        failures.append(
            f"stage 1 splits {handle.node_layout.send_splits} != simulated {stage1_DD[rank, gateways]}"
        )
    in_node = list(range(node * local_size, (node + 1) * local_size))
    if list(handle.device_layout.send_splits) != stage2_DD[rank, in_node].tolist():
        failures.append(
            f"stage 2 splits {handle.device_layout.send_splits} != simulated {stage2_DD[rank, in_node]}"
        )
    counts = torch.tensor([handle.node_rows, handle.cross_node_rows, handle.intra_node_rows])
    dist.all_reduce(counts)
    n_t = nodes_per_token(ids_all, contiguous_expert_device(NUM_EXPERTS, world), world, NODES)
    s1, s2 = split_rows(stage1_DD, local_size), split_rows(stage2_DD, local_size)
    # stage 1 moves sum of N_T rows, and (stage 1 never moves rows inside a node) the rest stay home
    if counts.tolist() != [int(n_t.sum()), s1["cross_node"], s2["intra_node"]] or s1["intra_node"] != 0:
        failures.append(
            f"rows (node, cross, intra) {counts.tolist()}; sum N_T {int(n_t.sum())}, sim {s1}, {s2}"
        )
    if s2["cross_node"] != 0:
        failures.append(f"stage 2 crossed nodes: {s2}")

    flat, two = results["flat"], results["two_stage"]
    for i, what in enumerate(("output", "hidden grad", "router weight grad")):
        _close(failures, f"two-stage vs flat {what}", two[i], flat[i])
    _close(failures, "two-stage output vs reference", two[0], out_ref[mine].detach())
    _close(failures, "two-stage hidden grad vs reference", two[1], _grad(x_ref)[mine])
    _close(failures, "two-stage router grad vs reference", two[2], _grad(w_ref)[mine])
    for name in names:
        _close(failures, f"two-stage vs flat {name} grad", two[3][name], flat[3][name])
        _close(failures, f"two-stage {name} grad vs reference", two[3][name], _grad(getattr(full, name)))
    return failures


def _model_case(rank: int, world: int, arch: str) -> list[str]:
    """A stock tiny model sharded with shard_experts(model, nodes=2) ("occult_ep" kernel, two-stage
    exchange) against the unsharded model on the concatenated batch: loss, logits and every gradient."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from occult_ft.dispatch import expert_shard_parameters, shard_experts
    from occult_ft.models import find_moe_layers, tiny_config

    failures: list[str] = []
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    batch_all = torch.randint(3, model.config.vocab_size, (world, 8), generator=gen)
    ref_out = reference(input_ids=batch_all, labels=batch_all)
    ref_out.loss.backward()

    shard_experts(model, nodes=NODES)
    if any(layer.experts.occult_shard.nodes != NODES for layer in find_moe_layers(model)):
        failures.append("the shards do not record nodes=2")
    out = model(input_ids=batch_all[rank : rank + 1], labels=batch_all[rank : rank + 1])
    out.loss.backward()
    # equal tokens per rank: reference loss = mean of rank losses; gradients as in test_dispatch_dist
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    shard_names = {n for n, _ in expert_shard_parameters(model)}
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if name in shard_names:
            grad = _gather_dim0(grad, world) / world
        else:
            dist.all_reduce(grad)
            grad = grad / world
        ref_grad = ref_params[name].grad
        _close(failures, f"grad {name}", grad, ref_grad if ref_grad is not None else torch.zeros_like(grad))
    _close(failures, "loss", loss / world, ref_out.loss.detach())
    _close(failures, "logits", out.logits.detach(), ref_out.logits[rank : rank + 1].detach())
    return failures


def _worker(rank: int, world: int, cases: dict, with_model: bool = True) -> dict[str, list[str]]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, list[str]] = {}
    for name, case in cases.items():
        try:
            results[name] = _case(rank, world, case)
        except Exception:
            results[name] = [traceback.format_exc()]
    if with_model:
        try:
            results["olmoe_model"] = _model_case(rank, world, "olmoe")
        except Exception:
            results["olmoe_model"] = [traceback.format_exc()]
    return results


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_worker, 4, CASES_2X2, timeout=300)


@pytest.fixture(scope="module")
def world8():
    return run_distributed(_worker, 8, CASES_2X4, False, timeout=600, collective_timeout_s=120)


def _failures(per_rank: list[dict[str, list[str]]], name: str) -> str:
    return "\n".join(f"rank {r}: {msg}" for r, res in enumerate(per_rank) for msg in res[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_2X2))
def test_two_nodes_of_two_devices_match_flat_exchange(world4, name):
    assert not _failures(world4, name), _failures(world4, name)


@pytest.mark.slow
@pytest.mark.extended  # 8 processes; the 2 x 2 layout above runs the same exchange in `make test`
@pytest.mark.parametrize("name", list(CASES_2X4))
def test_two_nodes_of_four_devices_match_flat_exchange(world8, name):
    assert not _failures(world8, name), _failures(world8, name)


@pytest.mark.slow
def test_sharded_model_with_two_stage_kernel_matches_concatenated_batch(world4):
    assert not _failures(world4, "olmoe_model"), _failures(world4, "olmoe_model")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(exchange="two_stage"), "exchange='two_stage' needs nodes > 1 (got nodes=1)"),
        (
            dict(exchange="hierarchical", nodes=2),
            "exchange='hierarchical' is unknown; choose one of flat, two_stage, per_expert",
        ),
    ],
)
def test_exchange_config_field(overrides, message, tmp_path):
    from occult_ft.trainer import OccultConfig

    common = dict(output_dir=str(tmp_path), devices=4, use_cpu=True, report_to="none")
    assert OccultConfig(**common, nodes=2, exchange="two_stage").exchange == "two_stage"
    assert OccultConfig(**common).exchange == "flat"
    with pytest.raises(ValueError) as err:
        OccultConfig(**common, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
