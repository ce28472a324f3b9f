"""Time to place DeepSeek-V3 width: 256 experts x 60 layers on 8 devices, top-8, on a synthetic profile
with planted groups (the figure quoted in docs/results.md, "Placement on planted expert groups").

    python benchmarks/placement_time.py [--tokens 4096] [--algorithm search] [--nodes 1]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from occult_ft.placement import DEFAULT_ALGORITHM, compute_placement

__all__ = ["benchmark_placement", "synthetic_profile"]


def synthetic_profile(
    num_experts: int = 256, num_layers: int = 60, top_k: int = 8, tokens: int = 4096, seed: int = 0
) -> SimpleNamespace:
    """A profile-like object (`compute_placement` input) with planted collaboration.

    Each layer hides E/8 groups of 8 experts (ids shuffled per layer); a token boosts each expert of one
    group with probability 0.7, so about 5.6 of its top_k picks land in the group, the rest anywhere.
    """
    gen = torch.Generator().manual_seed(seed)
    layers = {}
    for layer in range(num_layers):
        perm_E = torch.randperm(num_experts, generator=gen)
        group_T = torch.randint(num_experts // 8, (tokens,), generator=gen)
        inside_TE = torch.zeros(tokens, num_experts)
        inside_TE[torch.arange(tokens)[:, None], group_T[:, None] * 8 + torch.arange(8)] = 1.0
        score_TE = torch.rand(tokens, num_experts, generator=gen) + 2.0 * inside_TE * (
            torch.rand(tokens, num_experts, generator=gen) < 0.7
        )
        layers[layer] = SimpleNamespace(topk_ids=perm_E[score_TE.topk(top_k, dim=1).indices])
    return SimpleNamespace(
        model="synthetic", model_type=None, num_experts=num_experts, top_k=top_k, layers=layers
    )


def benchmark_placement(
    num_experts: int = 256,
    num_layers: int = 60,
    num_devices: int = 8,
    top_k: int = 8,
    tokens: int = 4096,
    algorithm: str = DEFAULT_ALGORITHM,
    seed: int = 0,
    num_nodes: int = 1,
) -> float:
    """Seconds that `compute_placement` takes on `synthetic_profile(...)` (not a test; for docs/results.md)."""
    profile = synthetic_profile(num_experts, num_layers, top_k, tokens, seed)
    start = time.perf_counter()
    compute_placement(profile, num_devices, num_nodes=num_nodes, algorithm=algorithm)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens", type=int, default=4096, help="profiled tokens per layer (profiler default 65536)"
    )
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--algorithm", default=DEFAULT_ALGORITHM)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (the figures in docs/results.md use 2)"
    )
    args = ap.parse_args()
    for name in ("tokens", "experts", "layers", "devices", "nodes", "top_k", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.experts % 8:
        ap.error(f"--experts {args.experts} must be a multiple of 8 (the planted groups have 8 experts)")
    torch.set_num_threads(args.threads)
    seconds = benchmark_placement(
        args.experts, args.layers, args.devices, args.top_k, args.tokens, args.algorithm, num_nodes=args.nodes
    )
    print(
        f"placing {args.experts} experts x {args.layers} layers on {args.devices} devices ({args.algorithm}, "
        f"{args.tokens} tokens per layer): {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
