"""The chunked pipeline overlaps in backward too: on 2 gloo processes, the reverse exchanges of
`pipelined_moe_forward`'s backward are asynchronous, and the reverse combine of chunk c + 1 is issued
before chunk c's experts run their backward (it travels while they compute), each chunk's gradients
sent home right after its experts' backward. Exactness against the unchunked layer is checked in
tests/test_dispatch_dist.py.
"""

from __future__ import annotations

import pytest

try:
    from .dist_utils import run_distributed
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import run_distributed

CHUNKS = 3


def _backward_schedule(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from occult_ft.dispatch import FlatExchange, pipelined_moe_forward, shard_experts
    from occult_ft.layout import ExpertLayout
    from occult_ft.models import base_experts, find_moe_layers, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    shard_experts(model)
    experts = base_experts(find_moe_layers(model)[0].experts)
    gen = torch.Generator().manual_seed(rank)
    t, k, e = 24, 2, 8
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen, requires_grad=True)
    x = torch.randn(t, model.config.hidden_size, generator=gen, requires_grad=True)
    out = pipelined_moe_forward(x, ids, w, experts, FlatExchange(ExpertLayout(e, world)), CHUNKS)

    events: list[str] = []
    a2a, autograd_backward = dist.all_to_all_single, torch.autograd.backward

    def recorded_a2a(*args, **kwargs):
        events.append("exchange_async" if kwargs.get("async_op") else "exchange_blocking")
        return a2a(*args, **kwargs)

    def recorded_backward(*args, **kwargs):
        events.append("experts_backward")
        return autograd_backward(*args, **kwargs)

    dist.all_to_all_single, torch.autograd.backward = recorded_a2a, recorded_backward
    try:
        autograd_backward(out.sum())  # the outer backward, unrecorded
    finally:
        dist.all_to_all_single, torch.autograd.backward = a2a, autograd_backward
    return events


@pytest.mark.slow
def test_the_pipelined_backward_sends_the_next_chunk_while_experts_compute():
    # per chunk c: its reverse combine (issued one chunk ahead), its experts' backward, its gradients home
    expected = ["exchange_async", "exchange_async", "experts_backward", "exchange_async"]
    for _ in range(CHUNKS - 2):
        expected += ["exchange_async", "experts_backward", "exchange_async"]
    expected += ["experts_backward", "exchange_async"]
    for rank, events in enumerate(run_distributed(_backward_schedule, 2, timeout=180.0)):
        assert events == expected, (rank, events)
