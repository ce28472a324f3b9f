"""Single-process tests of occult_ft.dispatch: the layout worked out by hand, the grouped local
compute against the loop oracle for every registered architecture's expert layout, the D = 1 path of
the de-duplicated forward, and the transformers integration on one rank. Multi-process tests live in
`test_dispatch_dist.py`.

Shape legend: T tokens, K experts per token, H hidden size, E experts, D devices, S rows sent.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from occult_ft.dispatch import (
    EXPERTS_IMPLEMENTATION,
    FlatExchange,
    expert_shard_parameters,
    experts_module_fn,
    gather_experts,
    gather_experts_state_dict,
    local_experts_forward,
    local_moe_forward,
    moe_forward,
    reference_moe,
    shard_experts,
)
from occult_ft.dispatch.plan import LOCAL_SENTINEL, capacity_layout, layout_from_plan, row_plan
from occult_ft.layout import ExpertLayout
from occult_ft.metrics import contiguous_expert_device, device_load, devices_per_token
from occult_ft.models import CORE_MODEL_TYPES, find_moe_layers, get_arch, tiny_config

ARCHS = list(CORE_MODEL_TYPES)
BACKENDS = ["loop"] + (["grouped_mm"] if hasattr(F, "grouped_mm") else [])
TOL = dict(rtol=1e-5, atol=1e-5)


# ---- fixtures -----------------------------------------------------------------------------------
@functools.cache
def _cached_experts(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    experts = find_moe_layers(model)[0].experts
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return experts


def _experts(arch: str) -> torch.nn.Module:
    """A fresh copy (own parameters and gradients) of a tiny `arch` experts module with 8 experts."""
    return copy.deepcopy(_cached_experts(arch))


def _hidden_size(experts: torch.nn.Module) -> int:
    return experts.down_proj.shape[2] if experts.is_transposed else experts.down_proj.shape[1]


def _routing(num_tokens: int, top_k: int, num_experts: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return ids_TK, torch.rand(num_tokens, top_k, generator=gen) + 0.1


def _run(fn, experts, hidden_TH, ids_TK, weights_TK, seed: int = 1):
    """Forward + backward of fn under a fixed upstream gradient; returns output and all gradients."""
    x = hidden_TH.clone().requires_grad_()
    w = weights_TK.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = fn(x, ids_TK, w, experts)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * upstream).sum().backward()
    grads = {name: p.grad for name, p in experts.named_parameters()}
    return out.detach(), x.grad, w.grad, grads


def _oracle(x, ids, w, experts):
    return reference_moe(x, ids, w, experts_module_fn(experts))


def _layout(ids_TK, weights_TK, num_experts: int, num_devices: int, rank: int):
    """The de-duplicated layout of rank `rank`'s tokens, planned alone (as `FlatExchange.dispatch` does
    before its count exchange; the send counts read here are what that exchange reads)."""
    plan = row_plan(ids_TK, weights_TK, ExpertLayout(num_experts, num_devices), rank)
    return layout_from_plan(plan, tuple(plan.meta_DC[:, 0].tolist()))


def _flat_forward(x_TH, ids_TK, w_TK, experts):
    """One layer through the flat exchange of all the experts on this one rank (D = 1)."""
    return moe_forward(x_TH, ids_TK, w_TK, experts, FlatExchange(ExpertLayout(8, 1)))


def _assert_same_run(actual, expected):
    out, gx, gw, gp = actual
    out_ref, gx_ref, gw_ref, gp_ref = expected
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(gx, gx_ref, **TOL)
    torch.testing.assert_close(gw, gw_ref, **TOL)
    assert gp.keys() == gp_ref.keys()
    for name in gp:
        torch.testing.assert_close(gp[name], gp_ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


# ---- layout -------------------------------------------------------------------------------------
def test_layout_worked_example_from_the_docstring():
    # E=4, D=2 -> P=2: experts {0,1} on device 0, {2,3} on device 1.
    ids_TK = torch.tensor([[0, 1], [1, 2], [3, 2]])
    w_TK = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    layout = _layout(ids_TK, w_TK, num_experts=4, num_devices=2, rank=0)
    # devices per slot: [[0,0],[0,1],[1,1]] -> token 0 reaches {0}, token 1 {0,1}, token 2 {1}.
    # Device-major send order: device 0 gets tokens 0, 1; device 1 gets tokens 1, 2.
    assert layout.send_token_idx_S.tolist() == [0, 1, 1, 2]
    assert layout.send_device_S.tolist() == [0, 0, 1, 1]
    assert layout.send_counts_D.tolist() == [2, 2] and layout.send_splits == (2, 2)
    # Token 1 -> device 0 keeps only slot 0 (expert 1 = local 1); -> device 1 only slot 1 (expert 2 = local 0).
    assert layout.send_local_ids_SK.tolist() == [[0, 1], [1, -1], [-1, 0], [1, 0]]
    torch.testing.assert_close(
        layout.send_weights_SK, torch.tensor([[0.6, 0.4], [0.7, 0.0], [0.0, 0.3], [0.5, 0.5]])
    )
    # 4 rows instead of 3 tokens * 2 experts = 6; C_T mean = 4 / 3.
    assert layout.rows_sent == 4 and layout.naive_rows == 6
    assert layout.comm_complexity == pytest.approx(4 / 3)
    assert layout.rows_kept_local == 2  # rank 0 keeps its 2 device-0 rows


def test_layout_sends_token_once_per_device_however_many_experts_live_there():
    # E=8, D=4 -> P=2: device d holds experts {2d, 2d+1}. K=4.
    ids_TK = torch.tensor([[0, 1, 2, 3], [6, 7, 0, 4], [1, 3, 5, 7]])
    layout = _layout(ids_TK, torch.ones(3, 4), num_experts=8, num_devices=4, rank=1)
    # token 0: devices 0,0,1,1 -> 2 rows; token 1: 3,3,0,2 -> 3 rows; token 2: 0,1,2,3 -> 4 rows.
    # device 0 gets tokens 0,1,2; device 1: 0,2; device 2: 1,2; device 3: 1,2.
    assert layout.send_splits == (3, 2, 2, 2)
    assert layout.send_token_idx_S.tolist() == [0, 1, 2, 0, 2, 1, 2, 1, 2]
    assert layout.rows_sent == 9 and layout.naive_rows == 12 and layout.comm_complexity == 3.0
    # Local ids (P=2): expert e on device e // 2 is local e % 2; other devices' slots are -1.
    assert layout.send_local_ids_SK.tolist() == [
        [0, 1, -1, -1],  # token 0 -> device 0: experts 0, 1
        [-1, -1, 0, -1],  # token 1 -> device 0: expert 0 (slot 2)
        [1, -1, -1, -1],  # token 2 -> device 0: expert 1
        [-1, -1, 0, 1],  # token 0 -> device 1: experts 2, 3
        [-1, 1, -1, -1],  # token 2 -> device 1: expert 3
        [-1, -1, -1, 0],  # token 1 -> device 2: expert 4
        [-1, -1, 1, -1],  # token 2 -> device 2: expert 5
        [0, 1, -1, -1],  # token 1 -> device 3: experts 6, 7
        [-1, -1, -1, 1],  # token 2 -> device 3: expert 7
    ]
    assert layout.rows_kept_local == 2  # rank 1's own device-1 rows


def test_layout_rows_sent_is_the_sum_of_comm_complexity():
    ids_TK, w_TK = _routing(50, 4, num_experts=16, seed=3)
    layout = _layout(ids_TK, w_TK, num_experts=16, num_devices=4, rank=0)
    expert_device = contiguous_expert_device(16, 4)
    assert layout.rows_sent == int(devices_per_token(ids_TK, expert_device, 4).sum())
    assert layout.send_splits == tuple(device_load(ids_TK, expert_device, 4).tolist())
    # Every (token, slot) is live (non-sentinel) in exactly one row.
    assert int((layout.send_local_ids_SK != LOCAL_SENTINEL).sum()) == 50 * 4


def test_layout_with_zero_tokens():
    layout = _layout(torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), 8, 2, rank=1)
    assert layout.send_splits == (0, 0) and layout.rows_sent == 0 and layout.comm_complexity == 0.0
    assert layout.send_local_ids_SK.shape == (0, 2) and layout.send_weights_SK.shape == (0, 2)


def test_layout_on_one_device_sends_each_token_once_unchanged():
    ids_TK, w_TK = _routing(6, 2)
    x_TH = torch.randn(6, 4)
    recv_x_RH, recv_w_RK, handle = FlatExchange(ExpertLayout(8, 1)).dispatch(x_TH, ids_TK, w_TK)
    layout = handle.layout
    assert torch.equal(recv_x_RH, x_TH) and torch.equal(recv_w_RK, w_TK)
    assert torch.equal(handle.recv_local_ids_RJ, ids_TK) and handle.expert_counts == (
        tuple(torch.bincount(ids_TK.reshape(-1), minlength=8).tolist())
    )
    assert layout.send_token_idx_S.tolist() == list(range(6))
    assert torch.equal(layout.send_local_ids_SK, ids_TK)
    assert torch.equal(layout.send_weights_SK, w_TK)


def test_layout_weights_carry_the_router_gradient():
    ids_TK, w_TK = _routing(7, 3)
    w_TK.requires_grad_()
    layout = _layout(ids_TK, w_TK, num_experts=8, num_devices=4, rank=0)
    layout.send_weights_SK.sum().backward()
    # Each slot's weight is live in exactly one row: d(sum)/d(weight) = 1 everywhere.
    torch.testing.assert_close(w_TK.grad, torch.ones(7, 3))


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda ids, w: _layout(ids, w, 8, 3, 0),
            "devices=3 must divide the 8 experts; use one of [1, 2, 4, 8]",
        ),
        (lambda ids, w: _layout(ids, w, 8, 2, 2), "rank=2 is outside [0, num_devices=2)"),
        (
            lambda ids, w: FlatExchange(ExpertLayout(4, 1)).dispatch(torch.zeros(2, 3), ids, w),
            "expert ids [5] outside [0, num_experts=4)",
        ),
        (
            lambda ids, w: FlatExchange(ExpertLayout(8, 1)).dispatch(torch.zeros(3, 3), ids, w),
            "hidden has 3 tokens but topk_ids has 2; they must match",
        ),
        (
            lambda ids, w: row_plan(ids, w, ExpertLayout(8, 1), 0, kind="dedupe"),
            "kind='dedupe' is unknown (did you mean 'dedup'?); choose one of dedup, per_expert",
        ),
    ],
)
def test_layout_errors_quote_the_offending_values(build, message):
    ids_TK = torch.tensor([[0, 5], [1, 2]])
    with pytest.raises(ValueError) as err:
        build(ids_TK, torch.ones(2, 2))
    assert message in str(err.value)


@pytest.mark.parametrize("capacity", [5, 9])
def test_capacity_layout_holds_the_exact_rows_then_pads(capacity):
    # T = 5 tokens, E = 8 experts on D = 4 devices: block d of the padded layout (rows [d * C, (d + 1) * C))
    # starts with the exact layout's rows for d, in its order, then pad rows up to C: token T = 5, every
    # slot the sentinel, weight 0.
    torch.manual_seed(0)
    ids_TK, w_TK = torch.randint(0, 8, (5, 3)), torch.rand(5, 3)
    plan = row_plan(ids_TK, w_TK, ExpertLayout(8, 4), rank=1)
    exact = layout_from_plan(plan, tuple(plan.meta_DC[:, 0].tolist()))
    padded = capacity_layout(plan, capacity)
    assert padded.send_splits == (capacity,) * 4 and padded.capacity == capacity
    assert torch.equal(padded.send_device_S, torch.arange(4).repeat_interleave(capacity))
    start = 0
    for d, n in enumerate(exact.send_splits):
        block, rows = slice(d * capacity, (d + 1) * capacity), slice(start, start + n)
        token_S, ids_SK = padded.send_token_idx_S[block], padded.send_local_ids_SK[block]
        weights_SK = padded.send_weights_SK[block]
        assert torch.equal(token_S[:n], exact.send_token_idx_S[rows])
        assert torch.equal(ids_SK[:n], exact.send_local_ids_SK[rows])
        assert torch.equal(weights_SK[:n], exact.send_weights_SK[rows])
        assert (
            (token_S[n:] == 5).all() and (ids_SK[n:] == LOCAL_SENTINEL).all() and (weights_SK[n:] == 0).all()
        )
        start += n
    with pytest.raises(ValueError, match="capacity 4 rows per device is below this rank's 5 tokens"):
        capacity_layout(plan, 4)


# ---- oracle and single-device compute -----------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_reference_agrees_with_the_transformers_kernel(arch):
    experts = _experts(arch)
    ids_TK, w_TK = _routing(9, 2)
    x_TH = torch.randn(9, _hidden_size(experts), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_oracle(x_TH, ids_TK, w_TK, experts), experts(x_TH, ids_TK, w_TK), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_local_dispatcher_matches_reference_in_outputs_and_gradients(arch, backend):
    experts = _experts(arch)
    ids_TK, w_TK = _routing(12, 2)
    x_TH = torch.randn(12, _hidden_size(experts), generator=torch.Generator().manual_seed(2))
    expected = _run(_oracle, experts, x_TH, ids_TK, w_TK)
    actual = _run(lambda *a: local_moe_forward(*a, backend=backend), experts, x_TH, ids_TK, w_TK)
    _assert_same_run(actual, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_dispatcher_skips_sentinel_slots(backend):
    experts = _experts("olmoe")
    ids_RK = torch.tensor([[0, -1, 3], [-1, -1, 7], [2, 5, -1]])
    w_RK = torch.tensor([[0.5, 0.0, 0.2], [0.0, 0.0, 1.0], [0.3, 0.7, 0.0]])
    x_RH = torch.randn(3, _hidden_size(experts), generator=torch.Generator().manual_seed(2))
    # The oracle sees only the live slots: a sentinel slot contributes nothing.
    expert_fn = experts_module_fn(experts)
    expected = torch.stack(
        [
            sum(
                w_RK[r, k] * expert_fn(int(ids_RK[r, k]), x_RH[r : r + 1])[0]
                for k in range(3)
                if ids_RK[r, k] >= 0
            )
            for r in range(3)
        ]
    )
    torch.testing.assert_close(local_experts_forward(x_RH, ids_RK, w_RK, experts, backend), expected, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_dispatcher_with_no_rows_keeps_every_parameter_in_the_graph(backend):
    # A device that receives nothing must still produce gradients (zeros) so that it runs the same
    # backward collectives as its peers.
    experts = _experts("gpt_oss")
    x_RH = torch.zeros(0, _hidden_size(experts), requires_grad=True)
    w_RK = torch.zeros(0, 2, requires_grad=True)
    out = local_experts_forward(x_RH, torch.zeros(0, 2, dtype=torch.long), w_RK, experts, backend)
    assert out.shape == (0, _hidden_size(experts))
    out.sum().backward()
    for name, p in experts.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_dispatcher_with_only_sentinels_or_one_expert(backend):
    experts = _experts("olmoe")
    x_RH = torch.randn(4, _hidden_size(experts), generator=torch.Generator().manual_seed(2))
    only_sentinels = local_experts_forward(x_RH, torch.full((4, 2), -1), torch.zeros(4, 2), experts, backend)
    assert torch.equal(only_sentinels, torch.zeros_like(x_RH))
    ids_TK, w_TK = torch.full((4, 1), 6), torch.rand(4, 1)
    expected = _run(_oracle, experts, x_RH, ids_TK, w_TK)
    _assert_same_run(
        _run(lambda *a: local_moe_forward(*a, backend=backend), experts, x_RH, ids_TK, w_TK), expected
    )


def test_local_dispatcher_rejects_ids_beyond_its_experts():
    experts = _experts("olmoe")
    with pytest.raises(ValueError, match=r"local expert ids \[9\] are outside \[0, 8\)"):
        local_experts_forward(torch.zeros(1, 64), torch.tensor([[9, 1]]), torch.ones(1, 2), experts)


# ---- de-duplicated forward on one rank ----------------------------------------------------------
@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_dedup_forward_on_one_rank_matches_reference(arch):
    experts = _experts(arch)
    ids_TK, w_TK = _routing(10, 2)
    x_TH = torch.randn(10, _hidden_size(experts), generator=torch.Generator().manual_seed(2))
    expected = _run(_oracle, experts, x_TH, ids_TK, w_TK)
    _assert_same_run(_run(_flat_forward, experts, x_TH, ids_TK, w_TK), expected)
    _, _, handle = FlatExchange(ExpertLayout(8, 1)).dispatch(x_TH, ids_TK, w_TK)
    assert handle.layout.num_devices == 1 and handle.rows_sent == 10  # one row per token, C_T = 1


def test_dedup_forward_checks_the_expert_count():
    experts = _experts("olmoe")
    with pytest.raises(
        ValueError, match="num_experts=16 but the module holds 8 experts on each of 1 devices"
    ):
        moe_forward(
            torch.zeros(1, 64),
            torch.tensor([[0, 1]]),
            torch.ones(1, 2),
            experts,
            FlatExchange(ExpertLayout(16, 1)),
        )


# ---- transformers integration on one rank -------------------------------------------------------
@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_sharded_model_on_one_rank_matches_the_stock_model(arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    stock = copy.deepcopy(model)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = stock(input_ids=input_ids, labels=input_ids)
    ref.loss.backward()

    shard_experts(model)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    marked = dict(expert_shard_parameters(model))
    assert len(marked) == len(find_moe_layers(model)) * len(get_arch(arch).expert_params)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    stock_params = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, stock_params[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")

    state = gather_experts_state_dict(model)
    for key, value in stock.state_dict().items():
        assert torch.equal(state[key], value), key
    gather_experts(model)
    assert model.config._experts_implementation == "grouped_mm" and not expert_shard_parameters(model)


def test_occult_ep_on_an_unsharded_module_says_how_to_fix_it():
    experts = _experts("olmoe")
    experts.config = copy.copy(experts.config)
    experts.config._experts_implementation_internal = EXPERTS_IMPLEMENTATION
    with pytest.raises(RuntimeError, match="call occult_ft.dispatch.shard_experts"):
        experts(torch.zeros(1, 64), torch.tensor([[0, 1]]), torch.ones(1, 2))


def test_shard_experts_twice_is_an_error():
    from transformers import AutoModelForCausalLM

    model = shard_experts(AutoModelForCausalLM.from_config(tiny_config("olmoe")))
    with pytest.raises(ValueError, match="already sharded"):
        shard_experts(model)


# ---- the pipelining capability ------------------------------------------------------------------
def test_pipelining_follows_the_exchange_capability():
    from occult_ft.dispatch import PerExpertExchange, TwoStageExchange, node_groups, pipelined_moe_forward

    experts = _experts("olmoe")
    ids_TK, w_TK = _routing(6, 2)
    x_TH = torch.randn(6, _hidden_size(experts), generator=torch.Generator().manual_seed(2))
    layout = ExpertLayout(8, 1)
    two_stage = TwoStageExchange(layout, node_groups(1))
    capped = FlatExchange(layout, capacity=8)
    exact = [FlatExchange(layout), PerExpertExchange(layout)]
    assert [e.pipelinable for e in exact] == [True, True]
    assert not two_stage.pipelinable and not capped.pipelinable
    expected = local_moe_forward(x_TH, ids_TK, w_TK, experts)
    for exchange in exact:
        out = pipelined_moe_forward(x_TH, ids_TK, w_TK, experts, exchange, 3)
        torch.testing.assert_close(out, expected, **TOL)
    for exchange in (two_stage, capped):
        # one chunk is the plain layer, whatever the exchange; more need the capability
        out = pipelined_moe_forward(x_TH, ids_TK, w_TK, experts, exchange, 1)
        torch.testing.assert_close(out, expected, **TOL)
        with pytest.raises(
            ValueError, match=rf"chunks=2 .*this {exchange.name} exchange is not one: use chunks=1"
        ):
            pipelined_moe_forward(x_TH, ids_TK, w_TK, experts, exchange, 2)
