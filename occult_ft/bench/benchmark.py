"""`run_benchmark`: one run, every backend on the same tokens and routing, one JSON-ready report.

Steps: check the inputs (one-line `ValueError`s), give each of the D processes an equal share of the
tokens, derive the pruned routings, measure every backend (`runner.run_exchanges`), check that the
rows each process sent are exactly the volumes the routing implies (`workload.layer_volumes`; for
de-duplicated dispatch that is sum over tokens of C_T), then aggregate per backend, predict the
exchange on named cluster shapes (`occult_ft.bench.costmodel`) and state whether the targets were reached.

With `settings.nodes` N > 1 the D processes are read as N nodes of D/N consecutive processes: the
two-stage exchange (`occult_two_stage`, and after each pruning budget) is measured too, every backend's
rows are split into rows inside nodes and rows across nodes, and the run checks that the two-stage
exchange sends exactly sum over tokens of N_T rows over its inter-node stage (of which those to other
nodes cross: the node-level count), against the flat exchange's cross-node device rows.

Report fields (`definitions` in the report repeats them):
    kind              dispatch family: capacity (DeepSpeed classic), per_expert or dedup (`workload.KINDS`)
    max_devices_per_token  the pruning budget M of a pruned de-duplicated backend; None for the others
    rows              rows sent by the dispatch all-to-alls, all processes and measured layers (the
                      combine sends as many back); rows a process sends itself are included, as in C_T
    rows_per_token    rows / (tokens x layers): K for per-expert dispatch, C_T for de-duplicated
    remote_rows       rows that cross processes
    bytes             payload of dispatch + combine: 2 x rows x hidden x element size (two-stage: both
                      stages, 2 x (rows + stage2_rows) x hidden x element size)
    cross_node_rows   (nodes > 1) dispatch rows between two nodes; cross_node_bytes = 2 x that x row bytes
    intra_node_rows   (nodes > 1) dispatch rows between two devices of one node (two-stage: its fan-out)
    collective_bytes  bytes handed to the collectives, measured: payload + metadata (split sizes,
                      local expert ids, gate weights)
    exchange_ms       time inside the collectives of one forward (dispatch + combine) of all measured
                      layers: median over iterations of the slowest process
    path_ms           the same for the whole dispatch + combine path (packing, layouts, unpacking too)
    speedup_vs_best_peer  best peer's exchange_ms / this backend's
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import ExpertLayout
from ..metrics import contiguous_expert_device, device_counts, devices_per_token, expert_node
from .costmodel import (
    CLUSTER_PRESETS,
    ClusterShape,
    capacity_rows_matrix,
    get_cluster,
    predict_exchange_ms,
    predict_two_stage_exchange_ms,
    pruned_topk,
    rows_matrix,
    split_rows,
    token_ranks,
    two_stage_rows,
)
from .runner import BenchSettings, run_exchanges
from .workload import (
    BACKENDS,
    KINDS,
    PEERS,
    TWO_STAGE,
    Workload,
    deepspeed_capacity,
    layer_volumes,
    mean_comm_complexity,
    pruned_name,
    routing_variants,
    token_capacity,
    two_stage_name,
)

__all__ = ["DEFAULT_BUDGETS", "TARGETS", "DEFINITIONS", "run_benchmark", "check_inputs"]

DEFAULT_BUDGETS = (2, 1)
TARGETS = {"occult_dedup": 1.5, pruned_name(2): 2.5}
"""Exchange-time speed-up over the best peer that de-duplication (and pruning to 2 devices) should reach."""

DEFINITIONS = {
    "kind": "dispatch family: capacity (DeepSpeed classic, a dense [E, C, H] buffer), per_expert (one row per "
    "(token, expert)), dedup (one row per (token, device)) or dedup_capacity (dedup with capacity-bounded "
    "buffers: ceil(T / D) rows to every process, padded, nothing dropped, no host synchronisation)",
    "max_devices_per_token": "pruning budget M of a de-duplicated backend (collaboration pruning to M devices per "
    "token); None when the backend does not prune",
    "rows": "rows sent by the dispatch all-to-alls over all processes and measured layers (the combine sends "
    "as many back); rows a process sends itself are included, as in comm_complexity",
    "rows_per_token": "rows / (tokens x layers): top_k for per-expert dispatch, comm_complexity for de-duplicated",
    "remote_rows": "rows that cross processes",
    "bytes": "payload of dispatch + combine: 2 x rows x hidden x element size",
    "collective_bytes": "bytes handed to the collectives, measured (payload + split sizes, expert ids, weights)",
    "exchange_ms": "time inside the collectives of one forward dispatch + combine over the measured layers; "
    "per iteration the slowest process, median over iterations",
    "path_ms": "the same for the whole dispatch + combine path (packing, layouts and unpacking included)",
    "speedup_vs_best_peer": "exchange_ms of the fastest peer / exchange_ms of this backend",
    "cross_node_rows": "(nodes > 1) dispatch rows that travel between two nodes (the combine sends as many back)",
    "cross_node_bytes": "(nodes > 1) 2 x cross_node_rows x hidden x element size",
    "intra_node_rows": "(nodes > 1) dispatch rows between two devices of one node (two-stage: its fan-out stage)",
    "stage2_rows": "two-stage only: rows of the intra-node fan-out stage (rows counts the inter-node stage)",
    "node_comm_complexity": "mean distinct nodes per token (N_T): the two-stage exchange's rows per token",
    "load_imbalance": "device load imbalance: max / mean rows a device receives in one dispatch (for the "
    "two-stage exchange, its fan-out to the expert devices), mean over the measured layers; the most loaded "
    "device sets the layer's time",
}


def check_inputs(num_experts: int, top_k: int, tokens: int, settings: BenchSettings) -> None:
    """Raise a one-line ValueError when the benchmark cannot run on these sizes."""
    d = settings.devices
    ExpertLayout(num_experts, d, settings.nodes)
    if tokens < d:
        raise ValueError(f"{tokens} tokens cannot be shared by {d} processes; use more tokens (at least {d})")


def _feasible_budgets(
    budgets: Sequence[int], num_experts: int, top_k: int, devices: int
) -> tuple[list[int], list[str]]:
    kept, notes = [], []
    per_device = num_experts // devices
    for m in sorted(set(budgets), reverse=True):
        if m < 1:
            raise ValueError(f"max_devices_per_token={m} must be at least 1")
        if m > devices:
            notes.append(
                f"max_devices_per_token={m} exceeds devices={devices}: same as occult_dedup, not measured"
            )
        elif m * per_device < top_k:
            notes.append(
                f"max_devices_per_token={m} holds {m * per_device} experts < top_k={top_k}: not measured"
            )
        else:
            kept.append(m)
    return kept, notes


def _load_imbalance(rows_DD: torch.Tensor) -> float:
    """max / mean rows received per device in one dispatch (the devices that run the experts)."""
    load_D = rows_DD.sum(dim=0).double()
    return float(load_D.max() / load_D.mean()) if load_D.numel() and load_D.sum() > 0 else 0.0


def _check_volumes(
    name: str, li: int, measured: dict, ids_TK: torch.Tensor, num_experts: int, settings: BenchSettings
) -> None:
    expected_DD, dropped = layer_volumes(
        ids_TK,
        name,
        num_experts,
        settings.devices,
        settings.capacity_factor,
        settings.min_capacity,
        nodes=settings.nodes,
    )
    got_DD = torch.tensor(measured["rows_DD"], dtype=torch.long)
    if name.startswith(TWO_STAGE):
        dev_E = contiguous_expert_device(num_experts, settings.devices)
        stage2_DD = two_stage_rows(ids_TK, dev_E, settings.devices, settings.nodes)[1]
        got2_DD = torch.tensor(measured["stage2_rows_DD"], dtype=torch.long)
        if not torch.equal(got2_DD, stage2_DD):
            raise RuntimeError(
                f"{name}, layer {li}: the intra-node stage sent {got2_DD.sum().item()} rows but the routing "
                f"implies {stage2_DD.sum().item()}; please report this bug"
            )
    if not torch.equal(got_DD, expected_DD) or measured["dropped_routes"] != dropped:
        raise RuntimeError(
            f"{name}, layer {li}: the processes sent {got_DD.sum().item()} rows ({measured['dropped_routes']} routes "
            f"dropped) but the routing implies {expected_DD.sum().item()} ({dropped}); please report this bug"
        )


def _cluster_rows(
    kind: str,
    capacity_factor: float | None,
    ids_TK: torch.Tensor,
    scores_TE: torch.Tensor,
    num_experts: int,
    devices: int,
    settings: BenchSettings,
    budget: int | None,
) -> torch.Tensor:
    """(D', D') dispatch rows of a backend of `kind` (`capacity_factor` None = drop-free) when the same
    tokens run on D' devices."""
    if kind == "capacity":
        capacity, _ = deepspeed_capacity(ids_TK, num_experts, devices, capacity_factor, settings.min_capacity)
        return capacity_rows_matrix(devices, num_experts, capacity)
    if kind == "dedup_capacity":
        return torch.full((devices, devices), token_capacity(ids_TK.shape[0], devices), dtype=torch.long)
    dev_E = contiguous_expert_device(num_experts, devices)
    if budget is not None:
        ids_TK = pruned_topk(scores_TE, ids_TK, dev_E, devices, min(budget, devices))
    return rows_matrix(ids_TK, dev_E, devices, dedup=kind == "dedup")


