"""`occult-ft prune MODEL --placement P [--max-devices-per-token N --criterion C] --out DIR`.

Permutes the experts so device d holds a contiguous block and writes a standard HF checkpoint with
its tokenizer. Without a budget it is the same function as MODEL; with one, the settings go to the
`occult` block of config.json and `occult_ft.from_pretrained(DIR)` routes with the budget.
"""

from __future__ import annotations

from ._common import positive_int, standalone

__all__ = ["add_parser", "run"]


def add_parser(sub):
    from ..routing import CRITERIA, GATE_WEIGHT_POLICIES

    p = sub.add_parser("prune", help="write a placed (and optionally pruned) checkpoint", description=__doc__)
    p.add_argument("model", help="local model directory or Hub model id")
    p.add_argument(
        "--placement", required=True, help="placement JSON from `occult-ft place`, or 'sequential'"
    )
    p.add_argument("--devices", type=positive_int, default=None, help="D (only with --placement sequential)")
    p.add_argument(
        "--max-devices-per-token", type=int, default=None, help="budget M (1..D); omit for no pruning"
    )
    p.add_argument("--criterion", default="score", help=f"one of {', '.join(CRITERIA)}")
    p.add_argument("--gate-weights", default="model", help=f"one of {', '.join(GATE_WEIGHT_POLICIES)}")
    p.add_argument("--profile", default=None, help="profile (needed for --criterion similarity)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.set_defaults(func=run)
    return p


def load_placement(spec: str, model, devices: int | None):
    """A `Placement` from a JSON path or 'sequential' (checked against the model)."""
    from ..models import find_moe_layers, get_arch
    from ..placement import Placement, sequential_placement

    layers = find_moe_layers(model)
    num_experts = layers[0].num_experts
    if spec == "sequential":
        if devices is None:
            raise ValueError("--placement sequential needs --devices D")
        return sequential_placement(
            num_experts, devices, [layer.index for layer in layers], model_type=get_arch(model).model_type
        )
    placement = Placement.load(spec)
    placement.check_model(num_experts, [layer.index for layer in layers], get_arch(model).model_type)
    return placement


def run(args) -> int:
    from ..checkpoint import load_model_and_tokenizer, save_pruned
    from ..models import find_moe_layers, get_arch
    from ..placement import permute_experts
    from ..profiling import Profile
    from ..routing import PruningConfig, apply_pruning

    model, tokenizer = load_model_and_tokenizer(args.model)
    placement = load_placement(args.placement, model, args.devices)
    if args.devices is not None and args.devices != placement.num_devices:
        raise ValueError(
            f"--devices {args.devices} disagrees with the placement's {placement.num_devices} devices; drop --devices"
        )
    pruning = None
    similarity = None
    if args.max_devices_per_token is not None:
        pruning = PruningConfig(
            placement.num_devices, args.max_devices_per_token, args.criterion, args.gate_weights
        )
        if args.criterion == "similarity":
            if args.profile is None:
                raise ValueError("--criterion similarity needs --profile PROFILE (from occult-ft profile)")
            prof = Profile.load(args.profile)
            moe = find_moe_layers(model)
            prof.check_model(moe[0].num_experts, [layer.index for layer in moe], get_arch(model).model_type)
            similarity = {}
            for i, sim in prof.similarity().items():
                order = placement.expert_order(i)
                similarity[i] = sim[order][:, order]
    permute_experts(model, placement)
    if pruning is not None:
        apply_pruning(model, pruning, similarity=similarity)  # validates the budget against top-k
    save_pruned(
        model,
        args.out,
        tokenizer=tokenizer,
        pruning=pruning,
        placement=placement,
        similarity=similarity,
        extra={"base_model": args.model},
    )
    budget = (
        f", at most {pruning.max_devices_per_token} devices per token ({pruning.criterion})"
        if pruning
        else ""
    )
    print(f"wrote {args.out}: experts placed on {placement.num_devices} devices{budget}")
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("prune", add_parser))
