"""How far each placement is from the optimum, side by side: per layer, comm_complexity of sequential, occult,
search (the previous default) and solver (the default), the solver's proven lower bound under the same load
bound, the gap, the load imbalance and the seconds.

Instances: every layer of the embedded model (32 experts, top-4) at 4 and 8 devices, and synthetic layers of
64 experts, top-8, on 8 devices (planted groups of 8 with noise, and random routing with skewed
popularity). All algorithms keep the same load bound: max(1.25, occult's imbalance) unless
--max-load-imbalance is given. Search and solver run alternately first on each layer. With --width, also
DeepSeek-V3 width: 256 experts x 60 layers on 8 devices, top-8, search and solver on each layer (total time,
and whether solver was ever worse).

    python benchmarks/placement_gap.py [--profile p.safetensors] [--time-limit 30] [--threads 2]
        [--json placement_gap.json] [--width] [--skip-embedded] [--skip-synthetic]

Without --profile the embedded model is profiled first (`occult-ft profile embedded --data embedded`,
about a minute). Timings on shared CPUs are noisy; rerun on a quiet machine for figures to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from placement_time import synthetic_profile  # benchmarks/placement_time.py, this script's folder

from occult_ft.fileio import atomic_write_text
from occult_ft.metrics import comm_complexity, expert_device_from_groups, load_imbalance
from occult_ft.placement import SOLVER_TIME_LIMIT, place_layer, scipy_available, solve_layer

__all__ = ["gap_rows", "synthetic_layers"]

COLUMNS = (
    "layer",
    "sequential",
    "occult",
    "search (old)",
    "new",
    "bound",
    "gap",
    "load imbalance",
    "seconds",
)


def synthetic_layers(tokens: int = 8192, seeds=(0, 1)) -> dict[str, torch.Tensor]:
    """64 experts, top-8: `planted-s` hides 8 groups of 8 (shuffled ids; each expert of the token's group
    boosted with probability 0.5, so about half its picks land there); `random-s` is a softmax-like top-8
    with per-expert popularity N(0, 0.5)."""
    out = {}
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        group_T = torch.randint(8, (tokens,), generator=gen)
        member_TE = (torch.arange(64)[None, :] // 8) == group_T[:, None]
        boost_TE = member_TE & (torch.rand(tokens, 64, generator=gen) < 0.5)
        score_TE = torch.rand(tokens, 64, generator=gen) + 2.0 * boost_TE
        perm_E = torch.randperm(64, generator=gen)
        out[f"planted-{seed}"] = perm_E[score_TE.topk(8, dim=1).indices]
        logits = torch.randn(tokens, 64, generator=gen) + 0.5 * torch.randn(64, generator=gen)
        out[f"random-{seed}"] = logits.topk(8, dim=1).indices
    return out


def _row(name, ids, num_experts, num_devices, time_limit, bound, first_search: bool) -> dict:
    cc = lambda groups: comm_complexity(ids, expert_device_from_groups(groups, num_experts), num_devices)  # noqa: E731
    options = {} if bound is None else {"max_load_imbalance": bound}
    timed = {}

    def run(algorithm, **extra):
        start = time.perf_counter()
        result = solve_layer(ids, num_experts, num_devices, algorithm, **options, **extra)
        timed[algorithm] = (result, time.perf_counter() - start)

    order = [("search", {}), ("solver", {"time_limit": time_limit})]
    for algorithm, extra in order if first_search else order[::-1]:
        run(algorithm, **extra)
    new, seconds = timed["solver"]
    old, old_seconds = timed["search"]
    occult = place_layer(ids, num_experts, num_devices, "occult")
    dev = expert_device_from_groups(new.groups, num_experts)
    lower = None if new.lower_bound is None else new.lower_bound / ids.shape[0]
    occult_imbalance = load_imbalance(ids, expert_device_from_groups(occult, num_experts), num_devices)
    return {
        "layer": name,
        "devices": num_devices,
        "sequential": cc(place_layer(ids, num_experts, num_devices, "sequential")),
        "occult": cc(occult),
        "search (old)": cc(old.groups),
        "new": cc(new.groups),
        "bound": lower,
        "gap": None if not lower else cc(new.groups) / lower - 1.0,
        "search gap": None if not lower else cc(old.groups) / lower - 1.0,
        "load imbalance": load_imbalance(ids, dev, num_devices),
        "load bound": bound if bound is not None else max(1.25, occult_imbalance),
        "search load imbalance": load_imbalance(
            ids, expert_device_from_groups(old.groups, num_experts), num_devices
        ),
        "optimal": new.optimal,
        "note": new.note,
        "seconds": seconds,
        "search seconds": old_seconds,
    }


def gap_rows(layers: dict, num_experts: int, num_devices: int, time_limit: float, bound=None) -> list[dict]:
    """One row per layer (`COLUMNS` and more) for `layers` (name -> (T, K) topk ids)."""
    return [
        _row(name, ids.long(), num_experts, num_devices, time_limit, bound, first_search=i % 2 == 0)
        for i, (name, ids) in enumerate(layers.items())
    ]


def format_rows(title: str, rows: list[dict]) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = [title, " | ".join(COLUMNS)]
    for r in rows:
        lines.append(
            " | ".join(
                [
                    str(r["layer"]),
                    fmt(r["sequential"], ".3f"),
                    fmt(r["occult"], ".3f"),
                    fmt(r["search (old)"], ".3f"),
                    fmt(r["new"], ".3f"),
                    fmt(r["bound"], ".3f"),
                    fmt(None if r["gap"] is None else max(0.0, 100 * r["gap"]), ".2f") + "%",
                    f"{r['load imbalance']:.3f} (<= {r['load bound']:.3f})",
                    f"{r['seconds']:.1f}" + (" optimal" if r["optimal"] else ""),
                ]
            )
        )
    return "\n".join(lines)


def width_run(time_limit: float, tokens: int, num_layers: int = 60) -> dict:
    """DeepSeek-V3 width: search and solver on each layer (alternately first), wall and CPU seconds; a
    line per layer as it goes."""
    profile = synthetic_profile(num_experts=256, num_layers=num_layers, top_k=8, tokens=tokens)
    wall = {"search": 0.0, "solver": 0.0}
    cpu = {"search": 0.0, "solver": 0.0}
    worse, gains = 0, []
    for i, layer in enumerate(sorted(profile.layers)):
        ids = profile.layers[layer].topk_ids
        found = {}
        for algorithm in ("search", "solver") if i % 2 == 0 else ("solver", "search"):
            extra = {"time_limit": time_limit} if algorithm == "solver" else {}
            start, start_cpu = time.perf_counter(), time.process_time()
            groups = place_layer(ids, 256, 8, algorithm, **extra)
            wall[algorithm] += time.perf_counter() - start
            cpu[algorithm] += time.process_time() - start_cpu
            found[algorithm] = comm_complexity(ids, expert_device_from_groups(groups, 256), 8)
        worse += found["solver"] > found["search"] + 1e-12
        gains.append(found["search"] - found["solver"])
        print(
            f"  width layer {layer}: search {found['search']:.4f}, solver {found['solver']:.4f}; wall so far "
            f"search {wall['search']:.0f} s, solver {wall['solver']:.0f} s",
            flush=True,
        )
    return {
        "layers": num_layers,
        "tokens": tokens,
        "search_seconds": wall["search"],
        "solver_seconds": wall["solver"],
        "search_cpu_seconds": cpu["search"],
        "solver_cpu_seconds": cpu["solver"],
        "solver_worse_layers": int(worse),
        "mean_comm_complexity_gain": sum(gains) / len(gains),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="a profile of the embedded model (default: make one)")
    ap.add_argument(
        "--devices", type=int, nargs="+", default=[4, 8], help="device counts for the embedded model"
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=SOLVER_TIME_LIMIT,
        help="solver seconds per layer (default: the solver's)",
    )
    ap.add_argument("--max-load-imbalance", type=float, default=None, help="default: max(1.25, occult's)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per synthetic layer")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--width", action="store_true", help="also time DeepSeek-V3 width (256 x 60 layers)")
    ap.add_argument("--width-tokens", type=int, default=4096)
    ap.add_argument("--width-layers", type=int, default=60)
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    args = ap.parse_args()
    if not scipy_available():
        ap.error("the solver needs scipy: pip install 'occult-ft[solver]'")
    torch.set_num_threads(args.threads)
    out = {"time_limit": args.time_limit, "threads": args.threads, "cpus": os.cpu_count(), "tables": {}}
    if not args.skip_embedded:
        from occult_ft.cli import main as cli
        from occult_ft.profiling import Profile

        path = args.profile
        if path is None:
            path = os.path.join(tempfile.mkdtemp(), "embedded.safetensors")
            cli(["profile", "embedded", "--data", "embedded", "--out", path])
        prof = Profile.load(path)
        layers = {str(i): ids for i, ids in prof.topk_ids().items()}
        for d in args.devices:
            rows = gap_rows(layers, prof.num_experts, d, args.time_limit, args.max_load_imbalance)
            out["tables"][f"embedded, {d} devices"] = rows
            print(
                format_rows(
                    f"\nembedded model ({prof.num_experts} experts, top-{prof.top_k}), {d} devices", rows
                )
            )
    if not args.skip_synthetic:
        rows = gap_rows(synthetic_layers(args.tokens), 64, 8, args.time_limit, args.max_load_imbalance)
        out["tables"]["synthetic 64 experts, top-8, 8 devices"] = rows
        print(format_rows(f"\nsynthetic layers (64 experts, top-8, {args.tokens} tokens), 8 devices", rows))
    if args.width:
        out["width"] = width_run(args.time_limit, args.width_tokens, args.width_layers)
        w = out["width"]
        print(
            f"\nDeepSeek-V3 width (256 experts x {w['layers']} layers, 8 devices, top-8, {w['tokens']} tokens): "
            f"search {w['search_seconds']:.0f} s ({w['search_cpu_seconds']:.0f} s CPU), solver "
            f"{w['solver_seconds']:.0f} s ({w['solver_cpu_seconds']:.0f} s CPU) in all; solver worse on "
            f"{w['solver_worse_layers']} layers; mean comm_complexity gain {w['mean_comm_complexity_gain']:.4f}"
        )
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
