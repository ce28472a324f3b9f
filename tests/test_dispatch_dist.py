"""Multi-process tests of the de-duplicated all-to-all (gloo on 127.0.0.1, CPU, fp32).

Every rank holds its shard of the experts and its own tokens; the oracle is the single-process
`reference_moe` (or the stock transformers model) over the union of all ranks' tokens, computed on
every rank from the same seed. Outputs and gradients (hidden states, router weights, expert weights
after gathering the shards) must agree to 1e-5.

Spawning interpreters is the expensive part (~seconds each on a small machine), so each world size
is launched once per session (module-scoped fixture) and runs all of its cases; each test then
checks its own case. A worker records mismatches instead of raising, so a failed comparison on one
rank cannot leave its peers waiting in a collective.

Shape legend: T tokens, K experts per token, H hidden size, E experts, D ranks, P = E / D.
"""

from __future__ import annotations

import copy
import os
import tempfile
import traceback

import pytest
import torch

try:
    from .dist_utils import run_distributed
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import run_distributed

pytestmark = pytest.mark.slow

# name -> case; "tokens" lists each rank's token count (len = world size).
LAYER_CASES_WORLD2 = {
    "random_routing": dict(arch="olmoe", tokens=[5, 7], top_k=2, routing="random"),
    "gpt_oss_layout": dict(arch="gpt_oss", tokens=[6, 4], top_k=2, routing="random"),
    "zero_tokens_on_a_rank": dict(arch="olmoe", tokens=[6, 0], top_k=2, routing="random"),
    "all_tokens_to_one_device": dict(arch="olmoe", tokens=[4, 5], top_k=2, routing="one_device"),
    "every_token_to_one_expert": dict(arch="olmoe", tokens=[3, 4], top_k=1, routing="one_expert"),
    "both_experts_on_one_device": dict(arch="olmoe", tokens=[5, 5], top_k=2, routing="same_device"),
    # the own rows outside the collectives (`overlap_local`), one chunk: every routing shape above
    "overlap_local": dict(arch="olmoe", tokens=[5, 7], top_k=2, routing="random", overlap=True),
    "overlap_local_zero_tokens": dict(arch="gpt_oss", tokens=[6, 0], top_k=2, routing="random", overlap=True),
    "overlap_local_one_device": dict(
        arch="olmoe", tokens=[4, 5], top_k=2, routing="one_device", overlap=True
    ),
    "overlap_local_same_device": dict(
        arch="olmoe", tokens=[5, 5], top_k=2, routing="same_device", overlap=True
    ),
}
LAYER_CASES_WORLD4 = {
    "random_routing_top3": dict(arch="qwen3_moe", tokens=[3, 5, 4, 6], top_k=3, routing="random"),
    "zero_tokens_on_two_ranks": dict(arch="olmoe", tokens=[0, 5, 0, 4], top_k=2, routing="random"),
    "no_tokens_anywhere": dict(arch="olmoe", tokens=[0, 0, 0, 0], top_k=2, routing="random"),
    "gpt_oss_layout": dict(arch="gpt_oss", tokens=[2, 3, 1, 4], top_k=2, routing="random"),
}
# The other exchanges and modes on the same oracle: per-expert rows, the capacity-bounded receive
# buffers (no host synchronisation), and the pipelined chunks (exact against the unchunked layer too).
EXCHANGE_CASES_WORLD4 = {
    "per_expert_rows": dict(
        arch="qwen3_moe", tokens=[3, 5, 4, 6], top_k=3, routing="random", exchange="per_expert"
    ),
    "per_expert_zero_tokens": dict(
        arch="olmoe", tokens=[0, 5, 0, 4], top_k=2, routing="random", exchange="per_expert"
    ),
    "capacity_bounded": dict(arch="qwen3_moe", tokens=[6, 5, 6, 4], top_k=3, routing="random", capacity=6),
    "capacity_above_tokens": dict(arch="gpt_oss", tokens=[2, 3, 1, 4], top_k=2, routing="random", capacity=9),
    "capacity_one_device": dict(arch="olmoe", tokens=[4, 4, 4, 4], top_k=2, routing="one_device", capacity=4),
    "chunks_3": dict(arch="qwen3_moe", tokens=[7, 5, 6, 8], top_k=3, routing="random", chunks=3),
    "chunks_more_than_tokens": dict(arch="olmoe", tokens=[1, 0, 3, 2], top_k=2, routing="random", chunks=4),
    "chunks_per_expert": dict(
        arch="gpt_oss", tokens=[5, 4, 6, 3], top_k=2, routing="random", chunks=2, exchange="per_expert"
    ),
    "overlap_local": dict(arch="qwen3_moe", tokens=[7, 5, 6, 8], top_k=3, routing="random", overlap=True),
    "overlap_local_per_expert": dict(
        arch="olmoe", tokens=[0, 5, 3, 4], top_k=2, routing="random", exchange="per_expert", overlap=True
    ),
    # a shared MLP beside the combine (`exchange_overlap_shared`): one chunk, chunks, per-expert rows
    "shared_beside": dict(arch="qwen3_moe", tokens=[7, 5, 6, 8], top_k=3, routing="random", shared=True),
    "shared_beside_chunks_2": dict(
        arch="olmoe", tokens=[6, 0, 5, 3], top_k=2, routing="random", chunks=2, shared=True
    ),
    "shared_beside_per_expert": dict(
        arch="gpt_oss", tokens=[2, 3, 1, 4], top_k=2, routing="random", exchange="per_expert", shared=True
    ),
}
MODEL_CASES_WORLD2 = {
    "olmoe_model": dict(arch="olmoe", batch=1, seq=8, save=True),
    "deepseek_v3_model": dict(arch="deepseek_v3", batch=1, seq=8, save=False),
    # the shared MLP beside the combine: DeepSeek's block calls it after the experts (the kernel's
    # output serves it), Qwen-MoE's before (the kernel sees it ran and leaves it); both stay exact
    "deepseek_v3_shared_beside": dict(
        arch="deepseek_v3", batch=1, seq=8, save=False, configure=dict(overlap_shared=True), beside="served"
    ),
    "deepseek_v3_shared_beside_chunks_2": dict(
        arch="deepseek_v3",
        batch=2,
        seq=5,
        save=False,
        configure=dict(overlap_shared=True, chunks=2),
        beside="served",
    ),
    "qwen2_moe_shared_first": dict(
        arch="qwen2_moe", batch=1, seq=8, save=False, configure=dict(overlap_shared=True), beside="ran_first"
    ),
}

