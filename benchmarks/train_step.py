"""Whole training steps side by side: data parallel, occult_ft EP (no budget, budgets 2 and 1, per-expert
rows through occult_ft's own exchange), transformers native EP and DeepSpeed MoE, on one model.

    python benchmarks/train_step.py                      # the issue's two shapes, 4 gloo processes
    python benchmarks/train_step.py --shape olmoe64 --rounds 3 --json out.json --plot step.png
    python benchmarks/train_step.py --barrier            # diagnostic: waiting vs transfer per exchange
    python benchmarks/train_step.py --link-rate 1gbit    # in an emulated cluster (root; one node: loopback)
    python benchmarks/train_step.py --link-rate 1gbit --nodes 2 --devices 4 \
        --contenders occult_ep,occult_ep_two_stage       # 2 nodes x 2 processes, two-stage vs flat

Defaults are the shapes of issue 15: hidden 512, 8 layers, 32 experts top-4 (`olmoe32`) and 64
experts top-8 (`olmoe64`), sequence 256, 2,048 tokens per micro-batch on 4 processes (2 sequences
each), 4 micro-batches per optimizer step, 2 rounds of 5 timed steps after 2 warm-up steps, contenders
alternated; `--shape embedded` is the embedded model on its corpus. See `occult_ft.bench.step`
for what is measured and how; `occult-ft bench --train` is the short version.
"""

from __future__ import annotations

import argparse
import json
import sys

from occult_ft.bench.step import DEFAULT_CONTENDERS, SHAPES, StepSettings, run_train_step
from occult_ft.bench.step_report import format_step_report
from occult_ft.fileio import atomic_write_text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape",
        action="append",
        choices=list(SHAPES),
        help="model shape (repeatable; default olmoe64 and embedded)",
    )
    ap.add_argument("--experts", type=int, default=None, help="override the shape's experts")
    ap.add_argument("--top-k", type=int, default=None, help="override the shape's top-k")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=256, help="expert intermediate size")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048, help="global tokens per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--link-rate", default=None, help="emulated cluster link rate, e.g. 1gbit (root)")
    ap.add_argument("--devices", type=int, default=4, help="processes = expert-parallel size")
    ap.add_argument(
        "--nodes", type=int, default=1, help="nodes the processes are read as (two-stage contender)"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over all contenders (order alternates)")
    ap.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help="comma-separated")
    ap.add_argument("--barrier", action="store_true", help="diagnostic mode: barrier before each exchange")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cluster", action="append", default=None, help="cost-model cluster (default 4x8-ib)")
    ap.add_argument("--json", default=None, help="write the reports (one per shape) to this JSON file")
    ap.add_argument("--plot", default=None, help="write a figure to this PNG (one per shape: NAME-SHAPE.png)")
    args = ap.parse_args(argv)
    reports = {}
    for shape in args.shape or ["olmoe64", "embedded"]:
        dims = dict(SHAPES[shape])
        if shape != "embedded":
            dims["experts"] = args.experts or dims["experts"]
            dims["top_k"] = args.top_k or dims["top_k"]
        settings = StepSettings(
            hidden=args.hidden,
            layers=args.layers,
            expert_width=args.expert_width,
            heads=args.heads,
            vocab=args.vocab,
            seq_len=args.seq_len,
            micro_batch_tokens=args.micro_batch_tokens,
            grad_accum=args.grad_accum,
            link_rate=args.link_rate,
            devices=args.devices,
            nodes=args.nodes,
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            barrier=args.barrier,
            threads=args.threads,
            device=args.device,
            dtype=args.dtype,
            **dims,
        )
        contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
        report = run_train_step(
            settings,
            contenders,
            tuple(args.cluster or ("4x8-ib",)),
            progress=lambda m: print(m, file=sys.stderr),
        )
        reports[shape] = report
        if args.json:  # written before anything is printed: a measurement is never lost to the table
            atomic_write_text(args.json, json.dumps(reports, indent=1))
        print(format_step_report(report), flush=True)
        print()
        if args.plot:
            from occult_ft.plots import plot_train_step

            path = args.plot if len(args.shape or SHAPES) == 1 else args.plot.replace(".png", f"-{shape}.png")
            plot_train_step(report, path)
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
