"""What one more piece of expert compute costs: the local experts' grouped matmul against its row count.

    python benchmarks/expert_matmul_cost.py [--experts 16] [--hidden 512] [--width 512] [--rows 256,512,...]

Times `occult_ft.dispatch.local.grouped_linear` (the projection every expert-parallel layer runs, backend
"auto") of P local experts, (H -> O) each, on R rows spread evenly over them, one thread, and fits
time = fixed + R x per_row by least squares. The fixed part is the cost of reading every expert's
weights once (P x H x O floats), whatever the rows; a layer that splits its rows into n pieces (the
chunked pipeline, `exchange_chunks`, and the own rows beside the exchange) pays it once per piece in
each of its grouped matmuls: forward, input gradient and weight gradient of each projection.
Defaults: the step benchmark's OLMoE shape on 4 devices (16 local experts, hidden 512, the fused
gate/up projection 512 wide). Results: docs/cluster.md ("Why chunks cost on this machine").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from occult_ft.dispatch.local import grouped_linear


def _time_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(runs)


def fit_fixed_and_per_row(rows: list[int], times_ms: list[float]) -> tuple[float, float]:
    """(fixed ms, ms per row): the least-squares line time = fixed + rows x per_row through the points."""
    design = torch.tensor([[1.0, float(r)] for r in rows], dtype=torch.float64)
    fit = torch.linalg.lstsq(design, torch.tensor(times_ms, dtype=torch.float64)[:, None]).solution[:, 0]
    return float(fit[0]), float(fit[1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16, help="P, local experts of the rank")
    parser.add_argument("--hidden", type=int, default=512, help="H, input width")
    parser.add_argument("--width", type=int, default=512, help="O, output width (gate + up fused: 2 x I)")
    parser.add_argument("--rows", default="128,256,512,1024,2048,4096", help="row counts R to time")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if len(rows) < 2 or min(rows) < args.experts:
        parser.error(f"--rows {args.rows}: give at least two counts, each >= --experts {args.experts}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    w_EIO = torch.randn(args.experts, args.hidden, args.width, generator=gen)
    times = []
    for r in rows:
        x_NI = torch.randn(r, args.hidden, generator=gen)
        # R rows over P experts in contiguous blocks whose sizes differ by at most one
        counts = [len(block) for block in torch.arange(r).tensor_split(args.experts)]
        times.append(_time_ms(lambda x=x_NI, c=counts: grouped_linear(x, w_EIO, c), args.repeats))
    fixed_ms, per_row_ms = fit_fixed_and_per_row(rows, times)
    weight_mb = args.experts * args.hidden * args.width * w_EIO.element_size() / 1e6
    print(
        f"grouped_linear, {args.experts} experts of {args.hidden} x {args.width} "
        f"({weight_mb:.1f} MB of weights), one thread, median of {args.repeats}:"
    )
    for r, ms in zip(rows, times):
        print(f"  {r:>6} rows: {ms:7.2f} ms")
    print(
        f"fit: {fixed_ms:.2f} ms per call + {1000 * per_row_ms:.2f} us per row "
        f"(the weights read at {weight_mb / max(fixed_ms, 1e-9):.1f} GB/s); "
        f"one more piece of a layer pays it in its three matmuls on these weights (forward, input and "
        f"weight gradient): ~{3 * fixed_ms:.1f} ms"
    )
    return {"rows": rows, "ms": times, "fixed_ms": fixed_ms, "per_row_ms": per_row_ms}


if __name__ == "__main__":
    main()
