"""Placement and pruning on a tiny OLMoE-shaped model whose router has planted expert groups.

The model is a real transformers OLMoE (64 experts, top-8, hidden 64, 2 layers) whose router rows
are built so that experts fall into G hidden groups (shuffled ids): each group shares a direction
in hidden space, so a token's top-8 mostly lands in one group. The script runs the public pipeline
(profile -> place with every algorithm -> analyze, then prune to 1 and 2 devices) and prints
`comm_complexity` per setting, plus the time to place DeepSeek-V3 width (256 experts x 60 layers,
8 devices, `placement_time.py`).

    python benchmarks/planted_groups.py [--devices 4 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from placement_time import benchmark_placement  # benchmarks/placement_time.py, this script's folder
from transformers import AutoModelForCausalLM

from occult_ft.metrics import contiguous_expert_device, random_placement_comm_complexity, routing_report
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.placement import DEFAULT_ALGORITHM, PLACEMENT_ALGORITHMS, compute_placement, permute_experts
from occult_ft.profiling import profile_model
from occult_ft.routing import PruningConfig, apply_pruning

E, K, H = 64, 8, 64


def planted_model(groups: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny_config("olmoe", num_experts=E, num_experts_per_tok=K, hidden_size=H, vocab_size=512)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    perm = torch.randperm(E)  # hide the groups behind shuffled expert ids
    model.planted_groups = [
        sorted(perm[g * (E // groups) : (g + 1) * (E // groups)].tolist()) for g in range(groups)
    ]
    for layer in find_moe_layers(model):
        directions = torch.nn.functional.normalize(torch.randn(groups, H), dim=-1)
        w = torch.randn(E, H) * 0.3
        for g in range(groups):
            members = perm[g * (E // groups) : (g + 1) * (E // groups)]
            w[members] += 4.0 * directions[g]
        layer.router.weight.data.copy_(w)
    return model


def batches(n_batches=8, batch=8, seq=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 512, (batch, seq), generator=g)} for _ in range(n_batches)]


def run(devices_list, groups=None):
    rows = []
    for d in devices_list:
        model = planted_model(groups or d)
        prof = profile_model(model, batches(), progress=False)
        ids = prof.topk_ids()
        seq = routing_report(ids, contiguous_expert_device(E, d), d, E).comm_complexity
        from occult_ft.metrics import expert_device_from_groups

        truth = expert_device_from_groups(model.planted_groups, E)
        row = {
            "devices": d,
            "random_expectation": random_placement_comm_complexity(E, K, d),
            "sequential": seq,
            "planted_groups": routing_report(ids, truth, d, E).comm_complexity,
        }
        placements = {}
        for algo in PLACEMENT_ALGORITHMS:
            t = time.perf_counter()
            pl = compute_placement(prof, d, algorithm=algo, bound_time_limit=0)
            row[f"{algo}_seconds"] = time.perf_counter() - t
            placements[algo] = pl
            row[algo] = routing_report(ids, {i: pl.expert_device(i) for i in ids}, d, E).comm_complexity
        for m in (2, 1):  # prune the placed (default algorithm) model on fresh eval tokens
            pruned = planted_model(groups or d)
            permute_experts(pruned, placements[DEFAULT_ALGORITHM])
            apply_pruning(pruned, PruningConfig(d, m, "score"))
            p2 = profile_model(pruned, batches(seed=2), progress=False)
            row[f"default+prune{m}"] = routing_report(
                p2.topk_ids(), contiguous_expert_device(E, d), d, E
            ).comm_complexity
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-width", action="store_true", help="skip the DeepSeek-V3-width timing")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = run(args.devices)
    width = (
        None
        if args.skip_width
        else benchmark_placement(num_experts=256, num_layers=60, num_devices=8, top_k=8, tokens=4096)
    )
    if args.json:
        print(json.dumps({"rows": rows, "deepseek_v3_width_seconds": width}, indent=1))
        return
    cols = ["random_expectation", "planted_groups", *PLACEMENT_ALGORITHMS, "default+prune2", "default+prune1"]
    print(f"{'D':>3} " + " ".join(f"{c:>18}" for c in cols))
    for r in rows:
        print(f"{r['devices']:>3} " + " ".join(f"{r[c]:>18.3f}" for c in cols))
    if width is not None:
        print(f"placing 256 experts x 60 layers on 8 devices ({DEFAULT_ALGORITHM}): {width:.1f} s")


if __name__ == "__main__":
    main()
