"""One OLMoE-shaped MoE layer on one device: occult_ft's single-device dispatcher against transformers'
experts kernels, and the pruned router against plain top-k, side by side in one run.

    python benchmarks/gpu_layer.py                    # the issue's shape on the GPU (under 5 minutes)
    python benchmarks/gpu_layer.py --json             # one JSON object
    python benchmarks/gpu_layer.py --device cpu --tokens 512 --hidden 64 --intermediate 32 --dtype float32

Shape (defaults): 16,384 tokens, hidden 2048, expert width 1024, 64 experts, top-8, bf16: the layer of
`../shared/notes/ecosystem-facts.md` (H200 reference: grouped_mm 21.7 ms, eager 106 ms, plain routing
0.09 ms, device-limited routing 0.19 ms). Each experts implementation runs forward + backward of the
whole block (router included) on the same tokens; time is the median of `--iters` CUDA-event timings
after `--warmup` runs. TFLOP/s counts expert matmuls only: 3 projections of 2*T*K*H*I FLOPs forward,
twice that backward.

Targets (issue 11): the dispatcher no slower than grouped_mm; the pruned router (8 devices, 2 allowed)
under 1% of the layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timer(device: torch.device):
    """A function that times `fn()` in ms (CUDA events on GPU, perf_counter on CPU)."""

    def run(fn, iters: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return run


def build_layer(args, device: torch.device, dtype: torch.dtype):
    """A one-layer OLMoE (real transformers modules) and its MoE block."""
    from transformers import AutoModelForCausalLM, OlmoeConfig

    config = OlmoeConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=1,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, model.model.layers[0].mlp


def register_single_device_kernel() -> str:
    """occult_ft's single-device dispatcher (`local_moe_forward`) as a transformers experts kernel."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from occult_ft.dispatch import local_moe_forward

    def occult_local(self, hidden_states, top_k_index, top_k_weights):
        return local_moe_forward(hidden_states, top_k_index, top_k_weights, self)

    ALL_EXPERTS_FUNCTIONS.register("occult_local", occult_local)
    return "occult_local"


def run(args) -> dict:
    from occult_ft.routing import PruningConfig, apply_pruning, remove_pruning

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    timed = _timer(device)
    model, block = build_layer(args, device, dtype)
    kernels = ["grouped_mm", register_single_device_kernel(), "eager"]
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    flops = 3 * (2 * args.tokens * args.top_k * args.hidden * args.intermediate) * 3  # fwd + 2x bwd

    def fwd_bwd():
        xi = x.detach().requires_grad_(True)
        block(xi).backward(grad)

    layer = {}
    outputs = {}
    for name in kernels:
        model.config._experts_implementation = name
        with torch.no_grad():
            outputs[name] = block(x).float()
        ms = timed(fwd_bwd, args.iters, args.warmup)
        layer[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
    ref = outputs["eager"]
    scale = ref.abs().max().item() or 1.0
    agree = {name: round((out - ref).abs().max().item() / scale, 5) for name, out in outputs.items()}

    hidden = x.view(-1, args.hidden)
    with torch.no_grad():
        plain_ms = timed(lambda: block.gate(hidden), args.iters * 4, args.warmup)
        apply_pruning(model, PruningConfig(args.devices, args.allowed, "score"))
        pruned_ms = timed(lambda: block.gate(hidden), args.iters * 4, args.warmup)
        remove_pruning(model)
    grouped = layer["grouped_mm"]["ms"]
    return {
        "shape": {
            "tokens": args.tokens,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "experts": args.experts,
            "top_k": args.top_k,
            "dtype": args.dtype,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "layer_forward_backward": layer,
        "max_relative_difference_to_eager": agree,
        "dispatcher_vs_grouped_mm": round(grouped / layer["occult_local"]["ms"], 3),
        "routing_ms": {"plain_topk": round(plain_ms, 4), "pruned": round(pruned_ms, 4)},
        "pruned_router_share_of_layer": round(pruned_ms / grouped, 5),
        "pruned_router": f"{args.devices} devices, {args.allowed} allowed, criterion score",
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--devices", type=int, default=8, help="pruned router: expert-parallel size D")
    ap.add_argument("--allowed", type=int, default=2, help="pruned router: max_devices_per_token")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report))
        return report
    s = report["shape"]
    print(
        f"MoE layer fwd+bwd: {s['tokens']} tokens, H={s['hidden']}, I={s['intermediate']}, "
        f"E={s['experts']}, top-{s['top_k']}, {s['dtype']} on {s['device']}"
    )
    print(f"{'experts kernel':<16}{'ms':>10}{'TFLOP/s':>10}{'max rel diff':>14}")
    for name, r in report["layer_forward_backward"].items():
        print(
            f"{name:<16}{r['ms']:>10.2f}{r['tflops']:>10.1f}{report['max_relative_difference_to_eager'][name]:>14.2g}"
        )
    print(f"dispatcher speed vs grouped_mm: {report['dispatcher_vs_grouped_mm']:.2f}x (target >= 1.00x)")
    r = report["routing_ms"]
    print(
        f"routing: plain top-k {r['plain_topk']:.3f} ms, pruned ({report['pruned_router']}) {r['pruned']:.3f} ms "
        f"= {100 * report['pruned_router_share_of_layer']:.2f}% of the layer (target < 1%)"
    )
    return report


if __name__ == "__main__":
    main()
