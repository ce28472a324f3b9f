"""`occult-ft analyze MODEL --data DATA --devices D [--placement P] [--max-devices-per-token N --criterion C] [--json]`.

Reports the routing metrics of the model's real routing on DATA: comm_complexity (mean devices per
token; rows a de-duplicated all-to-all sends), intra_share, devices-per-token histogram, rows per
token for per-expert (k) vs de-duplicated dispatch, and per-device load imbalance, per layer and overall;
with --nodes N > 1 also node_comm_complexity (mean distinct nodes per token: the rows the two-stage
exchange sends across its inter-node stage). With --placement, also the figures the placement file stores
per layer (from `occult-ft place`: comm_complexity and load imbalance on the profiled and held-out tokens,
the load bound, the lower bound and the gap).
"""

from __future__ import annotations

import argparse
import json
import sys

from ._choices import CRITERIA, DEFAULT_CRITERION
from ._common import (
    add_model_data_args,
    check_hub_sources,
    check_plot_arg,
    data_batches,
    load_args_data,
    note_data_ran_out,
    positive_int,
    quiet_deepspeed_accelerator,
    standalone,
)

__all__ = ["add_parser", "run", "format_report"]


def add_parser(sub):
    p = sub.add_parser(
        "analyze", help="communication metrics of a model's routing on data", description=__doc__
    )
    add_model_data_args(p)
    p.add_argument("--devices", type=positive_int, required=True, help="expert-parallel size D")
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="nodes N the D devices span (reports node_comm_complexity)",
    )
    p.add_argument(
        "--max-nodes-per-token",
        type=int,
        default=None,
        help="node budget: each token reaches experts on at most this many nodes (DeepSeek-V3's rule)",
    )
    p.add_argument("--placement", default=None, help="placement JSON; omitted: the model's own expert order")
    p.add_argument(
        "--max-devices-per-token",
        type=int,
        default=None,
        help="analyse with this pruning budget; omitted: the model's own routing (a pruned checkpoint keeps its budget)",
    )
    p.add_argument(
        "--criterion",
        default=DEFAULT_CRITERION,
        choices=CRITERIA,
        metavar="CRITERION",
        help=f"criterion of the budget: one of {', '.join(CRITERIA)} (similarity needs --profile)",
    )
    p.add_argument(
        "--profile", default=None, help="the profile the placement came from (for --criterion similarity)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, help="also write the comm_complexity figure to this PNG")
    p.set_defaults(func=run)
    return p


def format_report(report) -> str:
    lines = [
        f"{'layer':>5} {'tokens':>8} {'comm_cx':>8} {'intra':>7} {'rows k':>7} {'rows dedup':>10} {'imbal':>6}  devices/token histogram"
    ]
    for m in report.layers:
        lines.append(
            f"{m.layer:>5} {m.tokens:>8} {m.comm_complexity:>8.3f} {m.intra_share:>7.3f} {m.naive_rows_per_token:>7}"
            f" {m.dedup_rows_per_token:>10.3f} {m.load_imbalance:>6.2f}  {m.devices_histogram}"
        )
    lines.append(
        f"{'all':>5} {sum(m.tokens for m in report.layers):>8} {report.comm_complexity:>8.3f} {report.intra_share:>7.3f}"
        f" {report.top_k:>7} {report.comm_complexity:>10.3f} {report.load_imbalance:>6.2f}  {report.devices_histogram}"
    )
    if getattr(report, "mean_load_imbalance", None) is not None and report.layers:
        worst = max(report.layers, key=lambda m: m.load_imbalance)
        lines.append(
            f"device load imbalance (max/mean rows per device): mean over layers {report.mean_load_imbalance:.3f}, "
            f"worst layer {worst.layer} {worst.load_imbalance:.3f}"
        )
    if getattr(report, "node_comm_complexity", None) is not None:
        per_layer = ", ".join(f"{m.layer}: {m.node_comm_complexity:.3f}" for m in report.layers)
        lines.append(
            f"node_comm_complexity ({report.nodes} nodes): {report.node_comm_complexity:.3f} (per layer {per_layer})"
        )
    for key, value in report.extra.items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def analyze_model(
    model,
    batches,
    devices,
    placement=None,
    max_devices_per_token=None,
    criterion=DEFAULT_CRITERION,
    similarity=None,
    max_tokens=None,
    nodes=1,
    max_nodes_per_token=None,
    progress: bool = False,
):
    """Routing report of `model` on `batches` (placement applied in memory first). A model whose routers
    already prune (a pruned checkpoint) keeps its budget unless `max_devices_per_token` is given.
    With `nodes` > 1 the report also holds node_comm_complexity; `progress` shows a bar over the tokens."""
    from ..apply import apply_occult
    from ..metrics import contiguous_expert_device, random_placement_comm_complexity, routing_report
    from ..models import find_moe_layers
    from ..profiling import profile_model
    from ..routing import PruningConfig, pruned_routers

    existing = [router.occult_config for _, router in pruned_routers(model)]
    budget_given = max_devices_per_token is not None or max_nodes_per_token is not None
    if not budget_given and existing and existing[0].active:
        pruning = existing[0]  # a pruned checkpoint keeps its own budget
        apply_occult(model, placement)
    else:
        pruning = PruningConfig(
            devices, max_devices_per_token, criterion, "model", nodes, max_nodes_per_token
        )
        apply_occult(model, placement, pruning, similarity)
    prof = profile_model(model, batches, max_tokens=max_tokens, progress=progress)
    layers = find_moe_layers(model)
    e, k = layers[0].num_experts, layers[0].top_k
    report = routing_report(prof.topk_ids(), contiguous_expert_device(e, devices), devices, e, nodes=nodes)
    report.extra["tokens"] = prof.num_tokens
    report.extra["random_placement_comm_complexity"] = round(
        random_placement_comm_complexity(e, k, devices), 4
    )
    report.extra["max_devices_per_token"] = pruning.max_devices_per_token
    if pruning.max_nodes_per_token is not None:
        report.extra["max_nodes_per_token"] = pruning.max_nodes_per_token
    report.extra["criterion"] = pruning.criterion if pruning.active else None
    return report


def run(args: argparse.Namespace) -> int:
    budget = _check_flags(args)
    check_hub_sources("analyze", models=[args.model], datasets=[args.data])
    data = load_args_data(args)

    quiet_deepspeed_accelerator()
    from ..apply import profile_similarity, resolve_placement
    from ..checkpoint import model_block
    from ..checkpoint.load import from_pretrained, load_tokenizer, resolve_model_path

    model = from_pretrained(args.model)  # a pruned checkpoint routes with its own budget
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    _check_placed_block(args, model_block(model))
    placement = resolve_placement(args.placement, model, args.devices) if args.placement else None
    similarity = None
    if budget and args.criterion == "similarity":
        similarity = profile_similarity(args.profile, model)  # original order; apply_occult reorders
    batches = data_batches(
        tokenizer, data, args.seq_len, args.batch_size, args.max_tokens, response_only=False
    )
    report = analyze_model(
        model,
        batches,
        args.devices,
        placement,
        args.max_devices_per_token,
        args.criterion,
        similarity,
        args.max_tokens,
        nodes=args.nodes,
        max_nodes_per_token=args.max_nodes_per_token,
        progress=True,
    )
    note_data_ran_out("analyze", args.data, report.extra["tokens"], args.max_tokens)
    _print_report(args, report, placement)
    return 0


def _check_flags(args: argparse.Namespace) -> bool:
    """One-line errors for flags that contradict each other (before anything loads); whether a budget
    (`--max_devices_per_token` or `--max_nodes_per_token`) is asked for."""
    from ..checks import divisors, nodes_divide

    check_plot_arg(args.plot, args.model, args.data)
    if not nodes_divide(args.devices, args.nodes):
        raise ValueError(
            f"--nodes {args.nodes} does not divide --devices {args.devices}; use one of {divisors(args.devices)}"
        )
    budget = args.max_devices_per_token is not None or args.max_nodes_per_token is not None
    if budget:  # the budgets' own range first: a bad budget is named before what the criterion needs
        from ..routing import PruningConfig

        PruningConfig(
            args.devices,
            args.max_devices_per_token,
            "score",
            num_nodes=args.nodes,
            max_nodes_per_token=args.max_nodes_per_token,
        )
    if budget and args.criterion == "similarity" and args.profile is None:
        raise ValueError(
            "--criterion similarity (the default) builds its tables from a profile: pass --profile PROFILE "
            "(the one `occult-ft place` read), or --criterion score"
        )
    return budget


def _check_placed_block(args: argparse.Namespace, block) -> None:
    """A checkpoint placed already (its `occult` block) takes no --placement and only its own --devices."""
    if block is None or not block.placed:
        return
    if args.placement:
        raise ValueError(f"{args.model} is already placed (config.json occult block); drop --placement")
    if block.num_devices and block.num_devices != args.devices:
        raise ValueError(
            f"--devices {args.devices} but {args.model} is placed for {block.num_devices} devices; "
            f"use --devices {block.num_devices}"
        )


def _print_report(args: argparse.Namespace, report, placement) -> None:
    """The report as JSON (`--json`) or a table with the placement's stored figures; the figure (`--plot`)."""
    if args.plot:
        from ..plots import plot_report

        plot_report(report, args.plot)
        print(f"wrote the figure to {args.plot}", file=sys.stderr)
    if args.json:
        if placement is not None and placement.metrics:
            report.extra["placement_figures"] = placement.metrics
        print(json.dumps(report.to_dict()))
    else:
        print(format_report(report))
        if placement is not None:
            from .place import format_figures

            print(f"\nfigures stored in {args.placement} ({placement.algorithm}, on the profiled tokens):")
            print(format_figures(placement))


if __name__ == "__main__":
    raise SystemExit(standalone("analyze", add_parser))
