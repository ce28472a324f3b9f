"""The CUDA path: the GPU layer benchmark, host synchronisations of the dispatcher, and the benchmark's
CPU smoke run (so the script stays runnable on machines without a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_layer.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_layer", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
