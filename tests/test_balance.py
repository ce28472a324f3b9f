"""Device load balance: the balance loss acting on device load under a budget, the load imbalance
reported beside comm_complexity (metrics, analyze, the trainer's meter), and none of it reading the
device on the host.

Shape legend: T tokens, K experts per token, E experts, D devices.
"""

from __future__ import annotations

import pytest
import torch

from occult_ft.bench.syncs import HostSyncCounter
from occult_ft.commands.analyze import format_report
from occult_ft.metrics import (
    comm_complexity,
    contiguous_expert_device,
    intra_share,
    load_imbalance,
    routing_report,
)
from occult_ft.routing import RouterRecord
from occult_ft.trainer import RoutingMeter, balance_loss
from occult_ft.trainer.losses import device_balance_term

DEV = contiguous_expert_device(8, 4)  # E=8, D=4: device d holds experts 2d, 2d+1


def _record(ids_TK, probs_TE):
    return RouterRecord(ids_TK, probs_TE, torch.zeros(ids_TK.shape[0]))


# ---- the balance loss on device load -----------------------------------------------------------------
def test_device_term_is_one_for_uniform_load_and_d_for_one_device():
    # 4 tokens, K=2, uniform probabilities; token t picks both experts of device t: every device gets
    # one row (g = 1/4 each after dividing by the 4 rows), Q = 2/8 = 1/4 each -> D * 4 * 1/16 = 1
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    uniform = _record(ids, torch.full((4, 8), 1 / 8))
    expert_only = balance_loss({0: uniform}).item()  # f_e = 1/4 each, P_e = 1/8 -> 8 * 8 / 32 = 2 = K
    assert expert_only == pytest.approx(2.0)
    both = balance_loss({0: uniform}, expert_device={0: DEV}, num_devices=4).item()
    assert both == pytest.approx(0.5 * (2.0 + 2 * 1.0))  # = K: the coefficient keeps its meaning
    # every token on device 0 with all the probability there: g = (1, 0, 0, 0), Q = (1, 0, 0, 0) -> D
    collapsed = _record(torch.tensor([[0, 1]] * 4), torch.tensor([[0.5, 0.5] + [0.0] * 6] * 4))
    expert = balance_loss({0: collapsed}).item()  # f = (1, 1, 0...), P = (.5, .5, 0...) -> 8 * 1 = 8
    assert expert == pytest.approx(8.0)
    assert balance_loss({0: collapsed}, expert_device={0: DEV}, num_devices=4).item() == pytest.approx(
        0.5 * (8.0 + 2 * 4.0)
    )


def test_device_term_counts_rows_once_per_device_not_per_expert():
    # token 0 picks experts 0 and 1 (both on device 0): one row on device 0, not two
    g_D, q_D = device_balance_term(
        torch.full((2, 8), 1 / 8), torch.tensor([[0, 1], [0, 2]]), DEV, 4, torch.ones(2)
    )
    assert g_D.tolist() == [2.0, 1.0, 0.0, 0.0]  # device 0: both tokens; device 1: token 1
    torch.testing.assert_close(q_D, torch.full((4,), 0.5))  # 2 tokens x 2/8 mass per device


def test_device_term_pushes_probability_away_from_the_loaded_device():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=gen, requires_grad=True)
    ids = torch.stack([torch.tensor([0, 2 + int(i % 6)]) for i in range(64)])  # every token on device 0
    rec = _record(ids, torch.softmax(logits, -1))
    loss = balance_loss({0: rec}, expert_device={0: DEV}, num_devices=4)
    (grad,) = torch.autograd.grad(loss, logits)
    # raising the logits of device 0's experts raises the loss; the loss pushes tokens off device 0
    assert grad[:, :2].sum() > 0 and grad[:, 2:].sum() < 0


def test_device_term_ignores_masked_tokens():
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    probs = torch.full((4, 8), 1 / 8)
    mask = torch.tensor([True, True, False, False])
    masked = balance_loss({0: _record(ids, probs)}, mask, {0: DEV}, 4)
    kept = balance_loss({0: _record(ids[:2], probs[:2])}, None, {0: DEV}, 4)
    torch.testing.assert_close(masked, kept)


def test_balance_loss_and_meter_read_nothing_on_the_host():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(32, 8, generator=gen), -1)
    ids = probs.topk(2, -1).indices
    records = {0: _record(ids, probs), 1: _record(ids.flip(1), probs)}
    mask = torch.rand(32, generator=gen) > 0.2
    meter = RoutingMeter(4)
    with HostSyncCounter() as counter:
        balance_loss(records, mask, {0: DEV, 1: DEV}, 4)
        meter.update(records, {0: DEV, 1: DEV}, mask)
    assert counter.count == 0, dict(counter.by_site)


# ---- load imbalance where comm_complexity is reported -------------------------------------------
def test_meter_weights_masked_tokens_like_selecting_them():
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(40, 8, generator=gen), -1)
    ids = probs.topk(3, -1).indices
    mask = torch.rand(40, generator=gen) > 0.3
    meter = RoutingMeter(4)
    meter.update({0: _record(ids, probs)}, {0: DEV}, mask)
    out = meter.summary()
    kept = ids[mask]
    assert out["comm_complexity"] == pytest.approx(comm_complexity(kept, DEV, 4))
    assert out["intra_share"] == pytest.approx(intra_share(kept, DEV, 4))
    assert out["load_imbalance"] == pytest.approx(load_imbalance(kept, DEV, 4))


def test_report_and_analyze_give_the_mean_and_worst_layer_imbalance():
    # layer 0: loads (2, 1, 1, 0) -> 2 / 1 = 2.0; layer 1: one token on devices 0 and 1 -> 1 / 0.5 = 2.0...
    layer0 = torch.tensor([[0, 2], [1, 4]])  # token 0: devices 0, 1; token 1: devices 0, 2
    layer1 = torch.tensor([[0, 2], [4, 6], [1, 3]])  # loads (2, 2, 1, 1) -> 2 / 1.5
    rep = routing_report({0: layer0, 1: layer1}, DEV, 4, 8)
    assert rep.layers[0].load_imbalance == pytest.approx(2.0)
    assert rep.layers[1].load_imbalance == pytest.approx(2 / 1.5)
    assert rep.load_imbalance == pytest.approx(2.0)  # the worst layer
    assert rep.mean_load_imbalance == pytest.approx((2.0 * 2 + 2 / 1.5 * 3) / 5)  # token-weighted
    text = format_report(rep)
    assert f"mean over layers {rep.mean_load_imbalance:.3f}, worst layer 0 2.000" in text
