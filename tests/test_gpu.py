"""The CUDA path: the GPU layer benchmark, host synchronisations of the dispatcher, and the benchmark's
CPU smoke run (so the script stays runnable on machines without a GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark


def _bench():
    return load_benchmark("gpu_layer")


def test_gpu_layer_benchmark_runs_on_a_tiny_cpu_layer():
    report = _bench().main(
        [
            "--device",
            "cpu",
            "--tokens",
            "64",
            "--hidden",
            "32",
            "--intermediate",
            "16",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--devices",
            "4",
            "--allowed",
            "1",
            "--dtype",
            "float32",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--json",
        ]
    )
    # every kernel computes the same layer: fp32 agreement with the eager kernel
    assert set(report["layer_forward_backward"]) == {"grouped_mm", "occult_local", "eager"}
    assert all(v < 1e-5 for v in report["max_relative_difference_to_eager"].values())
    assert report["routing_ms"]["pruned"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU test)")
def test_dispatcher_synchronises_with_the_host_at_most_once_per_layer_forward():
    from transformers import AutoModelForCausalLM

    from occult_ft.dispatch import local_moe_forward
    from occult_ft.models import find_moe_layers, tiny_config

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(tiny_config("olmoe"), dtype=torch.bfloat16)
    experts = find_moe_layers(model)[0].experts
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (256, 2), device="cuda")
    w = torch.rand(256, 2, device="cuda", dtype=torch.bfloat16)
    local_moe_forward(x, ids, w, experts)  # warm up (lazy inits may sync)
    torch.cuda.synchronize()
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            local_moe_forward(x, ids, w, experts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [r for r in record if "synchroniz" in str(r.message).lower()]
    assert len(syncs) <= 1, [str(r.message) for r in syncs]


def _cuda_syncs(fn) -> list[str]:
    """Messages of the host synchronisations `fn()` makes on CUDA (`set_sync_debug_mode("warn")`)."""
    import warnings

    fn()  # warm up (lazy inits may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(r.message) for r in record if "synchroniz" in str(r.message).lower()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU test)")
@pytest.mark.parametrize("capacity, expected", [(None, 1), (256, 0)])
def test_exchange_layer_synchronises_once_and_the_capacity_mode_never_on_cuda(capacity, expected):
    """Forward and backward of one layer on one rank: the count exchange's one read (exact mode), none
    with capacity-bounded buffers (bf16, so grouped_mm runs on device block offsets)."""
    from transformers import AutoModelForCausalLM

    from occult_ft.dispatch import FlatExchange, moe_forward
    from occult_ft.layout import ExpertLayout
    from occult_ft.models import find_moe_layers, tiny_config

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(tiny_config("olmoe"), dtype=torch.bfloat16)
    experts = find_moe_layers(model)[0].experts
    ids = torch.stack([torch.randperm(8, device="cuda")[:2] for _ in range(256)])
    w = torch.rand(256, 2, device="cuda", dtype=torch.bfloat16)
    exchange = FlatExchange(ExpertLayout(8, 1), capacity=capacity)

    def layer():
        x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        moe_forward(x, ids, w, experts, exchange).float().sum().backward()

    syncs = _cuda_syncs(layer)
    assert len(syncs) <= expected, syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU test)")
@pytest.mark.parametrize("criterion", ["score", "similarity", "device_max", "device_topk_sum"])
def test_pruning_rules_never_synchronise_on_cuda(criterion):
    from occult_ft.routing import limit_topk

    gen = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(512, 64, generator=gen), -1).cuda()
    ids = scores.topk(8, -1).indices
    dev = (torch.arange(64) // 8).cuda()
    sim = torch.rand(64, 64, generator=gen).cuda()
    syncs = _cuda_syncs(lambda: limit_topk(scores, ids, dev, 8, 2, criterion, sim, num_nodes=2, max_nodes=1))
    assert not syncs, syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU test)")
def test_gpu_layer_benchmark_on_cuda_agrees_across_kernels():
    report = _bench().main(
        [
            "--tokens",
            "2048",
            "--hidden",
            "512",
            "--intermediate",
            "256",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
        ]
    )
    assert all(v < 2e-2 for v in report["max_relative_difference_to_eager"].values())  # bf16


# ---- the suite's core checks, parametrized over device (the CUDA case skips cleanly without a GPU) ------------
from helpers import DEVICES  # noqa: E402

try:
    from .dist_utils import process_group_backend, run_distributed
except ImportError:  # pytest's rootdir-relative import mode
    from dist_utils import process_group_backend, run_distributed


def _tiny(model_type: str, device: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    from occult_ft.models import tiny_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).to(device).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["olmoe", "gpt_oss"])
def test_local_dispatcher_matches_the_reference_on(device, model_type):
    from occult_ft.dispatch import experts_module_fn, local_moe_forward, reference_moe
    from occult_ft.models import find_moe_layers

    model = _tiny(model_type, device)
    experts = find_moe_layers(model)[0].experts
    gen = torch.Generator().manual_seed(1)
    h = model.config.hidden_size
    x = torch.randn(24, h, generator=gen).to(device).requires_grad_()
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(24)]).to(device)
    w = (torch.rand(24, 2, generator=gen) + 0.1).to(device)
    out = local_moe_forward(x, ids, w, experts)
    ref = reference_moe(x, ids, w, experts_module_fn(experts))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("criterion", ["score", "device_max", "device_topk_sum"])
def test_pruned_routing_on_the_device_equals_the_cpu_result(device, criterion):
    from occult_ft.metrics import contiguous_expert_device
    from occult_ft.routing import limit_topk

    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(512, 16, generator=gen)
    ids = scores.topk(4, dim=-1).indices
    dev_E = contiguous_expert_device(16, 8)
    cpu = limit_topk(scores, ids, dev_E, 8, 2, criterion)
    on = limit_topk(scores.to(device), ids.to(device), dev_E.to(device), 8, 2, criterion)
    assert torch.equal(on.cpu(), cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_placement_and_pruning_keep_working_on(device):
    """Permuting a model on the device keeps its logits; pruning on the device reaches <= M devices."""
    from occult_ft.apply import apply_occult
    from occult_ft.metrics import contiguous_expert_device, devices_per_token
    from occult_ft.placement import Placement
    from occult_ft.routing import PruningConfig, collect_routing, set_recording

    model = _tiny("olmoe", device)
    ids = torch.randint(3, 100, (2, 16), device=device)
    with torch.no_grad():
        before = model(ids).logits
    groups = {i: [[7, 0], [5, 2], [1, 6], [3, 4]] for i in (0, 1)}
    apply_occult(model, Placement(None, "olmoe", 8, 4, 1, "test", groups, {}), PruningConfig(4, 1, "score"))
    set_recording(model, True)
    with torch.no_grad():
        model(ids)
    for record in collect_routing(model).values():
        assert devices_per_token(record.topk_ids.cpu(), contiguous_expert_device(8, 4), 4).max() == 1
    from occult_ft.routing import remove_pruning

    remove_pruning(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_two_training_steps_on(device, tiny_olmoe_dir, tmp_path):
    from occult_ft.data import load_text_dataset, tokenize_dataset
    from occult_ft.trainer import OccultConfig, OccultTrainer

    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n\n" * 40)
    from transformers import AutoTokenizer

    rows = tokenize_dataset(
        load_text_dataset(str(path)), AutoTokenizer.from_pretrained(tiny_olmoe_dir), seq_len=32
    )
    config = OccultConfig(
        output_dir=str(tmp_path / "out"),
        seq_len=32,
        devices=4,
        max_devices_per_token=2,
        criterion="score",
        placement="sequential",
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=device == "cpu",
        bf16=False,
    )
    trainer = OccultTrainer(tiny_olmoe_dir, args=config, train_dataset=rows)
    trainer.train()
    assert next(trainer.model.parameters()).device.type == device
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(e["max_token_devices"] <= 2 for e in logs)


def _exchange_on(rank: int, world: int, device: str) -> float:
    """De-duplicated exchange of a sharded OLMoE layer on `device` against the one-process reference."""
    import copy

    from occult_ft.dispatch import (
        FlatExchange,
        experts_module_fn,
        moe_forward,
        reference_moe,
        shard_experts_module,
    )
    from occult_ft.layout import ExpertLayout
    from occult_ft.models import find_moe_layers

    dev = torch.device(device, rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")
    full = find_moe_layers(_tiny("olmoe", "cpu", seed=5))[0].experts.to(dev)
    gen = torch.Generator().manual_seed(2)
    x_all = torch.randn(16, 64, generator=gen).to(dev)
    ids_all = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(16)]).to(dev)
    w_all = (torch.rand(16, 2, generator=gen) + 0.1).to(dev)
    ref = reference_moe(x_all, ids_all, w_all, experts_module_fn(full)).detach()
    local = copy.deepcopy(full)
    shard_experts_module(local, ("gate_up_proj", "down_proj"))
    mine = slice(rank * 8, (rank + 1) * 8)
    out = moe_forward(x_all[mine], ids_all[mine], w_all[mine], local, FlatExchange(ExpertLayout(8, world)))
    return float((out.detach() - ref[mine]).abs().max())


@pytest.mark.parametrize("device", DEVICES)
def test_deduplicated_exchange_on_two_ranks_on(device):
    """gloo on CPU; on CUDA, NCCL with a GPU per rank, else gloo over CUDA tensors on one GPU."""
    backend = process_group_backend(device, 2)
    worst = max(run_distributed(_exchange_on, 2, device, backend=backend))
    assert worst < 1e-4
