"""Overlap: one expert-parallel MoE layer (forward + backward) with its tokens pipelined in chunks, against
its exchange alone and its local experts alone, measured side by side in one run.

    python benchmarks/layer_overlap.py                            # 4 gloo processes, 2048 tokens each
    python benchmarks/layer_overlap.py --tokens 1024 --hidden 1024 --chunks 1,2,4,8 --json out.json

Per iteration (after a barrier; the slowest process's time counts; median over iterations), rounds
rotate the order of:
    exchange      FlatExchange dispatch + combine, forward and backward, around identity experts
    experts       the local experts' forward and backward on the rows this rank receives (no exchange)
    layer_n       moe_forward (n = 1) or pipelined_moe_forward with n chunks, forward and backward
The target of issue 15: layer_n <= 1.15 x max(exchange, experts); a serial layer costs their sum.
On one host's loopback with fewer cores than processes, the exchange is memory copies competing with
the experts for the same cores, so the overlap it can show is bounded by the idle cores.

Shape legend: T tokens per process, H hidden, E experts, K top-k, D processes, P = E / D.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _experts(num_local: int, hidden: int, width: int, seed: int):
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

    cfg = OlmoeConfig(
        hidden_size=hidden, intermediate_size=width, num_experts=num_local, num_experts_per_tok=1
    )
    experts = OlmoeExperts(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return experts


def _worker(rank: int, world: int, rendezvous: str, args: dict, out_path: str) -> None:
    from occult_ft.dispatch import FlatExchange, local_experts_forward, moe_forward, pipelined_moe_forward
    from occult_ft.layout import ExpertLayout

    torch.set_num_threads(args["threads"])
    dist.init_process_group(
        "gloo",
        init_method="file://" + rendezvous,  # a file, not a port another process could take first
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=30),
    )
    e, k, t, h = args["experts"], args["top_k"], args["tokens"], args["hidden"]
    layout = ExpertLayout(e, world)
    experts = _experts(layout.experts_per_device, h, args["width"], seed=rank)
    gen = torch.Generator().manual_seed(100 + rank)
    scores = torch.softmax(torch.randn(t, e, generator=gen), -1)
    ids = scores.topk(k, -1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True)
    x = torch.randn(t, h, generator=gen)
    grad = torch.randn(t, h, generator=gen)
    exchange = FlatExchange(layout)
    recv_x, recv_w, handle = exchange.dispatch(x, ids, weights)
    recv_x, recv_w = recv_x.detach(), recv_w.detach()

    def run_exchange():
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        rx, rw, hd = exchange.dispatch(xx, ids, ww)
        out = exchange.combine(rx * rw.sum(-1, keepdim=True), hd)
        out.backward(grad)

    def run_experts():
        xx, ww = recv_x.clone().requires_grad_(), recv_w.clone().requires_grad_()
        out = local_experts_forward(xx, handle.recv_local_ids_RJ, ww, experts, counts=handle.expert_counts)
        out.backward(torch.ones_like(out))

    def run_layer(n):
        def run():
            xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
            if n == 1:
                out = moe_forward(xx, ids, ww, experts, exchange)
            else:
                out = pipelined_moe_forward(xx, ids, ww, experts, exchange, n)
            out.backward(grad)

        return run

    cases = {"exchange": run_exchange, "experts": run_experts}
    cases.update({f"layer_{n}": run_layer(n) for n in args["chunks"]})
    names = list(cases)
    for _ in range(args["warmup"]):
        for name in names:
            dist.barrier()
            cases[name]()
    times = {name: [] for name in names}
    for it in range(args["iters"]):
        shift = it % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            cases[name]()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the layer ends when its slowest rank does
            times[name].append(float(elapsed) * 1000.0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    import tempfile

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per process")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--width", type=int, default=256, help="expert intermediate size")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--chunks", default="1,2,4", help="chunk counts of the layer (1 = no pipelining)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    spec = dict(
        experts=args.experts, top_k=args.top_k, tokens=args.tokens, hidden=args.hidden, width=args.width,
        chunks=[int(c) for c in args.chunks.split(",")], iters=args.iters, warmup=args.warmup, threads=args.threads,
    )  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(
            _worker,
            args=(args.devices, os.path.join(tmp, "rendezvous"), spec, out),
            nprocs=args.devices,
            start_method="spawn",
        )
        with open(out) as f:
            times = json.load(f)
    med = {name: statistics.median(v) for name, v in times.items()}
    bound, serial = max(med["exchange"], med["experts"]), med["exchange"] + med["experts"]
    report = {"settings": spec | {"devices": args.devices}, "median_ms": med, "runs_ms": times, "layers": {}}
    print(
        f"{args.devices} gloo processes, {args.tokens} tokens each, hidden {args.hidden}, {args.experts} experts "
        f"top-{args.top_k}, forward + backward, median of {args.iters}"
    )
    print(f"exchange alone {med['exchange']:.1f} ms, local experts alone {med['experts']:.1f} ms")
    for n in spec["chunks"]:
        m = med[f"layer_{n}"]
        report["layers"][n] = {"ms": m, "vs_max": m / bound, "vs_sum": m / serial}
        target = "met" if m <= 1.15 * bound else "not met"
        print(
            f"layer, {n} chunk(s): {m:.1f} ms = {m / bound:.2f} x max(exchange, experts), {m / serial:.2f} x their sum "
            f"(target <= 1.15 x max: {target})"
        )
    if args.json:
        from occult_ft.fileio import atomic_write_text

        atomic_write_text(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
