"""The pipeline's schedule on 2 gloo processes: the exchanges of `pipelined_moe_forward` are
asynchronous, this rank's own rows never enter them (split 0 both ways) and are computed while they
travel, forward and backward; the reverse combine of chunk c + 1 is issued before chunk c's experts run
their backward, each chunk's gradients sent home right after. Exactness against the unchunked layer and
the single-process oracle is checked in tests/test_dispatch_dist.py.
"""

from __future__ import annotations

import pytest

try:
    from .dist_utils import run_distributed
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import run_distributed


def _schedule(rank: int, world: int, chunks: int) -> dict[str, list[str]]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import occult_ft.dispatch.pipeline as pipeline
    from occult_ft.dispatch import FlatExchange, pipelined_moe_forward, shard_experts
    from occult_ft.layout import ExpertLayout
    from occult_ft.models import base_experts, find_moe_layers, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    shard_experts(model)
    experts = base_experts(find_moe_layers(model)[0].experts)
    gen = torch.Generator().manual_seed(rank)
    t, k, e = 24, 2, 8
    # every chunk routes some tokens to each rank's experts: its own rows and the other rank's
    ids = torch.stack([torch.tensor([i % 4, 4 + (i // 2) % 4]) for i in range(t)])[
        torch.randperm(t, generator=gen)
    ]
    w = torch.rand(t, k, generator=gen, requires_grad=True)
    x = torch.randn(t, model.config.hidden_size, generator=gen, requires_grad=True)

    events: list[str] = []
    a2a, autograd_backward, experts_forward = (
        dist.all_to_all_single,
        torch.autograd.backward,
        pipeline.local_experts_forward,
    )

    def recorded_a2a(*args, **kwargs):
        if kwargs.get("async_op"):
            own = (kwargs["input_split_sizes"][rank], kwargs["output_split_sizes"][rank])
            events.append("exchange_async" + ("" if own == (0, 0) else f" with own rows {own}"))
        else:
            events.append("exchange_blocking")
        return a2a(*args, **kwargs)

    def recorded_backward(*args, **kwargs):
        events.append("experts_backward")
        return autograd_backward(*args, **kwargs)

    def recorded_forward(*args, **kwargs):
        events.append("experts")
        return experts_forward(*args, **kwargs)

    dist.all_to_all_single, pipeline.local_experts_forward = recorded_a2a, recorded_forward
    try:
        out = pipelined_moe_forward(x, ids, w, experts, FlatExchange(ExpertLayout(e, world)), chunks)
    finally:
        dist.all_to_all_single, pipeline.local_experts_forward = a2a, experts_forward
    forward, events[:] = list(events), []
    dist.all_to_all_single, torch.autograd.backward = recorded_a2a, recorded_backward
    try:
        autograd_backward(out.sum())  # the outer backward, unrecorded
    finally:
        dist.all_to_all_single, torch.autograd.backward = a2a, autograd_backward
    return {"forward": forward, "backward": list(events)}


def _expected(chunks: int) -> dict[str, list[str]]:
    go, experts, back = "exchange_async", "experts", "experts_backward"
    # forward: the count exchange, dispatch(0) travelling while the own rows of every chunk compute (one
    # piece), then per chunk c: dispatch(c + 1) issued before chunk c's experts, combine(c) right after
    forward = ["exchange_blocking", go, experts]
    for c in range(chunks):
        forward += ([go] if c + 1 < chunks else []) + [experts, go]
    # backward: combine^T(0) travelling while the own rows' backward runs, then per chunk c:
    # combine^T(c + 1) issued before chunk c's experts' backward, its gradients home right after
    backward = [go, back]
    for c in range(chunks):
        backward += ([go] if c + 1 < chunks else []) + [back, go]
    return {"forward": forward, "backward": backward}


def _schedules(rank: int, world: int, counts: list[int]) -> dict[int, dict[str, list[str]]]:
    return {chunks: _schedule(rank, world, chunks) for chunks in counts}


@pytest.mark.slow
def test_the_pipeline_computes_own_rows_and_the_next_chunk_while_exchanges_travel():
    counts = [1, 3]  # one launch for both (starting 2 processes costs more than the schedules)
    for rank, by_chunks in enumerate(run_distributed(_schedules, 2, counts, timeout=180.0)):
        assert sorted(by_chunks) == counts
        for chunks, events in by_chunks.items():
            expected = _expected(chunks)
            assert events == expected, (rank, chunks, events, expected)
