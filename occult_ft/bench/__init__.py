"""Exchange benchmark: the all-to-all of expert parallelism, measured for every backend side by side.

One run replays the same tokens and the same routing (recorded from a real model, or a synthetic
OLMoE-shaped layer) on D processes and measures, per MoE layer, the rows and bytes each backend sends
and the time of its forward exchange (dispatch + combine):

    deepspeed_classic(_nodrop)   DeepSpeed's classic MoE: capacity-based, dense [E, C, H] buffer
    per_expert                   one row per (token, expert): transformers native EP, DeepSpeed AutoEP, Tutel
    hf_native_ep                 transformers' own AllToAllEP
    occult_dedup                 occult_ft.dispatch: one row per (token, device) = C_T rows per token
    occult_dedup_prune{M}        the same after collaboration pruning to M devices per token
    occult_two_stage[_prune{M}]  (--nodes N > 1) one row per (token, node) across nodes, fanned out inside

and predicts, with `occult_ft.bench.costmodel`, the exchange time on named cluster shapes.

    workload.py    routings to replay (model or synthetic), pruned variants, volumes implied by a routing
    exchanges.py   each backend's dispatch + combine on one rank; CollectiveClock
    runner.py      spawning the D processes, timing, collecting
    benchmark.py   run_benchmark: checks, aggregation, cost model, targets -> one report dict
    output.py      the report as a table or a bar chart

Command line: `occult-ft bench` (occult_ft/commands/bench.py).
"""

from .benchmark import DEFAULT_BUDGETS, DEFINITIONS, TARGETS, check_inputs, run_benchmark
from .output import format_report
from .runner import DTYPES, BenchSettings, choose_transport, run_exchanges
from .workload import (
    BACKENDS,
    KINDS,
    OURS,
    PEERS,
    TWO_STAGE,
    LayerRouting,
    Workload,
    deepspeed_capacity,
    layer_volumes,
    mean_comm_complexity,
    model_workload,
    pruned_name,
    routing_variants,
    synthetic_workload,
    two_stage_name,
)

__all__ = [
    "BACKENDS",
    "KINDS",
    "PEERS",
    "OURS",
    "TWO_STAGE",
    "two_stage_name",
    "DEFAULT_BUDGETS",
    "DEFINITIONS",
    "TARGETS",
    "DTYPES",
    "BenchSettings",
    "LayerRouting",
    "Workload",
    "synthetic_workload",
    "model_workload",
    "routing_variants",
    "pruned_name",
    "deepspeed_capacity",
    "layer_volumes",
    "mean_comm_complexity",
    "check_inputs",
    "choose_transport",
    "run_exchanges",
    "run_benchmark",
    "format_report",
]
