"""`occult-ft place PROFILE --devices D [--nodes N] [--algorithm A] --out PLACEMENT.json`."""

from __future__ import annotations

import sys

from ._choices import DEFAULT_ALGORITHM, PLACEMENT_ALGORITHMS
from ._common import phase, positive_int, standalone

__all__ = ["add_parser", "run"]


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
        help=f"one of {', '.join(PLACEMENT_ALGORITHMS)}",
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


def run(args) -> int:
    from ..fileio import check_output_path

    check_output_path(args.out, args.profile, what="--out")
    if args.plot:
        check_output_path(args.plot, args.profile, args.out, what="--plot")

    from ..metrics import contiguous_expert_device, routing_report
    from ..placement import compute_placement
    from ..profiling import Profile

    prof = Profile.load(args.profile)
    phase(
        "place",
        f"placing the {prof.num_experts} experts of {len(prof.layers)} layers on {args.devices} devices "
        f"with {args.algorithm}",
    )
    placement = compute_placement(prof, args.devices, num_nodes=args.nodes, algorithm=args.algorithm)
    placement.save(args.out)
    ids = prof.topk_ids()
    seq = routing_report(
        ids, contiguous_expert_device(prof.num_experts, args.devices), args.devices, prof.num_experts
    )
    placed = routing_report(ids, {i: placement.expert_device(i) for i in ids}, args.devices, prof.num_experts)
    print(f"{args.algorithm} placement of {prof.num_experts} experts on {args.devices} devices -> {args.out}")
    if args.plot:
        from ..plots import plot_placement

        shown = {}
        for name in ("sequential", "occult"):
            if name != args.algorithm:
                phase("place", f"placing with {name} too, for the figure")
                shown[name] = compute_placement(prof, args.devices, num_nodes=args.nodes, algorithm=name)
        shown[args.algorithm] = placement
        plot_placement(prof, shown, args.plot, chosen=args.algorithm)
        print(f"wrote the figure to {args.plot}", file=sys.stderr)
    print(
        f"comm_complexity on the profile: sequential {seq.comm_complexity:.3f} -> placed {placed.comm_complexity:.3f}"
        f" (intra_share {seq.intra_share:.3f} -> {placed.intra_share:.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("place", add_parser))