NUM_EXPERTS = 8


# ---- helpers (run inside the workers) -----------------------------------------------------------
def _close(failures: list[str], what: str, actual, expected, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as err:
        failures.append(f"{what}: {err}")


def _grad(t: torch.Tensor) -> torch.Tensor:
    """t.grad, or zeros where autograd never reached t (e.g. no tokens at all)."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _full_experts(arch: str, seed: int) -> torch.nn.Module:
    """A transformers experts module of `arch` with all E experts, identical on every rank."""
    from transformers import AutoModelForCausalLM

    from occult_ft.models import find_moe_layers, tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    experts = find_moe_layers(model)[0].experts
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return experts


def _routing(routing: str, num_tokens: int, top_k: int, world: int, gen: torch.Generator) -> torch.Tensor:
    per = NUM_EXPERTS // world
    rows = []
    for _ in range(num_tokens):
        if routing == "random":
            rows.append(torch.randperm(NUM_EXPERTS, generator=gen)[:top_k])
        elif routing == "one_device":  # every expert on device 0
            rows.append(torch.randperm(per, generator=gen)[:top_k])
        elif routing == "one_expert":  # the last expert, on the last device
            rows.append(torch.full((top_k,), NUM_EXPERTS - 1))
        elif routing == "same_device":  # K distinct experts of one random device
            device = int(torch.randint(world, (1,), generator=gen))
            rows.append(device * per + torch.randperm(per, generator=gen)[:top_k])
        else:
            raise ValueError(routing)
    return torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.long)


def _gather_dim0(t: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    pieces = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(pieces, t.contiguous())
    return torch.cat(pieces)


def _row_failures(
    handle, rows_all: int, case: dict, rank: int, world: int, ids_all, mine: slice
) -> list[str]:
    """The rows this rank sent and their splits against the routing (K per token per expert, C_T per token
    de-duplicated; a capacity layout sends fixed splits holding the real rows), and all ranks' rows."""
    from occult_ft.metrics import contiguous_expert_device, device_load, devices_per_token

    failures = []
    total, top_k = sum(case["tokens"]), case["top_k"]
    expert_device = contiguous_expert_device(NUM_EXPERTS, world)
    if case.get("exchange", "flat") == "per_expert":
        expected_rows, global_rows = case["tokens"][rank] * top_k, total * top_k
        expected_splits = tuple(
            torch.bincount(expert_device[ids_all[mine]].reshape(-1), minlength=world).tolist()
        )
    else:
        expected_rows = int(devices_per_token(ids_all[mine], expert_device, world).sum())
        global_rows = int(devices_per_token(ids_all, expert_device, world).sum())
        expected_splits = tuple(device_load(ids_all[mine], expert_device, world).tolist())
    sent = int(handle.layout.send_counts_D.sum())
    if sent != expected_rows:
        failures.append(f"rows sent={sent}, expected {expected_rows}")
    if "capacity" in case:
        if handle.layout.send_splits != (case["capacity"],) * world:
            failures.append(f"capacity layout splits {handle.layout.send_splits}")
        if tuple(handle.layout.send_counts_D.tolist()) != expected_splits:
            failures.append(
                f"real rows per device {handle.layout.send_counts_D.tolist()}, expected {expected_splits}"
            )
    elif handle.layout.send_splits != expected_splits:
        failures.append(f"send_splits={handle.layout.send_splits}, expected {expected_splits}")
    if rows_all != global_rows:
        failures.append(f"rows sent by all ranks={rows_all}, expected {global_rows}")
    return failures


def _layer_case(rank: int, world: int, case: dict) -> list[str]:
    import torch.distributed as dist

    from occult_ft.bench.syncs import HostSyncCounter
    from occult_ft.dispatch import (
        FlatExchange,
        PerExpertExchange,
        experts_module_fn,
        moe_forward,
        pipelined_moe_forward,
        reference_moe,
        shard_experts_module,
    )
    from occult_ft.layout import ExpertLayout
    from occult_ft.models import get_arch

    failures: list[str] = []
    full = _full_experts(case["arch"], seed=1)
    hidden_size = full.down_proj.shape[2] if full.is_transposed else full.down_proj.shape[1]
    gen = torch.Generator().manual_seed(2)
    total, top_k = sum(case["tokens"]), case["top_k"]
    x_all = torch.randn(total, hidden_size, generator=gen)
    ids_all = _routing(case["routing"], total, top_k, world, gen)
    w_all = torch.rand(total, top_k, generator=gen) + 0.1
    g_all = torch.randn(total, hidden_size, generator=gen)  # upstream gradient of the output
    # a shared MLP the layer adds to every token (only in the cases that ask for one)
    torch.manual_seed(4)
    shared_full = torch.nn.Sequential(
        torch.nn.Linear(hidden_size, 6), torch.nn.SiLU(), torch.nn.Linear(6, hidden_size)
    )

    # Oracle: one process, all tokens, all experts (plus the shared MLP).
    x_ref, w_ref = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    out_ref = reference_moe(x_ref, ids_all, w_ref, experts_module_fn(full))
    if case.get("shared"):
        out_ref = out_ref + shared_full(x_ref)
    (out_ref * g_all).sum().backward()

    # This rank: its tokens, its shard, the case's exchange (flat unless it says otherwise).
    start = sum(case["tokens"][:rank])
    mine = slice(start, start + case["tokens"][rank])
    names = get_arch(case["arch"]).expert_params
    layout = ExpertLayout(NUM_EXPERTS, world)
    kind, chunks = case.get("exchange", "flat"), case.get("chunks", 1)
    pipelined = chunks > 1 or case.get("overlap", False) or case.get("shared", False)

    def run(chunk_count: int, through_pipeline: bool):
        local = copy.deepcopy(full)
        local.zero_grad(set_to_none=True)
        shared = copy.deepcopy(shared_full) if case.get("shared") else None
        if shared is not None:
            shared.zero_grad(set_to_none=True)
        shard_experts_module(local, names)
        if kind == "per_expert":
            exchange = PerExpertExchange(layout)
        else:
            exchange = FlatExchange(layout, capacity=case.get("capacity"))
        x, w = x_all[mine].clone().requires_grad_(), w_all[mine].clone().requires_grad_()
        with HostSyncCounter() as forward:
            if through_pipeline and shared is not None:  # computed beside the combine, added here
                routed, beside = pipelined_moe_forward(
                    x, ids_all[mine], w, local, exchange, chunk_count, shared=shared
                )
                out = routed + beside
            elif through_pipeline:
                out = pipelined_moe_forward(x, ids_all[mine], w, local, exchange, chunk_count)
            else:
                out = moe_forward(x, ids_all[mine], w, local, exchange)
                out = out + shared(x) if shared is not None else out
        with HostSyncCounter() as backward:
            (out * g_all[mine]).sum().backward()
        # host reads per layer: the count exchange once (all chunks together), none with capacity buffers
        expected = (0 if "capacity" in case else 1, 0)
        if (forward.count, backward.count) != expected:
            failures.append(
                f"host syncs (forward, backward) {(forward.count, backward.count)}, expected {expected}"
            )
        grads = {}
        for name in names:  # collectives first (every rank), comparisons after
            grad = getattr(local, name).grad
            if grad is None:
                failures.append(f"expert shard {name} got no gradient")
                grad = torch.zeros_like(getattr(local, name))
            grads[name] = _gather_dim0(grad, world)
        for name, p in shared.named_parameters() if shared is not None else ():  # replicated: summed
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            grads[f"shared.{name}"] = grad
        _, _, handle = exchange.dispatch(x_all[mine], ids_all[mine], w_all[mine])
        return out, x, w, grads, handle

    out, x, w, grads, handle = run(chunks, pipelined)
    rows_all = torch.tensor([int(handle.layout.send_counts_D.sum())])
    dist.all_reduce(rows_all)

    failures += _row_failures(handle, int(rows_all), case, rank, world, ids_all, mine)
    _close(failures, "output", out, out_ref[mine].detach())
    _close(failures, "hidden grad", _grad(x), _grad(x_ref)[mine])
    _close(failures, "router weight grad", _grad(w), _grad(w_ref)[mine])
    for name in names:
        _close(failures, f"{name} grad (gathered)", grads[name], _grad(getattr(full, name)))
    for name, p in shared_full.named_parameters() if case.get("shared") else ():
        _close(failures, f"shared {name} grad (summed)", grads[f"shared.{name}"], _grad(p))
    if pipelined:  # the pipeline against the unchunked layer of the same exchange
        out1, x1, w1, grads1, _ = run(1, False)
        _close(failures, "chunked vs unchunked output", out, out1.detach())
        _close(failures, "chunked vs unchunked hidden grad", _grad(x), _grad(x1))
        _close(failures, "chunked vs unchunked weight grad", _grad(w), _grad(w1))
        for name in grads:
            _close(failures, f"chunked vs unchunked {name} grad", grads[name], grads1[name])
    return failures


def _reload_failures(rank: int, model, state: dict, ref_state: dict) -> list[str]:
    """Rank 0 saves the gathered state as a normal HF checkpoint and reloads it without occult_ft."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        if rank == 0:
            model.save_pretrained(tmp, state_dict=state)
            reloaded = AutoModelForCausalLM.from_pretrained(tmp)
            for key, value in reloaded.state_dict().items():
                if not torch.equal(value, ref_state[key]):
                    failures.append(f"reloaded checkpoint differs at {key}")
        dist.barrier()
    return failures


def _beside_failures(layers, way: str | None) -> list[str]:
    """Each layer's shared MLP ran one way in the one forward: from the kernel (`served`) or first by the
    block (`ran_first`); nothing to check without a way."""
    from occult_ft.models import base_experts

    if way is None:
        return []
    other = {"served": "ran_first", "ran_first": "served"}[way]
    failures = []
    for layer in layers:
        beside = getattr(base_experts(layer.experts), "occult_beside", None)
        if beside is None or getattr(beside, way) != 1 or getattr(beside, other) != 0:
            counts = None if beside is None else (beside.served, beside.ran_first)
            failures.append(f"{layer.name}: (served, ran_first) = {counts}, expected one {way}")
    return failures


def _model_case(rank: int, world: int, case: dict) -> list[str]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from occult_ft.dispatch import (
        EXPERTS_IMPLEMENTATION,
        configure_exchange,
        expert_shard_parameters,
        gather_experts,
        gather_experts_state_dict,
        shard_experts,
    )
    from occult_ft.models import find_moe_layers, tiny_config

    failures: list[str] = []
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(case["arch"])).eval()
    reference = copy.deepcopy(model)
    config = model.config
    gen = torch.Generator().manual_seed(3)
    batch_all = torch.randint(3, config.vocab_size, (world * case["batch"], case["seq"]), generator=gen)
    mine = slice(rank * case["batch"], (rank + 1) * case["batch"])

    # Oracle: the stock model on the concatenated batch (mean loss over all ranks' tokens).
    ref_out = reference(input_ids=batch_all, labels=batch_all)
    ref_out.loss.backward()

    shard_experts(model)
    if model.config._experts_implementation != EXPERTS_IMPLEMENTATION:
        failures.append(f"experts implementation is {model.config._experts_implementation!r}")
    layers = find_moe_layers(model)
    marked = expert_shard_parameters(model)
    if len(marked) != len(layers) * len(layers[0].arch.expert_params):
        failures.append(f"{len(marked)} marked expert-shard parameters for {len(layers)} layers")
    for name, p in marked:
        if p.shape[0] != NUM_EXPERTS // world:
            failures.append(f"{name} has shape {tuple(p.shape)}, expected {NUM_EXPERTS // world} experts")
    configure_exchange(model, **case.get("configure", {}))  # nothing given: every setting kept
    out = model(input_ids=batch_all[mine], labels=batch_all[mine])
    out.loss.backward()
    failures += _beside_failures(layers, case.get("beside"))

    # Equal token counts per rank: reference loss = mean of rank losses; reference gradient =
    # (sum over ranks of rank gradients) / D, where an expert shard's gradient already holds every
    # rank's contribution (the reverse all-to-all brought it home) and replicated ones need a sum.
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    grads = {}
    shard_names = {n for n, _ in marked}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if name in shard_names:
            grads[name] = _gather_dim0(grad, world) / world
        else:
            dist.all_reduce(grad)
            grads[name] = grad / world
    state = gather_experts_state_dict(model)
    _close(failures, "loss", loss / world, ref_out.loss.detach())
    _close(failures, "logits", out.logits.detach(), ref_out.logits[mine].detach())
    ref_params = dict(reference.named_parameters())
    for name, grad in grads.items():
        ref_grad = ref_params[name].grad
        if ref_grad is None:
            ref_grad = torch.zeros_like(ref_params[name])
        _close(failures, f"grad {name}", grad, ref_grad)
    router_grad = ref_params[f"{layers[0].name}.gate.weight"].grad
    if router_grad is None or router_grad.abs().sum() == 0:
        failures.append("the reference router got no gradient: the test would not see a broken router path")
    ref_state = reference.state_dict()
    for key, value in ref_state.items():
        if key not in state or not torch.equal(state[key], value):
            failures.append(f"gathered state_dict differs at {key}")

    if case["save"]:  # a normal HF checkpoint, reloadable without occult_ft
        failures += _reload_failures(rank, model, state, ref_state)

    gather_experts(model)
    if model.config._experts_implementation == EXPERTS_IMPLEMENTATION or expert_shard_parameters(model):
        failures.append("gather_experts left the model sharded")
    failures += [
        f"gather_experts left {layer.name}.{layer.arch.shared_mlp_attr}.forward replaced"
        for layer in layers
        if layer.arch.shared_mlp_attr and "forward" in vars(getattr(layer.block, layer.arch.shared_mlp_attr))
    ]
    with torch.no_grad():
        again = model(input_ids=batch_all[mine]).logits
    _close(failures, "logits after gather_experts", again, ref_out.logits[mine].detach())
    return failures


def _worker(rank: int, world: int, layer_cases: dict, model_cases: dict) -> dict[str, list[str]]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, list[str]] = {}
    for name, case in layer_cases.items():
        try:
            results[name] = _layer_case(rank, world, case)
        except Exception:
            results[name] = [traceback.format_exc()]
    for name, case in model_cases.items():
        try:
            results[name] = _model_case(rank, world, case)
        except Exception:
            results[name] = [traceback.format_exc()]
    return results


def _failures(per_rank: list[dict[str, list[str]]], name: str) -> str:
    lines = [f"rank {r}: {msg}" for r, res in enumerate(per_rank) for msg in res[name]]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_worker, 2, LAYER_CASES_WORLD2, MODEL_CASES_WORLD2, timeout=240)


@pytest.fixture(scope="module")
def world4():
    cases = {**LAYER_CASES_WORLD4, **EXCHANGE_CASES_WORLD4}
    return run_distributed(_worker, 4, cases, {}, timeout=300)


@pytest.mark.parametrize("name", list(LAYER_CASES_WORLD2))
def test_two_ranks_match_single_process_reference(world2, name):
    assert not _failures(world2, name), _failures(world2, name)


@pytest.mark.parametrize("name", list(LAYER_CASES_WORLD4))
def test_four_ranks_match_single_process_reference(world4, name):
    assert not _failures(world4, name), _failures(world4, name)


@pytest.mark.parametrize("name", list(EXCHANGE_CASES_WORLD4))
def test_per_expert_capacity_and_chunked_exchanges_match_the_reference(world4, name):
    assert not _failures(world4, name), _failures(world4, name)


@pytest.mark.parametrize("name", list(MODEL_CASES_WORLD2))
def test_sharded_model_on_two_ranks_matches_concatenated_batch(world2, name):
    assert not _failures(world2, name), _failures(world2, name)


def _int64_ids_worker(rank: int, world: int) -> dict:
    """One flat dispatch and combine of the same rows in bf16 and in fp32, with P = 300 experts per
    device: above 256 (the largest integer every bf16 holds exactly), so in bf16 the local ids take an
    int64 collective of their own; in fp32 they ride as columns of the hidden rows."""
    from occult_ft.dispatch import FlatExchange
    from occult_ft.layout import ExpertLayout

    torch.manual_seed(rank)
    t, k, h, e = 6, 3, 4, 300 * world
    ids_TK = torch.randint(0, e, (t, k))
    x_TH, w_TK = torch.randn(t, h).to(torch.bfloat16), torch.rand(t, k).to(torch.bfloat16)
    exchange = FlatExchange(ExpertLayout(e, world))
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        x, w = x_TH.to(dtype, copy=True).requires_grad_(), w_TK.to(dtype, copy=True).requires_grad_()
        recv_x_RH, recv_w_RK, handle = exchange.dispatch(x, ids_TK, w)
        # small integer cotangents (exact in bf16), so both dtypes' gradients are exact sums
        loss = (recv_x_RH * (torch.arange(recv_x_RH.numel()) % 7).view_as(recv_x_RH)).sum() + recv_w_RK.sum()
        back_TH = exchange.combine(recv_x_RH.detach(), handle, out_dtype=torch.float32)
        loss.backward()
        out[dtype] = [
            recv_x_RH.float(),
            recv_w_RK.float(),
            handle.recv_local_ids_RJ,
            x.grad.float(),
            w.grad.float(),
        ]
    # every token comes back once from each device its experts live on: C_T copies of its row
    c_T = torch.stack([(ids_TK // 300 == dev).any(dim=1) for dev in range(world)]).sum(dim=0)
    return {
        "ids_dtype": str(out[torch.bfloat16][2].dtype),
        "ids_above_256": bool((out[torch.bfloat16][2] > 256).any()),
        "bf16_equals_fp32": all(torch.equal(a, b) for a, b in zip(out[torch.bfloat16], out[torch.float32])),
        "combine_is_C_T_copies": torch.equal(back_TH, x_TH.float() * c_T[:, None]),
    }


def test_local_ids_beyond_exact_floats_take_an_int64_collective():
    per_rank = run_distributed(_int64_ids_worker, 2, timeout=120)
    assert all(r["ids_dtype"] == "torch.int64" for r in per_rank), per_rank
    assert any(r["ids_above_256"] for r in per_rank), per_rank  # the int64 path carried ids bf16 cannot
    assert all(r["bf16_equals_fp32"] and r["combine_is_C_T_copies"] for r in per_rank), per_rank
