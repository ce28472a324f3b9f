"""`occult-ft prune MODEL --placement P [--max-devices-per-token N --criterion C] --out DIR`.

Permutes the experts so device d holds a contiguous block and writes a standard HF checkpoint with
its tokenizer. Without a budget it is the same function as MODEL; with one, the settings go to the
`occult` block of config.json and `occult_ft.from_pretrained(DIR)` routes with the budget.
"""

from __future__ import annotations

import argparse

from ._choices import CRITERIA, DEFAULT_CRITERION, GATE_WEIGHT_POLICIES
from ._common import check_hub_sources, positive_int, quiet_deepspeed_accelerator, standalone

__all__ = ["add_parser", "run"]


def add_parser(sub):
    p = sub.add_parser("prune", help="write a placed (and optionally pruned) checkpoint", description=__doc__)
    p.add_argument("model", help="local model directory or Hub model id")
    p.add_argument(
        "--placement", required=True, help="placement JSON from `occult-ft place`, or 'sequential'"
    )
    p.add_argument("--devices", type=positive_int, default=None, help="D (only with --placement sequential)")
    p.add_argument(
        "--max-devices-per-token", type=int, default=None, help="budget M (1..D); omit for no pruning"
    )
    p.add_argument(
        "--max-nodes-per-token",
        type=int,
        default=None,
        help="node budget (the placement's nodes; DeepSeek-V3's node-limited rule); omit for none",
    )
    p.add_argument(
        "--criterion",
        default=DEFAULT_CRITERION,
        choices=CRITERIA,
        metavar="CRITERION",
        help=f"how over-budget tokens are re-routed: one of {', '.join(CRITERIA)} (similarity needs --profile)",
    )
    p.add_argument(
        "--gate-weights",
        default="model",
        choices=GATE_WEIGHT_POLICIES,
        metavar="POLICY",
        help=f"gate weights of re-routed tokens: one of {', '.join(GATE_WEIGHT_POLICIES)}",
    )
    p.add_argument(
        "--profile", default=None, help="the profile the placement came from (for --criterion similarity)"
    )
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..fileio import check_output_path

    check_output_path(args.out, args.model, args.placement, args.profile, what="--out", directory=True)
    budget = args.max_devices_per_token is not None or args.max_nodes_per_token is not None
    if budget and args.criterion == "similarity" and args.profile is None:
        raise ValueError(
            "--criterion similarity (the default) builds its tables from a profile: pass --profile PROFILE "
            "(the one `occult-ft place` read), or --criterion score"
        )
    check_hub_sources("prune", models=[args.model])

    quiet_deepspeed_accelerator()
    from ..apply import apply_occult, profile_similarity, resolve_placement
    from ..checkpoint import model_block, save_pruned
    from ..checkpoint.load import load_model_and_tokenizer
    from ..routing import PruningConfig

    model, tokenizer = load_model_and_tokenizer(args.model)
    block = model_block(model)
    if block is not None and block.placed:
        raise ValueError(
            f"{args.model} is already a placed occult_ft checkpoint (its config.json has an occult block); "
            "prune the original model instead (its base_model is "
            f"{block.base_model or 'recorded nowhere'}) so the placement applies to the original expert order"
        )
    placement = resolve_placement(args.placement, model, args.devices)
    pruning = None
    similarity = None
    if budget:
        pruning = PruningConfig(
            placement.num_devices,
            args.max_devices_per_token,
            args.criterion,
            args.gate_weights,
            placement.num_nodes,
            args.max_nodes_per_token,
        )
        if args.criterion == "similarity":
            similarity = profile_similarity(args.profile, model)
    apply_occult(model, placement, pruning, similarity)  # validates the budget against top-k
    save_pruned(model, args.out, tokenizer=tokenizer, extra={"base_model": args.model})
    said = ""
    if pruning is not None and pruning.max_devices_per_token is not None:
        said += f", at most {pruning.max_devices_per_token} devices per token"
    if pruning is not None and pruning.max_nodes_per_token is not None:
        said += f", at most {pruning.max_nodes_per_token} of {pruning.num_nodes} nodes per token"
    said += f" ({pruning.criterion})" if pruning is not None else ""
    print(f"wrote {args.out}: experts placed on {placement.num_devices} devices{said}")
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("prune", add_parser))
