"""`ExpertGradientReducer`: the expert-shard gradients' all-reduce over the EDP group, started from
gradient hooks during the backward of an optimizer step's last micro-batch, against the blocking
`reduce_expert_gradients` after it, on 2 and 4 gloo processes (real tiny OLMoE models, sharded, the
de-duplicated exchange, unchunked and in 2 pipelined chunks), with 1 and 4 micro-batches per step.

Both models start equal on every rank and see the same rows; after every step the losses and every
gradient (expert shards and replicated parameters, the latter averaged by a plain all-reduce alike)
must agree to 1e-6, and then both take the same SGD step, so later steps start from the weights the
reductions produced. With two replicas of each shard (W=4, D=2) the all-reduces of all layers but the
first must have started before backward returned (the overlap itself).
"""

from __future__ import annotations

import pytest
import torch

try:
    from .dist_utils import run_distributed
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import run_distributed

STEPS = 3
LAYERS = 3
TOL = 1e-6


def _model(chunks: int, group):
    from transformers import AutoModelForCausalLM

    from occult_ft.dispatch import configure_exchange, shard_experts
    from occult_ft.models.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("olmoe")
    config.num_hidden_layers = LAYERS
    model = AutoModelForCausalLM.from_config(config)
    shard_experts(model, group)
    configure_exchange(model, "flat", chunks, None)
    return model


def _rows(step: int, micro: int, rank: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(3, vocab, (2, 12), generator=gen)


def _case(rank: int, world: int, size: int, accum: int, chunks: int) -> dict:
    import torch.distributed as dist

    from occult_ft.trainer.expert_parallel import (
        ExpertGradientReducer,
        expert_parallel_groups,
        reduce_expert_gradients,
    )

    groups = expert_parallel_groups(size)
    overlapped, blocking = _model(chunks, groups.ep_group), _model(chunks, groups.ep_group)
    reducer = ExpertGradientReducer(overlapped, groups)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (overlapped, blocking)]
    vocab = overlapped.config.vocab_size
    worst, started, shards = 0.0, [], 0
    for step in range(STEPS):
        losses = {}
        for name, model in (("overlapped", overlapped), ("blocking", blocking)):
            total = 0.0
            for micro in range(accum):
                if model is overlapped and micro == accum - 1:
                    reducer.arm()
                ids = _rows(step, micro, rank, vocab)
                loss = model(input_ids=ids, labels=ids).loss / accum
                loss.backward()
                total += float(loss)
            if model is overlapped:
                started.append(reducer.layers_started)
                reducer.finish()
            else:
                reduce_expert_gradients(model, groups)
            for p in model.parameters():  # the replicated parameters: a plain average, alike for both
                if p.grad is not None and not getattr(p, "occult_expert_shard", False):
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            losses[name] = total
        worst = max(worst, abs(losses["overlapped"] - losses["blocking"]))
        for (name, a), b in zip(overlapped.named_parameters(), blocking.parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                shards += int(getattr(a, "occult_expert_shard", False))
                diff = (a.grad - b.grad).abs().max().item() / max(1.0, b.grad.abs().max().item())
                worst = max(worst, diff)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"worst": worst, "started": started, "replicas": groups.replicas, "shards": shards}


def _worker(rank: int, world: int, cases: list[tuple[int, int, int]]) -> dict:
    return {
        f"{size}-{accum}-{chunks}": _case(rank, world, size, accum, chunks) for size, accum, chunks in cases
    }


CASES = {
    2: [(2, 1, 1), (2, 4, 1), (2, 4, 2)],
    4: [(2, 1, 1), (2, 4, 1), (2, 4, 2), (4, 4, 1)],
}


@pytest.mark.slow
# 4 ranks run the 2-rank cases with 2 replicas of each shard and a case without replicas: `make test`
# runs them, `make test-all` also the 2-rank run
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.extended), 4])
def test_overlapped_expert_reduction_equals_the_blocking_one(world):
    results = run_distributed(_worker, world, CASES[world], timeout=300.0)
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            size = int(name.split("-")[0])
            assert result["shards"] > 0, (rank, name)  # expert gradients were compared
            assert result["worst"] <= TOL, (rank, name, result)
            assert result["replicas"] == world // size
            if result["replicas"] > 1:  # every layer above the first was reduced during backward
                assert result["started"] == [LAYERS - 1] * STEPS, (rank, name, result)
            else:
                assert result["started"] == [0] * STEPS, (rank, name, result)


def test_ddp_buckets_hold_one_decoder_layer_of_replicated_parameters():
    """hidden 512, 64 experts: q, k, v, o (4 x 1 MiB), the router (128 KiB) and the norms are 4.14 MiB a
    layer once the experts are shards (excluded): 5 MiB buckets; frozen attention leaves the router."""
    from transformers import AutoModelForCausalLM

    from occult_ft.models import find_moe_layers
    from occult_ft.models.tiny import tiny_config
    from occult_ft.trainer.expert_parallel import replicated_bucket_cap_mb

    config = tiny_config("olmoe")
    config.update(
        dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64, num_experts=64)
    )
    model = AutoModelForCausalLM.from_config(config)
    assert replicated_bucket_cap_mb(model) > 5  # the experts still count while they are not shards
    for layer in find_moe_layers(model):
        for p in layer.experts.parameters():
            p.occult_expert_shard = True
    assert replicated_bucket_cap_mb(model) == 5
    for name, p in model.named_parameters():
        if "self_attn" in name:
            p.requires_grad_(False)
    assert replicated_bucket_cap_mb(model) == 1
