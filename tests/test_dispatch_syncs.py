"""Host synchronisations per MoE layer, counted on CPU with `occult_ft.bench.syncs.HostSyncCounter`.

Targets (each host read stalls a GPU's kernel queue): the pruned router reads nothing on the host, the exchange at most once per layer
(its count exchange), the capacity-bounded exchange never; the backward pass never. Before this
change a layer read the device 5 times unpruned (the layout's range check, nonzero and send counts,
the received counts, the local bincount) and 12-14 times pruned. The multi-process counts (4 gloo
ranks) are checked in tests/test_dispatch_dist.py; the CUDA check (`set_sync_debug_mode`) in
tests/test_gpu.py.

Shape legend: T tokens, K experts per token, H hidden size, E experts, D devices.
"""

from __future__ import annotations

import copy

import pytest
import torch

from occult_ft.bench.syncs import HostSyncCounter
from occult_ft.dispatch import (
    FlatExchange,
    PerExpertExchange,
    TwoStageExchange,
    moe_forward,
    node_groups,
    pipelined_moe_forward,
    shard_experts,
)
from occult_ft.layout import ExpertLayout
from occult_ft.metrics import contiguous_expert_device
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.routing import (
    CRITERIA,
    PruningConfig,
    apply_pruning,
    limit_topk,
    replace_by_similarity,
    walk_admitted_devices,
)


def _experts():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    return model, find_moe_layers(model)[0]


def _routing(t: int = 24, k: int = 2, e: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=gen)


def _counted(fn):
    """(syncs of fn(), syncs of backward of its output's sum)."""
    with HostSyncCounter() as forward:
        out = fn()
    with HostSyncCounter() as backward:
        out.float().sum().backward()
    return forward.count, backward.count, forward.by_site


@pytest.mark.parametrize(
    "name, make, expected",
    [
        ("flat", lambda e: FlatExchange(ExpertLayout(e, 1)), 1),
        ("per_expert", lambda e: PerExpertExchange(ExpertLayout(e, 1)), 1),
        ("capacity", lambda e: FlatExchange(ExpertLayout(e, 1), capacity=24), 0),
        ("two_stage", lambda e: TwoStageExchange(ExpertLayout(e, 1, 1), node_groups(1)), 1),
    ],
)
def test_a_layer_reads_the_device_at_most_once(name, make, expected):
    _, layer = _experts()
    experts = copy.deepcopy(layer.experts)
    ids, w = _routing()
    x = torch.randn(24, experts.down_proj.shape[1], requires_grad=True)
    w.requires_grad_()
    forward, backward, sites = _counted(lambda: moe_forward(x, ids, w, experts, make(8)))
    # the flat and per-expert exchanges read their count exchange once, the two-stage one its all-gather
    # of every rank's counts once; the capacity-bounded buffers never; no backward pass reads anything
    assert (forward, backward) == (expected, 0), dict(sites)


def test_pipelined_chunks_add_no_synchronisation():
    _, layer = _experts()
    experts = copy.deepcopy(layer.experts)
    ids, w = _routing()
    x = torch.randn(24, experts.down_proj.shape[1], requires_grad=True)
    exchange = FlatExchange(ExpertLayout(8, 1))
    forward, backward, sites = _counted(lambda: pipelined_moe_forward(x, ids, w, experts, exchange, 4))
    assert (forward, backward) == (1, 0), dict(sites)  # all chunks' counts travel in one exchange


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("budget", [(1, None), (2, None), (None, 1), (2, 1), (3, 2)])
def test_pruning_rules_read_nothing_on_the_host(criterion, budget):
    gen = torch.Generator().manual_seed(4)
    t, e, k, d, n = 64, 16, 4, 4, 2
    scores = torch.softmax(torch.randn(t, e, generator=gen), -1)
    ids = scores.topk(k, -1).indices
    dev = contiguous_expert_device(e, d)
    sim = torch.rand(e, e, generator=gen)
    selectable = torch.rand(t, e, generator=gen) > 0.3
    with HostSyncCounter() as counter:
        limit_topk(scores, ids, dev, d, budget[0], criterion, sim, selectable, n, budget[1])
        limit_topk(scores, ids, dev, d, budget[0], criterion, sim, None, n, budget[1])
        if budget[1] is None:
            replace_by_similarity(scores, ids, dev, d, budget[0], sim)
        walk_admitted_devices(scores, ids, dev, d, budget[0], n, budget[1], selectable)
    assert counter.count == 0, dict(counter.by_site)


@pytest.mark.parametrize("budget", [None, 2, 1])
@pytest.mark.parametrize("criterion", ["score", "similarity"])
def test_a_pruned_moe_block_reads_the_device_once(budget, criterion):
    """The whole block (router, pruning, recording, exchange, experts) of a sharded model on one rank:
    one host read, the exchange's, whatever the budget (12-14 before)."""
    model, layer = _experts()
    similarity = {m.index: torch.rand(8, 8) for m in find_moe_layers(model)}
    apply_pruning(
        model, PruningConfig(num_devices=4, max_devices_per_token=budget, criterion=criterion), similarity
    )
    shard_experts(model)
    hidden = torch.randn(2, 12, model.config.hidden_size)
    with HostSyncCounter() as counter:
        layer.block(hidden)
    assert counter.count == 1, dict(counter.by_site)
