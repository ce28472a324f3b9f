"""`occult-ft plan RECIPE [--field value ...] [--gpus N | --nodes N --gpus-per-node G] [--gpu-memory GB] [--config PATH] [--json]`.

Prints what one GPU holds when the recipe trains (weights, gradients, optimizer states, activations,
communication buffers), the total against the GPU's memory, a verdict and, when it does not fit,
concrete changes that make it fit. Nothing is loaded but the model's config: `--config`, else the
recipe's local model directory, a config shipped with occult_ft for the recipes' Hub models, or the Hub.

    occult-ft plan recipes/olmoe-1b-7b.yaml --gpu-memory 48
    occult-ft plan recipes/mixtral-8x7b.yaml --gpus 8 --per_device_train_batch_size 2 --json
    occult-ft plan recipes/deepseek-v3.2.yaml --nodes 4 --gpus-per-node 8

Recipe fields and --field overrides are read as by `occult-ft train`. --gpus defaults to the recipe's
expert_parallel_size; a multi-node launch is given as --nodes N --gpus-per-node G (N * G GPUs; the
expert-parallel group then spans expert_parallel_size / G nodes, with the two-stage exchange's
inter-node buffers when the recipe uses it; there --nodes is the machines, while the recipe's own `nodes`
field says how many of them the group spans, and a note tells when the two disagree). Without
--gpus-per-node, `--nodes N` is that recipe field, as in `occult-ft train` (with --gpus for the GPUs).
--gpu-memory defaults to 80 (GB of 2**30 bytes).
Activations are an estimate.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._common import check_hub_sources, standalone

__all__ = ["add_parser", "run", "main", "format_plan"]

_OWN = {
    "--gpus": int,
    "--nodes": int,
    "--gpus-per-node": int,
    "--gpus_per_node": int,
    "--gpu-memory": float,
    "--gpu_memory": float,
    "--config": str,
}


def add_parser(sub):
    p = sub.add_parser(
        "plan",
        help="per-GPU memory of a recipe (weights, gradients, optimizer, activations) and whether it fits",
        description=__doc__,
        prefix_chars="+",
        add_help=False,
    )
    p.add_argument(
        "argv",
        nargs="*",
        help="RECIPE.yaml, --field value overrides, --gpus or --nodes/--gpus-per-node, --gpu-memory, --json",
    )
    p.set_defaults(func=run)
    return p


def _take_own(argv: list[str], fields: list[str] | None = None) -> tuple[dict, list[str]]:
    """Split plan's own flags from the OccultConfig fields (`fields`: their names, to tell a misspelt own
    flag such as `--gpu` from a field)."""
    from ..checks import close_match

    own, rest, i = {"--json": False}, [], 0
    flags = ["--json", "--gpus", "--gpu-memory", "--config"]
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        name = name.replace("_", "-") if name.replace("_", "-") in flags else name
        if fields is not None and name.startswith("--") and name not in flags:
            field = name[2:].replace("-", "_")
            hint = close_match(name.replace("_", "-"), flags)
            if field not in fields and hint and not close_match(field, fields):
                raise ValueError(f"unknown flag {name}; did you mean {hint}?")
        if name == "--json":
            own["--json"] = True
        elif name in _OWN:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value, e.g. {name} 4")
                value, i = argv[i + 1], i + 1
            try:
                own[name.replace("_", "-")] = _OWN[name](value)
            except ValueError:
                raise ValueError(f"{name} {value!r} is not a valid {_OWN[name].__name__}") from None
        else:
            rest.append(token)
        i += 1
    if "--nodes" in own and "--gpus-per-node" not in own:
        # without --gpus-per-node, --nodes is the recipe field, as in `occult-ft train`: the nodes the
        # expert-parallel group spans
        rest += ["--nodes", str(own.pop("--nodes"))]
    return own, rest


def _expert_parallel_size(rest: list[str]) -> int:
    """expert_parallel_size from the overrides or the recipe (before OccultConfig checks the world size)."""
    from .train import config_parser, load_recipe, split_recipe

    recipe, flags = split_recipe(rest)
    value: int | str = 1
    if recipe is not None:
        value = load_recipe(recipe, config_parser()).get("expert_parallel_size", 1)
    for i, token in enumerate(flags):
        name, eq, v = token.partition("=")
        if name.lstrip("-").replace("-", "_") == "expert_parallel_size":
            value = v if eq else (flags[i + 1] if i + 1 < len(flags) else value)
    try:
        return max(int(value), 1)
    except (TypeError, ValueError):
        raise ValueError(f"expert_parallel_size={value!r} is not a whole number") from None


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def format_plan(plan, model: str | None) -> str:
    s = plan.setup
    gb = plan.breakdown_bytes
    machines = f" ({s.nodes} nodes x {s.gpus_per_node})" if s.gpus_per_node and s.nodes > 1 else ""
    exchange = f" ({s.exchange} exchange over {s.ep_nodes} nodes)" if s.ep > 1 and s.ep_nodes > 1 else ""
    lines = [
        f"{model}: {_count(plan.params_total)} parameters, {_count(plan.params_per_gpu)} per GPU "
        f"({_count(plan.trainable_per_gpu)} trainable), train_mode={s.train_mode}, {s.gpus} GPU"
        + ("s" if s.gpus > 1 else "")
        + f"{machines}, "
        + f"expert_parallel_size={s.ep}{exchange}, "
        + ("no DeepSpeed" if s.zero_stage is None else f"DeepSpeed ZeRO-{s.zero_stage}"),
        f"  batch {s.batch} x {s.seq_len} tokens per GPU, gradient checkpointing "
        + ("on" if s.checkpointing else "off"),
    ]
    labels = {
        "weights": "weights",
        "gradients": "gradients",
        "optimizer_states": "optimizer states",
        "activations": "activations (estimate)",
        "communication_buffers": "communication buffers",
    }
    for key, label in labels.items():
        lines.append(f"  {label:<24} {gb[key] / 2**30:8.2f} GB")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"  {'total per GPU':<24} {plan.per_gpu_gb:8.2f} GB of {s.gpu_memory_gb:g} GB "
        f"({plan.usable_gb:.1f} usable): {verdict}"
    )
    lines += [f"  note: {n}" for n in plan.notes]
    if plan.suggestions:
        lines.append("  to make it fit:")
        lines += [f"    - {t}" for t in plan.suggestions]
    return "\n".join(lines)


def _planned_gpus(own: dict, ep: int) -> int:
    """The GPUs of the launch: --nodes x --gpus-per-node, else --gpus, else the expert-parallel size."""
    nodes, per_node = own.get("--nodes"), own.get("--gpus-per-node")
    if (nodes is None) != (per_node is None):
        raise ValueError("--gpus-per-node needs --nodes (the machines), e.g. --nodes 4 --gpus-per-node 8")
    if nodes is not None and per_node is not None and (nodes < 1 or per_node < 1):
        raise ValueError(
            f"--nodes {nodes} --gpus-per-node {per_node} must both be positive, e.g. --nodes 4 --gpus-per-node 8"
        )
    if nodes is not None and "--gpus" in own and own["--gpus"] != nodes * per_node:
        raise ValueError(
            f"--gpus {own['--gpus']} disagrees with --nodes {nodes} x --gpus-per-node {per_node}; give one of them"
        )
    gpus = nodes * per_node if nodes is not None else own.get("--gpus", ep)
    if gpus < 1 or gpus % ep:
        raise ValueError(
            f"--gpus {gpus} must be a positive multiple of expert_parallel_size={ep}; e.g. --gpus {ep}"
        )
    return gpus


def _check_config_source(model: str | None) -> None:
    """A model that is neither shipped nor local must be reachable on the Hub (plan reads only its config)."""
    from ..configs import shipped_config_path

    if model and not shipped_config_path(model):
        try:
            check_hub_sources("plan", models=[model])
        except ValueError as err:  # plan needs only the config: say how to give it
            raise ValueError(f"{err}, or pass --config PATH/config.json") from None


def run(args: argparse.Namespace) -> int:
    from ..plan import load_model_config, plan_for_config
    from .train import parse_config

    argv = list(args.argv)
    if any(token in ("-h", "--help") for token in argv):
        print(__doc__)
        return 0
    from .train import config_parser, field_names

    own, rest = _take_own(argv, field_names(config_parser()))
    ep = _expert_parallel_size(rest)
    per_node = own.get("--gpus-per-node")
    gpus = _planned_gpus(own, ep)
    # parsed as one process (OccultConfig checks expert_parallel_size against this process's world size),
    # then given the planned expert parallelism back
    config = parse_config([*rest, "--expert_parallel_size", "1"])
    if config is not None:
        if ep > 1 and ep != config.devices:
            raise ValueError(
                f"expert_parallel_size={ep} must equal devices={config.devices}; set devices={ep}"
            )
        config.expert_parallel_size = ep
    if config is None:
        return 0
    if own.get("--config") is None:
        _check_config_source(config.model_name_or_path)
    model_config = load_model_config(config.model_name_or_path, own.get("--config"))
    plan = plan_for_config(
        config, model_config, gpus=gpus, gpu_memory_gb=own.get("--gpu-memory", 80.0), gpus_per_node=per_node
    )
    if own["--json"]:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan, config.model_name_or_path or own.get("--config")))
    return 0 if plan.fits else 1


def main(argv=None) -> int:
    return standalone("plan", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