def _node_counts(ids_TK: torch.Tensor, num_experts: int, devices: int, nodes: int) -> tuple[int, int]:
    """(sum over tokens of N_T, sum over tokens of the nodes other than the token's own among them)."""
    node_E = expert_node(contiguous_expert_device(num_experts, devices), devices, nodes)
    present_TN = device_counts(ids_TK, node_E, nodes) > 0
    own_T = token_ranks(ids_TK.shape[0], devices) // (devices // nodes)
    home = int(present_TN[torch.arange(ids_TK.shape[0]), own_T].sum()) if ids_TK.shape[0] else 0
    return int(present_TN.sum()), int(present_TN.sum()) - home


def _node_split(name: str, rows_DD: torch.Tensor, stage2_DD: torch.Tensor | None, per_node: int) -> dict:
    """cross_node_rows / intra_node_rows of one dispatch (both stages of a two-stage one)."""
    parts = [split_rows(rows_DD, per_node)] + (
        [split_rows(stage2_DD, per_node)] if stage2_DD is not None else []
    )
    return {
        "cross_node_rows": sum(p["cross_node"] for p in parts),
        "intra_node_rows": sum(p["intra_node"] for p in parts),
    }


def _cost_model(
    workload: Workload,
    backends: list[dict],
    measured_rows: dict,
    settings: BenchSettings,
    clusters: Sequence[str] | None,
) -> dict:
    bytes_per_row = workload.hidden * settings.element_size
    shapes = [get_cluster(c) for c in (clusters if clusters else CLUSTER_PRESETS)]
    out: dict[str, Any] = {
        "bytes_per_row": bytes_per_row,
        "clusters": [],
        "notes": [
            "predicted forward exchange (dispatch + combine) of all measured layers; nominal link speeds",
            "a cluster with as many devices as processes uses the measured volumes; others re-derive the volumes "
            "from the same routing and tokens spread over their devices (pruning re-applied at that size with the "
            "score criterion; a placement made for the benchmark's devices is kept as contiguous blocks)",
        ],
    }
    for shape in shapes:
        out["clusters"].append(_cluster_entry(shape, workload, backends, measured_rows, settings))
    return out


