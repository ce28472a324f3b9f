"""Expert-parallel inference: `occult_ft.from_pretrained(DIR, expert_parallel_size=D)` on real gloo
process groups generates exactly what the single-process `occult_ft.from_pretrained(DIR)` generates.

The reference is the whole model in the test process. Each rank loads only its E / D experts (counted),
runs greedy `generate` with the KV cache (prefill through the exact exchange, decode steps through the
capacity-bounded one) and a plain forward for the prefill logits; a second load with
`exchange_capacity=None` (every forward exact) and one with `exchange="per_expert"` must agree too.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from helpers import build_tokenizer, save_tiny_model

import occult_ft
from occult_ft.apply import apply_occult
from occult_ft.checkpoint import save_pruned
from occult_ft.models import find_moe_layers
from occult_ft.placement import Placement
from occult_ft.routing import PruningConfig, router_similarity

#: device d of 4 holds the original experts GROUPS[d]
GROUPS = [[2, 7], [0, 5], [3, 4], [1, 6]]
NEW_TOKENS = 6


def _prompts() -> torch.Tensor:
    return torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(5))


def _similarity(model) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in find_moe_layers(model):
        x = torch.rand(layer.num_experts, layer.num_experts, generator=g)
        out[layer.index] = (x + x.T) / 2
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """unpruned (a plain HF checkpoint), budget 2 (score) and budget 1 (similarity, placed) of one model."""
    tokenizer = build_tokenizer()
    root = tmp_path_factory.mktemp("ep_inference")
    base = save_tiny_model(root / "unpruned", "olmoe", tokenizer)
    out = {"unpruned": base}
    for budget, criterion in ((2, "score"), (1, "similarity")):
        model = occult_ft.from_pretrained(base, dtype=torch.float32)
        layers = find_moe_layers(model)
        placement = Placement(None, None, 8, 4, 1, "test", {layer.index: GROUPS for layer in layers})
        pruning = PruningConfig(4, budget, criterion)
        apply_occult(model, placement, pruning, _similarity(model) if criterion == "similarity" else None)
        path = str(root / f"budget{budget}")
        save_pruned(
            model, path, tokenizer, pruning=pruning, placement=placement, similarity=router_similarity(model)
        )
        out[f"budget{budget}"] = path
    return out


def _run(model, ids: torch.Tensor) -> dict:
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return {"logits": logits.tolist(), "tokens": tokens.tolist()}


def _reference(path: str) -> dict:
    model = occult_ft.from_pretrained(path, dtype=torch.float32)
    return _run(model, _prompts())


def _expert_rows(model) -> int:
    """Experts held by this process over all MoE layers (dim 0 of the first fused expert tensor)."""
    return sum(
        int(getattr(layer.experts, layer.arch.expert_params[0]).shape[0]) for layer in find_moe_layers(model)
    )


def _ep_worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    out = {}
    for name, path in paths.items():
        for setting in ({}, {"exchange_capacity": None}, {"exchange": "per_expert"}):
            model = occult_ft.from_pretrained(
                path, dtype=torch.float32, expert_parallel_size=world, **setting
            )
            result = _run(model, _prompts())
            result["experts"] = _expert_rows(model)
            hook = getattr(model, "occult_decode_capacity", None)
            result["decode_rows"] = None if hook is None else hook.rows
            result["decode_forwards"] = None if hook is None else hook.decode_forwards
            out[(name, tuple(setting.items()))] = result
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_generate_equals_single_process(checkpoints, world, request):
    references = {name: _reference(path) for name, path in checkpoints.items()}
    full = _expert_rows(occult_ft.from_pretrained(checkpoints["unpruned"], dtype=torch.float32))
    if world == 4:
        results = [got["generate"] for got in request.getfixturevalue("four_ranks")]
    else:
        results = run_distributed(_ep_worker, world, checkpoints, timeout=600)
    for rank_results in results:
        for (name, setting), got in rank_results.items():
            want = references[name]
            where = f"{name} {dict(setting)} on {world} ranks"
            assert got["tokens"] == want["tokens"], where
            torch.testing.assert_close(
                torch.tensor(got["logits"]), torch.tensor(want["logits"]), atol=1e-5, rtol=1e-5, msg=where
            )
            assert got["experts"] * world == full, where  # E / D experts per layer on each rank
            if setting == ():  # the default: decode steps on the capacity-bounded flat exchange
                assert got["decode_rows"] == _prompts().shape[0], where
                assert got["decode_forwards"] == NEW_TOKENS - 1, where  # every step after the prefill
            else:
                assert got["decode_rows"] is None, where
    # the generated continuation is not the prompt repeated: the test can tell models apart
    assert references["unpruned"]["tokens"] != references["budget1"]["tokens"]


def _refusal_worker(rank: int, world: int, path: str, six: str) -> list[str]:
    messages = []
    for kwargs in (
        {"expert_parallel_size": 3},
        {"expert_parallel_size": world, "exchange": "ring"},
        {"expert_parallel_size": world, "exchange": "two_stage"},
        {"expert_parallel_size": world, "exchange": "per_expert", "exchange_capacity": 4},
        {"expert_parallel_size": world, "exchange_capacity": "big"},
        {"expert_parallel_size": world, "nodes": 3},
        {"expert_parallel_size": world, "low_cpu_mem_usage": True},
    ):
        try:
            occult_ft.from_pretrained(path, **kwargs)
        except ValueError as err:
            messages.append(str(err))
    try:
        occult_ft.from_pretrained(six, expert_parallel_size=world)
    except ValueError as err:
        messages.append(str(err))
    model = occult_ft.from_pretrained(path, expert_parallel_size=world, exchange_capacity=1)
    try:  # a decode capacity below the batch is refused at prefill, on every rank alike
        model.generate(_prompts(), max_new_tokens=2, do_sample=False, pad_token_id=0)
    except ValueError as err:
        messages.append(str(err))
    return messages


def _four_rank_worker(rank: int, world: int, paths: dict[str, str], six: str) -> dict:
    return {
        "generate": _ep_worker(rank, world, paths),
        "refusals": _refusal_worker(rank, world, paths["budget2"], six),
    }


@pytest.fixture(scope="module")
def four_ranks(checkpoints, tmp_path_factory) -> list[dict]:
    """Per rank of one 4-process run: the generate results and the refusal messages (one launch for
    both tests: starting 4 processes on a small machine costs more than either)."""
    six = save_tiny_model(tmp_path_factory.mktemp("six") / "six", "olmoe", build_tokenizer(), num_experts=6)
    return run_distributed(_four_rank_worker, 4, checkpoints, six, timeout=900)


@pytest.mark.slow
def test_expert_parallel_refusals_are_one_line(four_ranks):
    results = [got["refusals"] for got in four_ranks]
    assert results[0] == results[3]
    expected = [
        "expert_parallel_size=3 but the world has 4 ranks",
        "exchange='ring' is unknown",
        "exchange='two_stage' needs nodes > 1",
        "exchange='per_expert' is exact only",
        "exchange_capacity='big' must be 'auto'",
        "nodes=3 must divide expert_parallel_size=4",
        "drop low_cpu_mem_usage",
        "expert_parallel_size=4 does not divide the 6 experts of each MoE layer; use one of 1, 2, 3, 6",
        "exchange_capacity=1 rows per device is below the batch of 2 sequences",
    ]
    assert len(results[0]) == len(expected), results[0]
    for message, part in zip(results[0], expected, strict=True):
        assert part in message and "\n" not in message, message


def test_expert_parallel_without_a_process_group_is_one_line(checkpoints):
    with pytest.raises(ValueError, match=r"^expert_parallel_size=2 needs an initialised torch.distributed"):
        occult_ft.from_pretrained(checkpoints["budget2"], expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"^expert_parallel_size=0 must be a positive integer"):
        occult_ft.from_pretrained(checkpoints["budget2"], expert_parallel_size=0)
    with pytest.raises(ValueError, match=r"they need expert_parallel_size > 1 \(got None\)$"):
        occult_ft.from_pretrained(checkpoints["budget2"], exchange="per_expert")
