"""`occult-ft bench MODEL --data DATA [--devices D] [--placement P] [--max-devices-per-token N] [--json]`
(or `occult-ft bench --synthetic [--devices D] [--experts 64 --top-k 8 --tokens 8192 --hidden 2048]`).

In one run, on the same tokens and routing, spawns D processes (--devices; 4 by default, or one per node
when --nodes does not divide 4; gloo on CPU, or the GPUs present) and
measures per MoE layer the rows and bytes sent and the time of the forward exchange (dispatch +
combine) of: DeepSpeed's classic MoE (capacity factor, and drop-free), per-expert dispatch (one row
per (token, expert), as transformers native EP / DeepSpeed AutoEP send), transformers' native
AllToAllEP, occult_ft's de-duplicated dispatch, and the latter after collaboration pruning to 2 and 1
devices per token (and to N with --max-devices-per-token). With --nodes N the D processes are read as
N nodes of D/N consecutive processes: the two-stage exchange (once per node across nodes, then fan-out
inside the node) is measured too, and rows and bytes are reported inside and across nodes. Routing comes from MODEL run over DATA
(after --placement, if given), or from a synthetic layer. A cost model then predicts the exchange on
named cluster shapes (--cluster, repeatable; presets or NAME:devices_per_node=8,nodes=2,intra=450,
inter=50,latency=10). Prints a table, or with --json one JSON object.

`occult-ft bench --train [--link-rate RATE] [--nodes N] [--devices D] [--experts 64 --top-k 8 --hidden
512 --num-layers 2 --tokens 2048]` measures whole training steps instead (forward, backward, optimizer)
of data parallel (HF Trainer), occult_ft's expert parallelism (no budget, budgets 2 and 1, per-expert
rows through its own exchange), transformers' native EP and DeepSpeed MoE on one OLMoE-shaped model (or,
with MODEL `embedded`, the embedded model on its corpus: trained, skewed routing), side by side: the
short version of benchmarks/train_step.py (`occult_ft.bench.step`), 1 round of 3 steps of --grad-accum
micro-batches by default. `--link-rate RATE` (e.g. 1gbit) runs them in an emulated cluster
(`occult_ft.bench.cluster`; root, iproute2): --nodes N network namespaces of D/N processes whose links
are shaped to RATE (one node: its loopback), built for the run and removed after it.

`occult-ft bench --generate [--devices D]` measures expert-parallel inference instead: prefill tokens/s
and decode ms per token of greedy `generate` on the embedded model, for occult_ft without a budget and
with budgets 2 and 1 (`occult_ft.from_pretrained(DIR, expert_parallel_size=D)`), per-expert rows through
occult_ft's exchange, and transformers' native EP (`occult_ft.bench.generate`); --batch-size prompts
of --seq-len tokens per rank (4 x 128 by default), --new-tokens generated, --iters generate calls per
launch, --rounds; --link-rate and --nodes as for --train.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._choices import BENCH_BACKENDS, BENCH_DTYPES, CLUSTER_PRESETS
from ._common import (
    check_hub_sources,
    check_plot_arg,
    data_batches,
    load_args_data,
    phase,
    positive_int,
    quiet_deepspeed_accelerator,
    standalone,
)

__all__ = ["add_parser", "run", "run_train", "run_generate", "build_workload"]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_parser(sub):
    p = sub.add_parser(
        "bench",
        help="measure the all-to-all of DeepSpeed, HF native EP and occult_ft side by side",
        description=__doc__,
    )
    _add_mode_args(
        p.add_argument_group(
            "what is measured: the exchange of one model's layers (default), or whole steps / generation"
        )
    )
    _add_shape_args(p.add_argument_group("the workload's shape"))
    _add_cluster_args(p.add_argument_group("processes, the network and the cost model"))
    _add_run_args(p.add_argument_group("timing and output"))
    p.set_defaults(func=run)
    return p


def _add_mode_args(p) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help="local model directory or Hub model id (with its tokenizer)"
    )
    p.add_argument(
        "--data", default=None, help="data to route (as for occult-ft analyze); 'embedded' = shipped text"
    )
    p.add_argument(
        "--synthetic", action="store_true", help="no model: an OLMoE-shaped layer with uniform routing"
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="measure whole training steps of every contender (occult_ft.bench.step) instead of the exchange",
    )
    p.add_argument(
        "--generate",
        action="store_true",
        help="measure expert-parallel prefill and decode of greedy generate (occult_ft.bench.generate) instead",
    )
    p.add_argument(
        "--backends",
        default=None,
        help=f"comma-separated subset to measure: {', '.join(BENCH_BACKENDS)}, occult_dedup_pruneM "
        "(with --nodes > 1: occult_two_stage, occult_two_stage_pruneM); with --train the contenders: "
        "data_parallel, occult_ep[_per_expert|_two_stage][_budgetM][_chunksN][_overlap][_capacity][_balanced], "
        "hf_native_ep, "
        "deepspeed_moe; with --generate: occult_ep[_budgetM][_per_expert][_two_stage][_exact], hf_native_ep",
    )
    p.add_argument("--placement", default=None, help="placement JSON applied to the model first")
    p.add_argument(
        "--max-devices-per-token",
        type=positive_int,
        default=None,
        help="also measure pruning to N devices (1 and 2 are always measured)",
    )
    p.add_argument(
        "--layers", type=_int_list, default=None, help="MoE layers to measure, e.g. 0,7 (default: all)"
    )


def _add_shape_args(p) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="tokens to route and exchange")
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="tokens per sequence (256; --generate: prompt tokens, 128)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="sequences per forward pass (8; --generate: prompts per rank, 4)",
    )
    p.add_argument("--experts", type=positive_int, default=64, help="--synthetic: experts E")
    p.add_argument("--top-k", type=positive_int, default=8, help="--synthetic: experts per token K")
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=None,
        help="--synthetic: tokens T (8192); --train: per micro-batch, all processes (2048)",
    )
    p.add_argument(
        "--num-layers", type=positive_int, default=None, help="--synthetic: MoE layers (1); --train: 2"
    )
    p.add_argument(
        "--hidden",
        type=positive_int,
        default=None,
        help="width of the exchanged rows (default: the model's hidden_size; 2048 with --synthetic)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=BENCH_DTYPES, help="dtype of the exchanged rows")
    p.add_argument(
        "--new-tokens", type=positive_int, default=None, help="--generate: tokens generated per prompt (16)"
    )
    p.add_argument(
        "--grad-accum", type=positive_int, default=4, help="--train: micro-batches per optimizer step"
    )
    p.add_argument(
        "--shared-experts",
        type=int,
        default=0,
        help="--train: shared experts per MoE block, the random model then DeepSeek-V3-shaped (0: none, "
        "OLMoE-shaped); the occult_ep_shared contenders run them beside the combine",
    )
    p.add_argument(
        "--capacity-factor", type=_positive_float, default=1.0, help="DeepSpeed classic's capacity factor"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing and the hidden rows")


def _add_cluster_args(p) -> None:
    p.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="processes = expert-parallel size D (>= 2); default 4, or one per node when --nodes does not "
        "divide 4",
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="read the D processes as N nodes of D/N (consecutive ranks); N > 1 adds the two-stage exchange "
        "(occult_two_stage) and rows/bytes inside and across nodes",
    )
    p.add_argument(
        "--link-rate",
        default=None,
        help="--train / --generate: run in an emulated cluster of --nodes network namespaces whose links are shaped to "
        "this rate (tc tbf), e.g. 1gbit or 300mbit; one node: its loopback is shaped (needs root, iproute2)",
    )
    p.add_argument(
        "--cluster",
        action="append",
        default=None,
        help=f"cost-model cluster (repeatable): {', '.join(CLUSTER_PRESETS)} or NAME:devices_per_node=..,"
        "nodes=..,intra=GBps,inter=GBps,latency=us (default: all presets)",
    )
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are present")
    p.add_argument(
        "--barrier", action="store_true", help="--train: barrier before each exchange (waiting vs transfer)"
    )


def _add_run_args(p) -> None:
    p.add_argument(
        "--iters",
        type=positive_int,
        default=None,
        help="timed iterations per backend and layer (median; 5), or --train: timed steps (3)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="--train / --generate: rounds over all contenders (1 / 2)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, help="also write a bar chart to this PNG")


def build_workload(args: argparse.Namespace, settings):
    """The `Workload` named by the arguments (model routed over data, or synthetic)."""
    from ..bench import check_inputs, model_workload, synthetic_workload

    if args.synthetic:
        if args.model is not None or args.data is not None or args.placement is not None:
            raise ValueError(
                "--synthetic takes no MODEL, --data or --placement; drop them or drop --synthetic"
            )
        tokens = args.tokens or 8192
        check_inputs(args.experts, args.top_k, tokens, settings)
        return synthetic_workload(
            args.experts, args.top_k, tokens, args.hidden or 2048, args.num_layers or 1, args.seed
        )
    if args.model is None:
        raise ValueError("give MODEL --data DATA, or --synthetic for a model-free OLMoE-shaped layer")
    if args.data is None:
        raise ValueError("MODEL needs --data DATA (a text/jsonl file, a dataset, or 'embedded')")
    from ..apply import apply_occult, resolve_placement
    from ..checkpoint.load import load_model_and_tokenizer
    from ..models import find_moe_layers

    check_hub_sources("bench", models=[args.model], datasets=[args.data])
    data = load_args_data(args)
    phase("bench", f"routing {args.model} over {args.max_tokens} tokens of {args.data}")
    model, tokenizer = load_model_and_tokenizer(args.model)
    first = find_moe_layers(model)[0]
    check_inputs(first.num_experts, first.top_k, args.max_tokens, settings)
    if args.placement is not None:
        apply_occult(model, resolve_placement(args.placement, model, args.devices))
    batches = data_batches(
        tokenizer, data, args.seq_len or 256, args.batch_size or 8, args.max_tokens, response_only=False
    )
    return model_workload(
        model,
        batches,
        name=args.model,
        max_tokens=args.max_tokens,
        hidden=args.hidden,
        layer_indices=args.layers,
        placement=args.placement,
    )


def default_devices(nodes: int) -> int:
    """D when --devices is not given: 4 processes (4 nodes of 1, 2 of 2, or 1 of 4: the setting the
    documented figures use), or one per node for a node count that does not divide 4."""
    return 4 if 4 % nodes == 0 else nodes


def run_train(args: argparse.Namespace) -> int:
    """`--train`: the train-step benchmark with the command's flags (a short run by default)."""
    from ..bench.step import DEFAULT_CONTENDERS, StepSettings, run_train_step
    from ..bench.step_report import format_step_report

    if args.model not in (None, "embedded") or args.data is not None or args.placement is not None:
        raise ValueError(
            "--train builds its own OLMoE-shaped model, or takes MODEL 'embedded' (the embedded model on "
            "its corpus); drop MODEL, --data and --placement"
        )
    if args.link_rate is not None:
        from ..bench.cluster import check_cluster_support, parse_rate

        parse_rate(args.link_rate)
        check_cluster_support()
    settings = StepSettings(
        hidden=args.hidden or 512,
        layers=args.num_layers or 2,
        experts=args.experts,
        top_k=args.top_k,
        seq_len=args.seq_len or 256,
        micro_batch_tokens=args.tokens or 2048,
        grad_accum=args.grad_accum,
        shared_experts=args.shared_experts,
        devices=args.devices,
        nodes=args.nodes,
        link_rate=args.link_rate,
        model="embedded" if args.model == "embedded" else "random",
        steps=args.iters or 3,
        warmup=args.warmup,
        rounds=args.rounds or 1,
        barrier=args.barrier,
        device="cpu" if args.cpu else "auto",
        seed=args.seed,
    )
    contenders = (
        [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else DEFAULT_CONTENDERS
    )
    report = run_train_step(
        settings, contenders, tuple(args.cluster or ("4x8-ib",)), progress=lambda m: print(m, file=sys.stderr)
    )
    if args.plot:
        from ..plots import plot_train_step

        plot_train_step(report, args.plot)
        print(f"wrote the figure to {args.plot}", file=sys.stderr)
    print(json.dumps(report) if args.json else format_step_report(report))
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """`--generate`: the generation benchmark with the command's flags."""
    from ..bench.generate import GenerateSettings, format_generate_report, run_generate_bench

    if args.model not in (None, "embedded") or args.data is not None or args.placement is not None:
        raise ValueError(
            "--generate measures the embedded model on its corpus (it places and prunes it itself); drop "
            "MODEL, --data and --placement"
        )
    if args.synthetic or args.barrier or args.max_devices_per_token is not None:
        raise ValueError(
            "--generate takes no --synthetic, --barrier or --max-devices-per-token; name budgets in "
            "--backends (occult_ep_budgetM)"
        )
    if args.plot is not None:
        raise ValueError("--generate draws no figure; drop --plot (--json gives the figures)")
    settings = GenerateSettings(
        devices=args.devices,
        nodes=args.nodes,
        link_rate=args.link_rate,
        batch=args.batch_size or 4,
        prompt_len=args.seq_len or 128,
        new_tokens=args.new_tokens or 16,
        iters=args.iters or 3,
        warmup=args.warmup,
        rounds=args.rounds or 2,
        device="cpu" if args.cpu else "auto",
        seed=args.seed,
    )
    contenders = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    if contenders:
        from ..bench.generate import generate_contender

        for name in contenders:
            generate_contender(name, settings)
    if args.link_rate is not None:
        from ..bench.cluster import check_cluster_support

        check_cluster_support()
    report = run_generate_bench(settings, contenders, progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(report) if args.json else format_generate_report(report))
    return 0


def run(args: argparse.Namespace) -> int:
    quiet_deepspeed_accelerator()
    from ..bench import DEFAULT_BUDGETS, BenchSettings, format_report, run_benchmark
    from ..bench.costmodel import get_cluster

    check_plot_arg(args.plot)
    if args.devices is None:
        args.devices = default_devices(args.nodes)
    if args.train and args.generate:
        raise ValueError("--train and --generate measure different things; pass one of them")
    if args.train:
        return run_train(args)
    if args.generate:
        return run_generate(args)
    if args.new_tokens is not None:
        raise ValueError("--new-tokens is a --generate setting; drop it or pass --generate")
    settings = BenchSettings(
        devices=args.devices,
        nodes=args.nodes,
        iters=args.iters or 5,
        warmup=args.warmup,
        dtype=args.dtype,
        capacity_factor=args.capacity_factor,
        seed=args.seed,
        transport="cpu" if args.cpu else "auto",
    )
    for cluster in args.cluster or ():
        get_cluster(cluster)
    workload = build_workload(args, settings)
    budgets = list(DEFAULT_BUDGETS) + ([args.max_devices_per_token] if args.max_devices_per_token else [])
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None

    def announce() -> None:
        where = "gloo, CPU" if args.cpu else "GPUs if present"
        phase(
            "bench",
            f"measuring the exchanges on {args.devices} processes ({where}): "
            f"{args.warmup} + {args.iters} iterations per backend and layer",
        )

    report = run_benchmark(workload, settings, budgets, backends, args.cluster, on_start=announce)
    if args.plot:
        from ..plots import plot_bench

        plot_bench(report, args.plot)
        print(f"wrote the figure to {args.plot}", file=sys.stderr)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("bench", add_parser))
