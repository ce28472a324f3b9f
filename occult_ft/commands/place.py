"""`occult-ft place PROFILE --devices D [--nodes N] [--algorithm A] [--max-load-imbalance X] [--time-limit S]
[--max-devices-per-token M --criterion C] [--holdout H] --out PLACEMENT.json`.

Prints, per layer, comm_complexity (sequential and placed), the load imbalance (max/mean rows per device)
and the bound it keeps, a proven lower bound of comm_complexity under that bound with the relative gap,
and the same figures on the held-out tokens; all of them are stored in the placement file.
"""

from __future__ import annotations

import argparse
import sys

from ._choices import DEFAULT_ALGORITHM, PLACEMENT_ALGORITHMS
from ._common import check_plot_arg, phase, positive_int, standalone

__all__ = ["add_parser", "run", "format_figures"]


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise ValueError(
            f"--holdout {text} must be a share of the tokens in [0, 1), e.g. 0.5 (or 0 for none)"
        )
    return value


def add_parser(sub):
    p = sub.add_parser("place", help="assign experts to devices from a profile", description=__doc__)
    p.add_argument("profile", help="a profile written by `occult-ft profile`")
    p.add_argument("--devices", type=positive_int, required=True, help="expert-parallel size D")
    p.add_argument(
        "--nodes", type=positive_int, default=1, help="nodes (hierarchical placement: nodes, then devices)"
    )
    p.add_argument(
        "--algorithm",
        default=DEFAULT_ALGORITHM,
        choices=PLACEMENT_ALGORITHMS,
        metavar="ALGORITHM",
        help=f"one of {', '.join(PLACEMENT_ALGORITHMS)} (default {DEFAULT_ALGORITHM}: HiGHS via scipy, "
        "falls back to search without scipy)",
    )
    p.add_argument(
        "--max-load-imbalance",
        type=float,
        default=None,
        help="keep max/mean rows per device within this (>= 1); default max(1.25, occult's imbalance). With a "
        "budget it bounds the pruned routing",
    )
    p.add_argument(
        "--time-limit", type=float, default=None, help="seconds per layer for the solver (default 30)"
    )
    p.add_argument(
        "--max-devices-per-token",
        type=int,
        default=None,
        help="place for this pruning budget: the load bound and figures are for the pruned routing",
    )
    p.add_argument(
        "--criterion",
        default="score",
        help="pruning criterion of the budget: score, device_max or similarity",
    )
    p.add_argument(
        "--holdout",
        type=_share,
        default=0.5,
        help="share of the profiled tokens held out to check the placement on unseen tokens (default 0.5)",
    )
    p.add_argument("--out", required=True, help="placement JSON to write")
    p.add_argument(
        "--plot",
        default=None,
        help="also write a PNG: co-activation heatmaps before/after and comm_complexity per layer "
        "of sequential, occult and this placement against the random expectation and lower bound",
    )
    p.set_defaults(func=run)
    return p


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_figures(placement) -> str:
    """The per-layer figures a placement file stores, as a table (`place` and `analyze` print it)."""
    m = placement.metrics if isinstance(placement.metrics, dict) else {}
    rows = [(layer, placement.figures(layer)) for layer in placement.layers]
    if not any(f for _, f in rows):
        return f"no per-layer figures in this placement (algorithm {placement.algorithm}, an older file)"
    pruned = any(f and "pruned" in f for _, f in rows)
    head = (
        f"{'layer':>5} {'seq':>6} {'placed':>7} {'imbal':>6} {'bound':>6} {'lower':>7} {'gap':>7} "
        f"{'held cc':>7} {'held im':>7} {'s':>6}"
    )
    if pruned:
        head += f" | {'pruned cc':>9} {'imbal':>6} {'removed':>7}"
    lines = [head]
    for layer, f in rows:
        if not f:
            lines.append(f"{layer:>5} (no figures)")
            continue
        held = f.get("held_out") or {}
        line = (
            f"{layer:>5} {_num(f.get('comm_complexity_sequential'), '6.3f')} {_num(f.get('comm_complexity'), '7.3f')}"
            f" {_num(f.get('load_imbalance'), '6.2f')} {_num(f.get('load_bound'), '6.2f')}"
            f" {_num(f.get('lower_bound'), '7.3f')} {_num(None if f.get('gap') is None else max(0.0, 100 * f['gap']), '6.2f')}%"
            f" {_num(held.get('comm_complexity'), '7.3f')} {_num(held.get('load_imbalance'), '7.2f')}"
            f" {_num(f.get('seconds'), '6.1f')}"
        )
        if pruned:
            p = f.get("pruned") or {}
            line += (
                f" | {_num(p.get('comm_complexity'), '9.3f')} {_num(p.get('load_imbalance'), '6.2f')}"
                f" {_num(None if p.get('removed_share') is None else 100 * p['removed_share'], '6.2f')}%"
            )
        if f.get("optimal"):
            line += "  optimal"
        elif f.get("note"):
            line += f"  ({f['note']})"
        lines.append(line)
    overall = (
        f"  all {m.get('comm_complexity_sequential', 0):6.3f} {m.get('comm_complexity', 0):7.3f}"
        f" {m.get('load_imbalance', 0):6.2f} {'':>6} {_num(m.get('lower_bound'), '7.3f')}"
        f" {_num(None if m.get('gap') is None else 100 * m['gap'], '6.2f')}%"
    )
    held = m.get("held_out") or {}
    overall += f" {_num(held.get('comm_complexity'), '7.3f')} {_num(held.get('load_imbalance'), '7.2f')}"
    overall += f" {_num(m.get('seconds'), '6.1f')}"
    lines.append(overall)
    lines.append(
        "seq/placed: comm_complexity on the placed tokens; imbal: max/mean rows per device; bound: the load "
        "bound kept; lower: a proven lower bound of comm_complexity under it; held: the held-out tokens"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..fileio import check_output_path

    check_output_path(args.out, args.profile, what="--out")
    check_plot_arg(args.plot, args.profile, written=(args.out,))

    from ..placement import compute_placement
    from ..profiling import Profile

    prof = Profile.load(args.profile)
    phase(
        "place",
        f"placing the {prof.num_experts} experts of {len(prof.layers)} layers on {args.devices} devices "
        f"with {args.algorithm}",
    )
    options = {} if args.time_limit is None else {"time_limit": args.time_limit}
    placement = compute_placement(
        prof,
        args.devices,
        num_nodes=args.nodes,
        algorithm=args.algorithm,
        max_load_imbalance=args.max_load_imbalance,
        max_devices_per_token=args.max_devices_per_token,
        criterion=args.criterion,
        holdout=args.holdout,
        **options,
    )
    placement.save(args.out)
    print(
        f"{placement.algorithm} placement of {prof.num_experts} experts on {args.devices} devices -> {args.out}"
    )
    if args.plot:
        from ..plots import plot_placement

        shown = {}
        for name in ("sequential", "occult"):
            if name != args.algorithm:
                phase("place", f"placing with {name} too, for the figure")
                shown[name] = compute_placement(
                    prof,
                    args.devices,
                    num_nodes=args.nodes,
                    algorithm=name,
                    holdout=args.holdout,
                    bound_time_limit=0,
                )
        shown[args.algorithm] = placement
        plot_placement(prof, shown, args.plot, chosen=args.algorithm)
        print(f"wrote the figure to {args.plot}", file=sys.stderr)
    print(format_figures(placement))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("place", add_parser))
