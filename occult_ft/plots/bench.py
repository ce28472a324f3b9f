"""Figures of the exchange benchmark and the cost model.

    plot_bench        rows per token and exchange time per backend of an `occult-ft bench` report
    plot_cost_model   predicted exchange time and speed-up against the budget, per cluster shape
    plot_train_step   tokens/s and the per-phase breakdown of a train-step benchmark report

Both read what each backend is from the report's fields (`kind`, `max_devices_per_token`), never from
its name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .base import CYCLE, OURS, PEER, finish, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_bench", "plot_cost_model", "plot_train_step"]


def _is_ours(backend: Mapping[str, Any]) -> bool:
    """De-duplicated dispatch (`kind` "dedup"), or, in a report without kinds, a backend marked `peer: false`."""
    if "kind" in backend:
        return backend["kind"] in ("dedup", "two_stage", "dedup_capacity")
    return backend.get("peer") is False


def plot_bench(
    bench_result: Mapping[str, Any],
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """Rows per token and measured exchange time per backend of one exchange-benchmark report.

    Args:
        bench_result: the report of `occult_ft.bench.run_benchmark` (or `occult-ft bench --json`): a dict
            whose `backends` list holds `backend`, `rows_per_token`, `exchange_ms` (None when not
            measured) and optionally `kind` (`dedup` bars are drawn as ours, the rest as peers; without it
            `peer` decides), `max_devices_per_token` (the budget, written beside the bar's name) and
            `path_ms`. Names are labels only: nothing is read from them.
        path: also write the figure to this PNG.
        title: figure title (default: E, k, devices, transport).

    Returns:
        The Figure (two axes: rows per token, milliseconds).
    """
    backends = _bench_backends(bench_result)
    names = [
        str(b["backend"])
        + (f" (M={b['max_devices_per_token']})" if b.get("max_devices_per_token") is not None else "")
        for b in backends
    ]
    colors = [OURS if _is_ours(b) else PEER for b in backends]
    fig, (ax_rows, ax_ms) = new_figure(ncols=2, size=(12.0, 4.8))
    xs = list(range(len(backends)))
    _draw_rows(ax_rows, xs, backends, colors, bench_result.get("top_k"))
    _draw_ms(ax_ms, xs, backends, colors)
    ax_ms.set_title(str(bench_result.get("transport", "measured exchange time")))
    for ax in (ax_rows, ax_ms):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    if title is None and "num_experts" in bench_result:
        title = (
            f"exchange benchmark: E={bench_result['num_experts']}, top-{bench_result.get('top_k')}, "
            f"{bench_result.get('devices')} processes, {bench_result.get('tokens')} tokens"
        )
    if title:
        fig.suptitle(title)
    return finish(fig, path)


def _bench_backends(bench_result: Mapping[str, Any]) -> list:
    """The report's backends, each with the fields the figure reads (one-line error otherwise)."""
    backends = list(bench_result.get("backends") or [])
    if not backends:
        raise ValueError(
            "bench result has no `backends` list; pass the report of run_benchmark / occult-ft bench --json"
        )
    missing = [k for k in ("backend", "rows_per_token", "exchange_ms") if k not in backends[0]]
    if missing:
        raise ValueError(
            f"bench backends lack {missing}; pass the report of run_benchmark / occult-ft bench --json"
        )
    return backends


def _draw_rows(ax, xs: list[int], backends: list, colors: list, top_k) -> None:
    """Rows per token per backend, labelled, with k (per-expert dispatch's rows) as a dotted line."""
    rows = [float(b["rows_per_token"]) for b in backends]
    ax.bar(xs, rows, color=colors)
    for x, v in zip(xs, rows):
        ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    if top_k:
        ax.axhline(float(top_k), color=PEER, linestyle=":", linewidth=1.2, label=f"k = {top_k}")
        ax.legend(fontsize=8)
    ax.set_ylabel("rows per token (dispatch, per layer)")
    ax.set_title("volume")


def _draw_ms(ax, xs: list[int], backends: list, colors: list) -> None:
    """Exchange milliseconds per backend ("not measured" where None), beside the whole path's when given."""
    ms = [b.get("exchange_ms") for b in backends]
    has_path = any(b.get("path_ms") is not None for b in backends)
    width = 0.4 if has_path else 0.7
    shift = 0.2 if has_path else 0.0
    ax.bar([x - shift for x in xs], [v or 0.0 for v in ms], width=width, color=colors, label="exchange")
    if has_path:
        ax.bar(
            [x + shift for x in xs],
            [b.get("path_ms") or 0.0 for b in backends],
            width=width,
            color=colors,
            alpha=0.45,
            label="whole dispatch + combine path",
        )
        ax.legend(fontsize=8)
    for x, v in zip(xs, ms):
        ax.text(
            x - shift,
            v or 0.0,
            "not measured" if v is None else f"{v:.2f}",
            ha="center",
            va="bottom",
            fontsize=7,
            rotation=90 if v is None else 0,
        )
    ax.set_ylabel("ms per forward (dispatch + combine)")


def _label_2_and_5(value: float, _position) -> str:
    """Minor tick label on a log axis: only at 2 and 5 times a power of ten."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""


def _entry(name: Any, entry: Mapping[str, Any], ms_key: str) -> tuple[str, int | None, float]:
    """(kind, budget, ms) of one cost-model entry, from its fields."""
    if "kind" not in entry:
        raise ValueError(
            f"cost-model entry {name!r} has no `kind`; pass predict_speedup / run_benchmark output of this "
            "version (each entry carries `kind` and `max_devices_per_token`)"
        )
    budget = entry.get("max_devices_per_token")
    return str(entry["kind"]), None if budget is None else int(budget), float(entry[ms_key])


def _cost_clusters(predictions: Any) -> list[tuple[str, int, list[tuple[str, int | None, float]]]]:
    """(cluster name, devices, [(kind, budget, ms)]) of a bench report (or its cost_model) or of
    {cluster: predict_speedup(...)}; skipped clusters left out."""
    if isinstance(predictions, Mapping) and "cost_model" in predictions:
        predictions = predictions["cost_model"]
    clusters: list[tuple[str, int, list[tuple[str, int | None, float]]]] = []
    if isinstance(predictions, Mapping) and "clusters" in predictions:
        for c in predictions["clusters"]:
            if "skipped" in c or not c.get("backends"):
                continue
            d = int(c.get("num_devices") or c["nodes"] * c["devices_per_node"])
            entries = [_entry(p.get("backend"), p, "predicted_ms") for p in c["backends"]]
            clusters.append((str(c["name"]), d, entries))
    elif isinstance(predictions, Mapping):
        for key, result in predictions.items():
            entries = [_entry(name, v, "exchange_ms") for name, v in result.items()]
            devices: set[Any] = {v.get("num_devices") for v in result.values() if isinstance(v, Mapping)}
            if len(devices) != 1 or None in devices:
                raise ValueError(
                    f"cost-model result of {key!r} does not record its num_devices; build it with "
                    "occult_ft.bench.costmodel.predict_speedup"
                )
            clusters.append((str(getattr(key, "name", key)), int(devices.pop()), entries))
    else:
        raise ValueError(
            "cost-model input must be {cluster: predict_speedup(...)} or a bench report / its cost_model"
        )
    return clusters


def _cost_series(predictions: Any) -> list[dict]:
    """Normalise cost-model results to [{name, devices, budgets: [(M, ms)], peer_ms}], one per cluster.

    Entries of kind `dedup` are de-duplicated dispatch, drawn at their `max_devices_per_token` M
    (capped at D) or, unpruned (M None), at M = D (a budget of D restricts nothing); the rest are peers
    (per-expert dispatch and the like), of which the fastest is the reference.
    """

    out = []
    for name, d, entries in _cost_clusters(predictions):
        points, peers = [], []
        for kind, budget, ms in entries:
            if kind == "dedup":
                points.append((d if budget is None else min(budget, d), ms))
            else:
                peers.append(ms)
        if not points:
            continue
        best: dict[int, float] = {}
        for m, ms in points:  # a budget >= D equals plain de-duplication: keep one point per M
            best[m] = min(ms, best.get(m, math.inf))
        out.append(
            {
                "name": name,
                "devices": d,
                "budgets": sorted(best.items()),
                "peer_ms": min(peers) if peers else None,
            }
        )
    if not out:
        raise ValueError(
            "cost-model input holds no de-duplicated predictions (entries of kind `dedup`); "
            "include occult_dedup or a budget"
        )
    return out


def plot_cost_model(
    predictions: Mapping[Any, Any],
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """Predicted exchange time and speed-up over per-expert dispatch against the budget, per cluster shape.

    For each cluster, de-duplicated dispatch is drawn at M = 1, 2, ... and, unpruned, at M = D; the
    fastest peer (per-expert dispatch) is a dotted line of the same colour on the time panel, and the
    reference (1x) of the speed-up panel.

    Args:
        predictions: either {cluster: `occult_ft.bench.costmodel.predict_speedup(...)`} (cluster = a
            name or a `ClusterShape`, the label; values map routing names to dicts with `kind`,
            `max_devices_per_token`, `num_devices` and `exchange_ms`), or a bench report / its `cost_model` dict
            (`clusters` with `backends` of `backend`, `kind`, `max_devices_per_token`, `predicted_ms`).
            The budget is read from `max_devices_per_token`, never from a name.
        path: also write the figure to this PNG.
        title: figure title.

    Returns:
        The Figure (two axes: predicted ms, speed-up), M on a log2 axis.
    """
    series = _cost_series(predictions)
    fig, (ax_ms, ax_speed) = new_figure(ncols=2, size=(12.0, 4.6 + 0.22 * len(series)))
    ticks: set[int] = set()
    for i, s in enumerate(series):
        color = CYCLE[i % len(CYCLE)]
        ms_ = [m for m, _ in s["budgets"]]
        ticks.update(ms_)
        label = f"{s['name']} (D={s['devices']})"
        ax_ms.plot(ms_, [v for _, v in s["budgets"]], marker="o", color=color, label=label)
        if s["peer_ms"] is not None:
            ax_ms.axhline(s["peer_ms"], color=color, linestyle=":", linewidth=1.2)
            speed = [s["peer_ms"] / v if v > 0 else math.inf for _, v in s["budgets"]]
            # the figures go into the legend, one line per cluster: labels at the points overlap as soon
            # as two clusters predict similar speed-ups
            shown = ", ".join(f"M={m}: {v:.2f}x" for m, v in zip(ms_, speed))
            ax_speed.plot(ms_, speed, marker="o", color=color, label=f"{label}: {shown}")
    ax_speed.axhline(1.0, color=PEER, linestyle=":", linewidth=1.2, label="per-expert dispatch (1x)")
    ax_ms.plot([], [], color=PEER, linestyle=":", label="dotted: per-expert dispatch")
    for ax in (ax_ms, ax_speed):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks))
        ax.set_xticklabels([str(t) for t in sorted(ticks)])
        ax.set_xlabel("max_devices_per_token M (M = D: de-duplication only)")
    ax_ms.legend(fontsize=8)
    # below the panel: one line per cluster with its speed-ups, clear of the curves
    ax_speed.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    from matplotlib.ticker import FuncFormatter

    ax_ms.set_yscale("log")  # clusters differ by orders of magnitude (PCIe vs NVLink)
    ax_ms.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_ms.yaxis.set_minor_formatter(FuncFormatter(_label_2_and_5))
    ax_ms.set_ylabel("predicted exchange ms (dispatch + combine)")
    ax_ms.set_title("predicted all-to-all time")
    ax_speed.set_ylabel("speed-up over per-expert dispatch")
    ax_speed.set_title("predicted speed-up")
    if title:
        fig.suptitle(title)
    return finish(fig, path)


_PHASES = (
    ("attention_dense", "attention + dense"),
    ("router", "router"),
    ("exchange_fwd_wait", "exchange fwd: waiting"),
    ("exchange_fwd", "exchange fwd"),
    ("local_experts_fwd", "local experts fwd"),
    ("exchange_bwd_wait", "exchange bwd: waiting"),
    ("exchange_bwd", "exchange bwd"),
    ("backward_rest", "backward + rest"),
    ("optimizer", "optimizer"),
)


def plot_train_step(
    step_result: Mapping[str, Any], path: str | os.PathLike | None = None, *, title: str | None = None
) -> Figure:
    """Tokens/s (median, bars; [25th, 75th] percentile, whiskers) and the per-phase breakdown of one
    train-step benchmark report (`occult_ft.bench.step.run_train_step`, `benchmarks/train_step.py --json`).

    Args:
        step_result: the report: its `contenders` list holds `contender`, `measured`, `ours` (drawn as
            ours when true), `tokens_per_s`, `spread_s`, `phases_ms`, and the report `tokens_per_step`.
        path: also write the figure to this PNG.
        title: figure title (default: the model shape).

    Returns:
        The Figure (two axes: tokens/s, ms per step by phase).
    """
    rows = [r for r in step_result.get("contenders") or [] if r.get("measured")]
    if not rows:
        raise ValueError("train-step result has no measured contenders; pass the report of run_train_step")
    tokens = float(step_result["tokens_per_step"])
    fig, (ax_tps, ax_ph) = new_figure(ncols=2, size=(13.0, 5.0))
    xs = list(range(len(rows)))
    colors = [OURS if r.get("ours") else PEER for r in rows]
    tps = [float(r["tokens_per_s"]) for r in rows]
    low = [tps[i] - tokens / r["spread_s"][1] for i, r in enumerate(rows)]
    high = [tokens / r["spread_s"][0] - tps[i] for i, r in enumerate(rows)]
    ax_tps.bar(xs, tps, color=colors, yerr=[low, high], capsize=3)
    for x, v in zip(xs, tps):
        ax_tps.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax_tps.set_ylabel("tokens / s (median step)")
    ax_tps.set_title("throughput")
    bottom = [0.0] * len(rows)
    for i, (key, label) in enumerate(_PHASES):
        values = [max(0.0, float(r["phases_ms"].get(key, 0.0))) for r in rows]
        if not any(values):
            continue
        ax_ph.bar(xs, values, bottom=bottom, color=CYCLE[i % len(CYCLE)], label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_ph.set_ylabel("ms per step (mean over ranks)")
    ax_ph.set_title("where the step goes")
    ax_ph.legend(fontsize=7)
    for ax in (ax_tps, ax_ph):
        ax.set_xticks(xs)
        ax.set_xticklabels([r["contender"] for r in rows], rotation=35, ha="right", fontsize=8)
    if title is None and "settings" in step_result:
        s = step_result["settings"]
        title = (
            f"train step: hidden {s['hidden']}, {s['layers']} layers, {s['experts']} experts top-{s['top_k']}, "
            f"{step_result['tokens_per_step']} tokens/step, {s['devices']} processes"
        )
    if title:
        fig.suptitle(title)
    return finish(fig, path)