def _cluster_entry(
    shape: ClusterShape,
    workload: Workload,
    backends: list[dict],
    measured_rows: dict,
    settings: BenchSettings,
) -> dict[str, Any]:
    """One cluster's predictions for every backend whose budget holds top_k experts at its size."""
    d = shape.num_devices
    entry: dict[str, Any] = {
        **shape.to_dict(),
        "num_devices": d,
        "volumes": "measured" if d == settings.devices else "derived",
    }
    if workload.num_experts % d or workload.tokens < d:
        entry["skipped"] = (
            f"{d} devices do not divide the {workload.num_experts} experts or exceed the tokens"
        )
        return entry
    preds, left_out = [], []
    for b in backends:
        budget = b["max_devices_per_token"]
        if budget is not None and budget * (workload.num_experts // d) < workload.top_k:
            left_out.append(b["backend"])
            continue
        preds.append(_predict_backend(b, shape, workload, measured_rows, settings))
    best_peer = min((p["predicted_ms"] for p in preds if p["backend"] in PEERS), default=None)
    for p in preds:
        p["speedup_vs_best_peer"] = best_peer / p["predicted_ms"] if best_peer and p["predicted_ms"] else None
    entry["backends"] = preds
    if left_out:
        entry["not_predicted"] = (
            f"{', '.join(left_out)}: {workload.num_experts // d} experts per device x budget < top_k={workload.top_k}"
        )
    return entry


def _predict_backend(
    b: dict, shape: ClusterShape, workload: Workload, measured_rows: dict, settings: BenchSettings
) -> dict:
    """One backend's predicted exchange on `shape` over all layers: the measured volumes when the cluster
    has as many devices as the run, else volumes re-derived from the routing at its size."""
    d, bytes_per_row = shape.num_devices, workload.hidden * settings.element_size
    name, kind, budget = b["backend"], b["kind"], b["max_devices_per_token"]
    total = 0.0
    rows = cross = intra = 0
    for li, lr in enumerate(workload.layers):
        stage2_DD = None
        if kind == "two_stage":
            dev_E = contiguous_expert_device(workload.num_experts, d)
            ids_TK = lr.topk_ids_TK
            if budget is not None:
                ids_TK = pruned_topk(lr.scores_TE, ids_TK, dev_E, d, min(budget, d))
            rows_DD, stage2_DD = two_stage_rows(ids_TK, dev_E, d, shape.nodes)
            total += predict_two_stage_exchange_ms(rows_DD, stage2_DD, bytes_per_row, shape)
        else:
            if d == settings.devices and (name, li) in measured_rows:
                rows_DD = measured_rows[(name, li)]
            else:
                factor = settings.capacity_factor if name == "deepspeed_classic" else None
                rows_DD = _cluster_rows(
                    kind, factor, lr.topk_ids_TK, lr.scores_TE, workload.num_experts, d, settings, budget
                )
            total += predict_exchange_ms(rows_DD, bytes_per_row, shape)
        rows += int(rows_DD.sum())
        split = _node_split(name, rows_DD, stage2_DD, shape.devices_per_node)
        cross += split["cross_node_rows"]
        intra += split["intra_node_rows"]
    return {
        "backend": name,
        "kind": kind,
        "max_devices_per_token": budget,
        "rows_per_token": rows / (workload.tokens * len(workload.layers)),
        "cross_node_MB": 2 * cross * bytes_per_row / 1e6,
        "intra_node_MB": 2 * intra * bytes_per_row / 1e6,
        "predicted_ms": total,
    }


def _lineup(kept: list[int], nodes: int, backends: Sequence[str] | None) -> tuple[list[str], dict, dict]:
    """(names to measure, backend -> dispatch family, backend -> pruning budget) of one run."""
    budget_of = {pruned_name(m): m for m in kept}
    kind_of = {**KINDS, **dict.fromkeys(budget_of, "dedup")}
    all_names = list(BACKENDS) + list(budget_of)
    if nodes > 1:
        staged = {two_stage_name(): None, **{two_stage_name(m): m for m in kept}}
        budget_of.update({n: m for n, m in staged.items() if m is not None})
        kind_of.update(dict.fromkeys(staged, "two_stage"))
        all_names += list(staged)
    names = all_names if backends is None else list(backends)
    unknown = [n for n in names if n not in all_names]
    if unknown:
        raise ValueError(f"unknown or unmeasurable backends {unknown}; choose from {', '.join(all_names)}")
    return names, kind_of, budget_of


def _remote_rows(rows_DD: torch.Tensor | None) -> int:
    """Rows of one dispatch stage that leave their process (the diagonal stays home)."""
    return 0 if rows_DD is None else int(rows_DD.sum() - rows_DD.diagonal().sum())


_MEASURED = ("exchange_ms", "path_ms", "collective_bytes", "exchange_ms_runs", "path_ms_runs")
"""What a process measured of one backend and layer, copied into that layer's row."""


@dataclass
class _Run:
    """One measured run and what its aggregation steps share: the workload, the settings, the backends
    (names, dispatch family, pruning budget), the routing variants and the raw measurements; every (D, D)
    rows matrix measured lands in `measured_rows` (the cost model reuses them)."""

    workload: Workload
    settings: BenchSettings
    names: list[str]
    kind_of: dict[str, str]
    budget_of: dict[str, int]
    kept: list[int]
    variants: dict
    raw: dict
    measured_rows: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def layer_entry(self, li: int) -> dict[str, Any]:
        """Layer li: its comm complexities (pruned and node-level too) and one row per backend."""
        lr, e, d, nodes = (
            self.workload.layers[li],
            self.workload.num_experts,
            self.settings.devices,
            self.settings.nodes,
        )
        tokens = self.workload.tokens
        entry: dict[str, Any] = {
            "layer": lr.layer,
            "comm_complexity": mean_comm_complexity(lr.topk_ids_TK, e, d),
        }
        for m in self.kept:
            entry[f"comm_complexity_prune{m}"] = mean_comm_complexity(
                self.variants[pruned_name(m)][li][0], e, d
            )
        if nodes > 1:
            entry["node_comm_complexity"] = _node_counts(lr.topk_ids_TK, e, d, nodes)[0] / tokens
            for m in self.kept:
                ids_m = self.variants[pruned_name(m)][li][0]
                entry[f"node_comm_complexity_prune{m}"] = _node_counts(ids_m, e, d, nodes)[0] / tokens
        entry["backends"] = [self.backend_row(name, li) for name in self.names]
        return entry

    def backend_row(self, name: str, li: int) -> dict[str, Any]:
        """One backend on layer li: its rows (measured and checked against the routing, or derived from
        it when the backend was not measured), remote and dropped routes, load, node split, timings."""
        e, d, nodes = self.workload.num_experts, self.settings.devices, self.settings.nodes
        ids_TK = self.variants[name][li][0]
        measured = self.raw["layers"][li].get(name)
        if measured is not None:
            _check_volumes(name, li, measured, ids_TK, e, self.settings)
            rows_DD = torch.tensor(measured["rows_DD"], dtype=torch.long)
            self.measured_rows[(name, li)] = rows_DD
            dropped = measured["dropped_routes"]
        else:
            rows_DD, dropped = layer_volumes(
                ids_TK, name, e, d, self.settings.capacity_factor, self.settings.min_capacity
            )
        stage2_DD = None
        if name.startswith(TWO_STAGE):
            if measured is not None:
                stage2_DD = torch.tensor(measured["stage2_rows_DD"], dtype=torch.long)
            else:
                stage2_DD = two_stage_rows(ids_TK, contiguous_expert_device(e, d), d, nodes)[1]
        row = {
            "backend": name,
            "rows": int(rows_DD.sum()),
            "rows_per_token": float(rows_DD.sum()) / self.workload.tokens,
            "remote_rows": _remote_rows(rows_DD) + _remote_rows(stage2_DD),
            "dropped_routes": dropped,
            "load_imbalance": _load_imbalance(stage2_DD if stage2_DD is not None else rows_DD),
        }
        if stage2_DD is not None:
            row["stage2_rows"] = int(stage2_DD.sum())
        if nodes > 1:
            row.update(_node_split(name, rows_DD, stage2_DD, d // nodes))
        if measured is not None:
            row.update({key: measured[key] for key in _MEASURED})
        return row

    def implementation(self) -> dict[str, str]:
        """Backend -> what ran it, for every backend some layer measured."""
        return {name: r["implementation"] for layer in self.raw["layers"] for name, r in layer.items()}

    def summary_row(self, name: str, per_layer: list[dict]) -> dict[str, Any]:
        """One backend over all layers: rows, bytes, load, node split, dropped share, timings."""
        tokens, n_layers = self.workload.tokens, len(self.workload.layers)
        row_bytes = self.workload.hidden * self.settings.element_size
        implementation = self.implementation()
        rows_l = [next(b for b in pl["backends"] if b["backend"] == name) for pl in per_layer]
        rows = sum(r["rows"] for r in rows_l)
        row = {
            "backend": name,
            "peer": name in PEERS,
            "kind": self.kind_of[name],
            "max_devices_per_token": self.budget_of.get(name),
            "measured": name in implementation,
            "rows_per_token": rows / (tokens * n_layers),
            "rows": rows,
            "remote_rows": sum(r["remote_rows"] for r in rows_l),
            "bytes": 2 * (rows + sum(r.get("stage2_rows", 0) for r in rows_l)) * row_bytes,
            "load_imbalance": sum(r["load_imbalance"] for r in rows_l) / max(1, len(rows_l)),
        }
        if row["kind"] == "dedup":
            row["comm_complexity"] = row["rows_per_token"]
        if row["kind"] == "two_stage":
            row["stage2_rows"] = sum(r["stage2_rows"] for r in rows_l)
            row["node_comm_complexity"] = row["rows_per_token"]
        if self.settings.nodes > 1:
            cross = sum(r["cross_node_rows"] for r in rows_l)
            row.update(
                cross_node_rows=cross,
                cross_node_rows_per_token=cross / (tokens * n_layers),
                cross_node_bytes=2 * cross * row_bytes,
                intra_node_rows=sum(r["intra_node_rows"] for r in rows_l),
            )
        if row["kind"] == "capacity":
            routes = tokens * self.workload.top_k * n_layers
            row["dropped_share"] = sum(r["dropped_routes"] for r in rows_l) / routes
        if row["measured"]:
            row.update(
                exchange_ms=sum(r["exchange_ms"] for r in rows_l),
                path_ms=sum(r["path_ms"] for r in rows_l),
                collective_bytes=sum(r["collective_bytes"] for r in rows_l),
                implementation=implementation[name],
            )
        else:
            row.update(
                exchange_ms=None, path_ms=None, reason=self.raw["unavailable"].get(name, "not measured")
            )
        return row

    def targets(self, summary: list[dict], per_layer: list[dict]) -> dict[str, Any]:
        """Whether the speed-up targets were met, and the exact-volume checks (C_T and N_T rows)."""
        targets: dict[str, Any] = {}
        for name, goal in TARGETS.items():
            found = next((r for r in summary if r["backend"] == name and r["measured"]), None)
            if found is not None and found["speedup_vs_best_peer"] is not None:
                targets[name] = {
                    "target_speedup_vs_best_peer": goal,
                    "measured": found["speedup_vs_best_peer"],
                    "met": found["speedup_vs_best_peer"] >= goal,
                }
        if "occult_dedup" in self.names:
            targets["rows_equal_comm_complexity_x_tokens"] = self._dedup_rows_exact(per_layer)
        if TWO_STAGE in self.names:
            targets["cross_node_rows_equal_node_count"] = self._two_stage_rows_exact(per_layer)
        return targets

    def _dedup_rows_exact(self, per_layer: list[dict]) -> bool:
        # sum over tokens of C_T, in integers: the exact rows a de-duplicated dispatch must send
        e, d = self.workload.num_experts, self.settings.devices
        dev_E = contiguous_expert_device(e, d)
        return all(
            _layer_row(pl, "occult_dedup")["rows"] == int(devices_per_token(lr.topk_ids_TK, dev_E, d).sum())
            for pl, lr in zip(per_layer, self.workload.layers)
        )

    def _two_stage_rows_exact(self, per_layer: list[dict]) -> bool:
        # the inter-node stage sends sum over tokens of N_T rows; those to other nodes cross the network
        e, d, nodes = self.workload.num_experts, self.settings.devices, self.settings.nodes
        checks = []
        for pl, lr in zip(per_layer, self.workload.layers):
            node_rows, remote_node_rows = _node_counts(lr.topk_ids_TK, e, d, nodes)
            b = _layer_row(pl, TWO_STAGE)
            checks.append(b["rows"] == node_rows and b["cross_node_rows"] == remote_node_rows)
        if not all(checks):
            raise RuntimeError(
                "the two-stage exchange's cross-node rows differ from the node-level count; please report this bug"
            )
        return True

    def notes(self, budget_notes: list[str]) -> list[str]:
        """The workload's notes, the budgets left out, replicas run instead of a library, what was not run."""
        notes = list(self.workload.notes) + budget_notes
        notes += [
            f"{name}: {how}"
            for name, how in self.implementation().items()
            if how.startswith("occult_ft replica")
        ]
        unavailable = self.raw["unavailable"]
        if "hf_native_ep" in unavailable:
            notes.append(
                f"hf_native_ep not measured: {unavailable['hf_native_ep']}; it sends what per_expert sends"
            )
        notes.append(
            "DeepSpeed AutoEP is not run: with transformers >= 5.23 deepspeed.initialize crashes on its "
            "HF-model replacement; it sends one row per (token, expert), the per_expert volume"
        )
        return notes


def _layer_row(layer_entry: dict, name: str) -> dict:
    """Backend `name`'s row in one layer's entry."""
    return next(b for b in layer_entry["backends"] if b["backend"] == name)


def _add_speedups(summary: list[dict]) -> dict | None:
    """Each measured backend's speed-up over the best measured peer (exchange and whole path), in place;
    returns that best peer (by exchange time), or None when no peer was measured."""
    peers = [r for r in summary if r["peer"] and r["measured"]]
    best = {key: min((r[key] for r in peers), default=None) for key in ("exchange_ms", "path_ms")}
    for row in summary:
        for key, out_key in (
            ("exchange_ms", "speedup_vs_best_peer"),
            ("path_ms", "path_speedup_vs_best_peer"),
        ):
            row[out_key] = best[key] / row[key] if row["measured"] and best[key] and row[key] else None
    return min(peers, key=lambda r: r["exchange_ms"], default=None)


def run_benchmark(
    workload: Workload,
    settings: BenchSettings,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    backends: Sequence[str] | None = None,
    clusters: Sequence[str] | None = None,
    on_start: Callable[[], None] | None = None,
) -> dict:
    """Measure every backend on `workload` with `settings.devices` processes; return the report dict.

    Args:
        workload: the routings (from `model_workload` or `synthetic_workload`); truncated in place to a
            multiple of the device count.
        settings: processes, iterations, dtype, DeepSpeed capacity settings.
        budgets: max_devices_per_token values for the pruned variants (`occult_dedup_prune{M}`).
        backends: names to measure (default: all peers, `occult_dedup` and the pruned variants).
        clusters: cluster presets or specs for the cost model (default: all presets).
        on_start: called once every input has been checked, just before the processes start (the CLI
            prints its phase line there, so a bad input gives one line and nothing else).

    Returns:
        The report (see the module docstring and `DEFINITIONS`).
    """
    d = settings.devices
    e, k = workload.num_experts, workload.top_k
    check_inputs(e, k, workload.tokens, settings)
    for c in clusters or ():
        get_cluster(c)  # unknown presets fail before minutes of measuring
    workload.truncate(workload.tokens - workload.tokens % d)
    kept, budget_notes = _feasible_budgets(budgets, e, k, d)
    names, kind_of, budget_of = _lineup(kept, settings.nodes, backends)
    if on_start is not None:
        on_start()
    variants = routing_variants(workload, d, kept)
    layers = [{name: variants[name][li] for name in names} for li in range(len(workload.layers))]
    raw = run_exchanges(layers, names, e, workload.hidden, settings)

    run = _Run(workload, settings, names, kind_of, budget_of, kept, variants, raw)
    per_layer = [run.layer_entry(li) for li in range(len(workload.layers))]
    summary = [run.summary_row(name, per_layer) for name in names]
    best_peer = _add_speedups(summary)
    targets = run.targets(summary, per_layer)
    return {
        "model": workload.name,
        "placement": workload.placement,
        "devices": d,
        "nodes": settings.nodes,
        "transport": raw["transport"],
        "tokens": workload.tokens,
        "tokens_per_device": workload.tokens // d,
        "hidden": workload.hidden,
        "dtype": settings.dtype,
        "num_experts": e,
        "top_k": k,
        "moe_layers": [lr.layer for lr in workload.layers],
        "iters": settings.iters,
        "warmup": settings.warmup,
        "capacity_factor": settings.capacity_factor,
        "budgets": kept,
        "best_peer": best_peer["backend"] if best_peer else None,
        "backends": summary,
        "layers": per_layer,
        "cost_model": _cost_model(workload, summary, run.measured_rows, settings, clusters),
        "targets": targets,
        "notes": run.notes(budget_notes),
        "definitions": DEFINITIONS,
    }
