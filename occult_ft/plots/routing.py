"""Figures of routing reports: comm_complexity per layer and devices per token.

plot_report                 comm_complexity per layer + devices-per-token histogram of one report
comm_complexity_figure      the same figure for a model card (a checkpoint is measured first, with
                            `occult_ft.evaluation.measure_checkpoint`)
plot_devices_histogram      share of tokens reaching c devices, for several routings side by side
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..metrics import RoutingReport
from .base import (
    BUDGET,
    CYCLE,
    OURS,
    REF_STYLE,
    as_list,
    finish,
    hlines,
    mean_devices,
    new_figure,
    references,
    report_dict,
    target,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


__all__ = ["plot_report", "comm_complexity_figure", "plot_devices_histogram"]


def plot_report(
    report: RoutingReport | Mapping[str, Any],
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """comm_complexity per MoE layer (bars) and the devices-per-token histogram of one routing report.

    Reference lines: k rows per token (per-expert dispatch), the random-placement expectation
    (`report.extra["random_placement_comm_complexity"]` when present, else the formula), the lower bound
    ceil(k*D/E) and, when `report.extra["max_devices_per_token"]` is set, the budget. The default title
    names `report.extra["model"]` when set (`measure_checkpoint` sets the checkpoint's folder name).

    Args:
        report: a `RoutingReport` (e.g. from `occult_ft.commands.analyze.analyze_model`) or its `to_dict()`.
        path: also write the figure to this PNG.
        title: figure title (default: E, k, D and the budget).

    Returns:
        The Figure (two axes: per-layer bars, histogram).
    """
    r = report_dict(report)
    e, k, d = int(r["num_experts"]), int(r["top_k"]), int(r["num_devices"])
    extra = r.get("extra") or {}
    refs = references(e, k, d, extra)
    budget = extra.get("max_devices_per_token")
    if budget is not None:
        refs[f"budget M={budget}"] = float(min(int(budget), k or int(budget), d))
    fig, (ax_layers, ax_hist) = new_figure(ncols=2, size=(12.0, 4.5))

    layers = r["layers"]
    xs = list(range(len(layers)))
    values = [float(m["comm_complexity"]) for m in layers]
    ax_layers.bar(
        xs, values, color=OURS, width=0.7, label=f"measured (overall {float(r['comm_complexity']):.3f})"
    )
    hlines(ax_layers, refs)
    ax_layers.set_xticks(xs)
    ax_layers.set_xticklabels([str(m["layer"]) for m in layers], fontsize=8 if len(layers) > 16 else 10)
    ax_layers.set_xlabel("MoE layer")
    ax_layers.set_ylabel("comm_complexity (devices = rows per token)")
    ax_layers.set_ylim(0, max([*values, *refs.values(), 1.0]) * 1.25)
    ax_layers.set_title("comm_complexity per layer")
    ax_layers.legend(fontsize=8, loc="upper right")

    hist = [int(n) for n in r["devices_histogram"]]
    total = sum(hist)
    cs = list(range(0 if hist and hist[0] else 1, len(hist)))  # c = 0 only when some token reached none
    shares = [hist[c] / total if total else 0.0 for c in cs]
    ax_hist.bar(cs, shares, color=OURS, width=0.7)
    ax_hist.axvline(mean_devices(hist), color="black", linewidth=1.2, label=f"mean {mean_devices(hist):.2f}")
    for label, value in refs.items():
        if not label.startswith("per-expert"):
            ax_hist.axvline(
                value,
                linewidth=1.2,
                label=f"{label}: {value:.2f}",
                **REF_STYLE.get(label, dict(color=BUDGET, linestyle="--")),
            )
    ax_hist.set_xticks(cs)
    ax_hist.set_xlabel("devices a token reaches")
    ax_hist.set_ylabel("share of tokens (all layers)")
    ax_hist.set_title(f"devices per token ({total} token-layers)")
    ax_hist.set_ylim(0, max([*shares, 0.1]) * 1.4)  # room for the legend above the bars
    ax_hist.legend(fontsize=8, loc="upper left")

    fig.suptitle(title if title is not None else _default_title(r))
    return finish(fig, path)


def _default_title(r: Mapping[str, Any]) -> str:
    extra = r.get("extra") or {}
    title = f"E={r['num_experts']}, top-{r['top_k']}, D={r['num_devices']} devices"
    if extra.get("max_devices_per_token") is not None:
        title += f", max_devices_per_token={extra['max_devices_per_token']}"
        if extra.get("criterion"):
            title += f" ({extra['criterion']})"
    if extra.get("model"):
        title = f"{extra['model']}: {title}"
    return title


def comm_complexity_figure(
    report: RoutingReport | Mapping[str, Any],
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """The comm_complexity figure of a model card: `plot_report` of the checkpoint's measured routing.

    The report comes from `occult_ft.evaluation.measure_checkpoint` (which loads the checkpoint and runs
    it over data); `occult_ft.hub.make_comm_complexity_figure` does both and writes the PNG into the
    checkpoint directory:

        report = measure_checkpoint("out")
        comm_complexity_figure(report, "out/comm_complexity.png")
        build_model_card("out", figure="out/comm_complexity.png")

    Args:
        report: a `RoutingReport` or its `to_dict()`.
        path: also write the figure to this PNG.
        title: figure title (default as `plot_report`: the folder name the report's `extra["model"]`
            holds, E, k, D and the budget).

    Returns:
        The Figure.

    Raises:
        ValueError: `report` is a path (measure the checkpoint first) or not a routing report.
    """
    if isinstance(report, (str, os.PathLike)):
        raise ValueError(
            f"comm_complexity_figure draws a report, not the checkpoint {os.fspath(report)!r}; measure it first: "
            "comm_complexity_figure(occult_ft.evaluation.measure_checkpoint(dir), path)"
        )
    return plot_report(report, path, title=title)


def plot_devices_histogram(
    histograms: Mapping[str, Any] | Sequence[int] | RoutingReport,
    ax: Axes | None = None,
    path: str | os.PathLike | None = None,
    title: str | None = None,
) -> Figure:
    """Share of tokens that reach exactly c devices, c = 0..D, for one or several routings side by side.

    Args:
        histograms: label -> histogram (`hist[c]` tokens reaching c devices, as `metrics.device_histogram`
            or `RoutingReport.devices_histogram` give), or label -> `RoutingReport`; or one histogram /
            report on its own.
        ax: draw into these axes (default: a new figure); path: also write a PNG; title: axes title.

    Returns:
        The Figure.
    """
    if hasattr(histograms, "devices_histogram") or not isinstance(histograms, Mapping):
        histograms = {"tokens": histograms}
    series: dict[str, list[int]] = {}
    for label, hist in histograms.items():
        values = hist.devices_histogram if hasattr(hist, "devices_histogram") else hist
        series[str(label)] = [int(v) for v in as_list(values)]
    if not series:
        raise ValueError("no histograms given; pass {label: devices_histogram}")
    width_c = max(len(h) for h in series.values())
    first = 0 if any(h and h[0] for h in series.values()) else 1  # c = 0 only when some token reached none
    cs = list(range(first, width_c))
    fig, ax = target(ax, size=(max(6.0, 0.5 * len(cs) * len(series) + 3), 4.2))
    width = 0.8 / len(series)
    for i, (label, hist) in enumerate(series.items()):
        total = sum(hist)
        shares = [(hist[c] / total if total and c < len(hist) else 0.0) for c in cs]
        xs = [c - 0.4 + width * (i + 0.5) for c in cs]
        ax.bar(
            xs,
            shares,
            width=width,
            color=CYCLE[i % len(CYCLE)],
            label=f"{label} (mean {mean_devices(hist):.2f})",
        )
    ax.set_xticks(cs)
    ax.set_xlabel("devices a token reaches")
    ax.set_ylabel("share of tokens")
    tallest = max((n / sum(h) for h in series.values() if sum(h) for n in h), default=0.1)
    ax.set_ylim(0, tallest * 1.35)  # room for the legend above the bars
    ax.legend(fontsize=8)
    ax.set_title(title or "devices per token")
    return finish(fig, path)
