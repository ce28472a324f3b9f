"""Figures for choosing a placement and a budget: routing reports, co-activation, training, benchmarks.

Users pick an expert placement and a `max_devices_per_token` budget by looking at what they buy:

    plot_report                 comm_complexity per layer + devices-per-token histogram of one
                                `RoutingReport`, against k rows (per-expert dispatch), the random-placement
                                expectation and the lower bound ceil(k*D/E)   (`occult-ft analyze --plot`)
    comm_complexity_figure      the same figure from a report or measured on a checkpoint directory, for
                                the model card (`occult_ft.hub.build_model_card(..., figure=PNG)`)
    plot_coactivation           an (E, E) co-activation heatmap with experts ordered by device and the
                                device boundaries drawn: collaborating experts on one device form blocks
    plot_placement_comparison   comm_complexity per layer for several placement algorithms
    plot_devices_histogram      share of tokens reaching c devices, for several routings side by side
    plot_training_curves        loss, comm_complexity and removed router mass from `Trainer.state.log_history`
    plot_quality_tradeoff       eval loss against max_devices_per_token, one line per pruning criterion
    plot_bench                  rows per token and exchange time per backend of an `occult-ft bench` report
    plot_cost_model             predicted exchange time and speed-up against the budget, per cluster shape
    plot_gain_kept              share of standard fine-tuning's gain kept, and exact match, against
                                comm_complexity, from the rows of `occult-ft study --task` (mean +- sd)

Every function returns the `matplotlib.figure.Figure` and, given `path`, also writes it as PNG. Figures
are built with matplotlib's object-oriented API (no pyplot): nothing switches the global backend or keeps
figures alive, PNGs render through Agg, so the functions work headless, in worker threads and in
notebooks (after `%matplotlib inline` a returned Figure shows inline). matplotlib is imported inside
the functions; it is the optional `plot` extra (`pip install "occult-ft[plot]"`).

Shape legend: T tokens, K experts per token (top-k), E experts, D devices, M = max_devices_per_token.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .metrics import comm_complexity_lower_bound, random_placement_comm_complexity

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .metrics import RoutingReport

__all__ = [
    "DPI",
    "plot_report",
    "comm_complexity_figure",
    "plot_coactivation",
    "plot_placement_comparison",
    "plot_placement",
    "plot_devices_histogram",
    "plot_training_curves",
    "plot_quality_tradeoff",
    "plot_bench",
    "plot_cost_model",
    "plot_gain_kept",
]

DPI = 110
"""Resolution of saved PNGs (a 12 x 4.5 inch figure is 1320 x 495 pixels, ~60-120 kB)."""

# one colour per role, the same in every figure
_OURS = "#2a7ab9"  # occult_ft's numbers (measured routing, de-duplicated dispatch)
_PEER = "#8c8c8c"  # per-expert dispatch and other peers
_RANDOM = "#d62728"  # random-placement expectation
_BOUND = "#2ca02c"  # lower bound ceil(k*D/E)
_BUDGET = "#9467bd"  # a pruning budget
# series colours: none of them is a reference-line colour above
_CYCLE = ("#2a7ab9", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#1f3b73", "#f2b701")


# ---- plumbing ----------------------------------------------------------------------------------------
def _new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (6.0, 4.5)):
    """(figure, list of axes) without pyplot; constrained layout keeps labels inside the canvas."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            'plotting needs matplotlib; install it with `pip install "occult-ft[plot]"`'
        ) from None
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _target(ax: Axes | None, size: tuple[float, float] = (6.0, 4.5)) -> tuple[Figure, Axes]:
    """Draw into `ax` when given, else into a new one-axes figure."""
    if ax is not None:
        return ax.figure, ax
    fig, (new_ax,) = _new_figure(size=size)
    return fig, new_ax


def _finish(fig: Figure, path: str | os.PathLike | None) -> Figure:
    if path is not None:
        path = os.fspath(path)
        if not path.lower().endswith(".png"):
            raise ValueError(f"figure path {path!r} does not end in .png; the figures are written as PNG")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(f"cannot write figure {path!r}: directory {parent!r} does not exist")
        fig.savefig(path, dpi=DPI, format="png")
    return fig


def _report_dict(report: RoutingReport | Mapping[str, Any]) -> dict:
    """A `RoutingReport`, or its `to_dict()` form (e.g. `occult-ft analyze --json` output), as a dict."""
    data = report.to_dict() if hasattr(report, "to_dict") else dict(report)
    missing = [
        k for k in ("num_devices", "num_experts", "top_k", "layers", "devices_histogram") if k not in data
    ]
    if missing:
        raise ValueError(
            f"report lacks {missing}; pass a RoutingReport or its to_dict() (occult-ft analyze --json)"
        )
    return data


def _references(
    num_experts: int, top_k: int, num_devices: int, extra: Mapping[str, Any] | None = None
) -> dict:
    """Reference comm_complexity values: k rows, random-placement expectation, lower bound (when defined)."""
    refs: dict[str, float] = {}
    if top_k:
        refs["per-expert dispatch (k rows)"] = float(top_k)
    extra = extra or {}
    rand = extra.get("random_placement_comm_complexity")
    if rand is None and top_k and num_devices and num_experts % num_devices == 0:
        rand = random_placement_comm_complexity(num_experts, top_k, num_devices)
    if rand is not None:
        refs["random placement, uniform routing"] = float(rand)
    if top_k and num_devices and num_experts:
        refs["lower bound ceil(k*D/E)"] = float(comm_complexity_lower_bound(num_experts, top_k, num_devices))
    return refs


_REF_STYLE = {
    "per-expert dispatch (k rows)": dict(color=_PEER, linestyle=":"),
    "random placement, uniform routing": dict(color=_RANDOM, linestyle="--"),
    "lower bound ceil(k*D/E)": dict(color=_BOUND, linestyle="-."),
}


def _hlines(ax: Axes, refs: Mapping[str, float]) -> None:
    for label, value in refs.items():
        style = _REF_STYLE.get(label, dict(color=_BUDGET, linestyle="--"))
        ax.axhline(value, linewidth=1.4, label=f"{label}: {value:.2f}", **style)


def _as_list(values: Any) -> list:
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return list(values)


def _mean_devices(hist: Sequence[int]) -> float:
    total = sum(hist)
    return sum(c * n for c, n in enumerate(hist)) / total if total else 0.0


# ---- routing reports -------------------------------------------------------------------------------------
def plot_report(
    report: RoutingReport | Mapping[str, Any],
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """comm_complexity per MoE layer (bars) and the devices-per-token histogram of one routing report.

    Reference lines: k rows per token (per-expert dispatch), the random-placement expectation
    (`report.extra["random_placement_comm_complexity"]` when present, else the formula), the lower bound
    ceil(k*D/E) and, when `report.extra["max_devices_per_token"]` is set, the budget.

    Args:
        report: a `RoutingReport` (e.g. from `occult_ft.commands.analyze.analyze_model`) or its `to_dict()`.
        path: also write the figure to this PNG.
        title: figure title (default: E, k, D and the budget).

    Returns:
        The Figure (two axes: per-layer bars, histogram).
    """
    r = _report_dict(report)
    e, k, d = int(r["num_experts"]), int(r["top_k"]), int(r["num_devices"])
    extra = r.get("extra") or {}
    refs = _references(e, k, d, extra)
    budget = extra.get("max_devices_per_token")
    if budget is not None:
        refs[f"budget M={budget}"] = float(min(int(budget), k or int(budget), d))
    fig, (ax_layers, ax_hist) = _new_figure(ncols=2, size=(12.0, 4.5))

    layers = r["layers"]
    xs = list(range(len(layers)))
    values = [float(m["comm_complexity"]) for m in layers]
    ax_layers.bar(
        xs, values, color=_OURS, width=0.7, label=f"measured (overall {float(r['comm_complexity']):.3f})"
    )
    _hlines(ax_layers, refs)
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
    ax_hist.bar(cs, shares, color=_OURS, width=0.7)
    ax_hist.axvline(
        _mean_devices(hist), color="black", linewidth=1.2, label=f"mean {_mean_devices(hist):.2f}"
    )
    for label, value in refs.items():
        if not label.startswith("per-expert"):
            ax_hist.axvline(
                value,
                linewidth=1.2,
                label=f"{label}: {value:.2f}",
                **_REF_STYLE.get(label, dict(color=_BUDGET, linestyle="--")),
            )
    ax_hist.set_xticks(cs)
    ax_hist.set_xlabel("devices a token reaches")
    ax_hist.set_ylabel("share of tokens (all layers)")
    ax_hist.set_title(f"devices per token ({total} token-layers)")
    ax_hist.set_ylim(0, max([*shares, 0.1]) * 1.4)  # room for the legend above the bars
    ax_hist.legend(fontsize=8, loc="upper left")

    fig.suptitle(title if title is not None else _default_title(r))
    return _finish(fig, path)


def _default_title(r: Mapping[str, Any]) -> str:
    extra = r.get("extra") or {}
    title = f"E={r['num_experts']}, top-{r['top_k']}, D={r['num_devices']} devices"
    if extra.get("max_devices_per_token") is not None:
        title += f", max_devices_per_token={extra['max_devices_per_token']}"
        if extra.get("criterion"):
            title += f" ({extra['criterion']})"
    return title


def _measure_checkpoint(
    checkpoint_dir: str, data: Any, devices: int | None, max_tokens: int, seq_len: int, batch_size: int
):
    """RoutingReport of a checkpoint's own (placed, pruned) routing on `data`."""
    from .checkpoint import from_pretrained, load_tokenizer
    from .evaluation import data_batches
    from .hub import describe_checkpoint
    from .metrics import contiguous_expert_device, routing_report
    from .models import find_moe_layers
    from .profiling import profile_model

    summary = describe_checkpoint(checkpoint_dir)
    block = summary.block
    devices = devices or block.get("num_devices")
    if not devices:
        raise ValueError(
            f"checkpoint {checkpoint_dir!r} records no num_devices; pass devices=D (the expert-parallel size)"
        )
    model = from_pretrained(checkpoint_dir)
    tokenizer = load_tokenizer(checkpoint_dir, summary.base_model)
    batches = data_batches(tokenizer, data, seq_len, batch_size, max_tokens)
    profile = profile_model(model, batches, model_name=checkpoint_dir, max_tokens=max_tokens, progress=False)
    num_experts = find_moe_layers(model)[0].num_experts
    # the checkpoint's experts are stored placed: device d holds the contiguous block d*E/D ..
    report = routing_report(
        profile.topk_ids(), contiguous_expert_device(num_experts, int(devices)), int(devices), num_experts
    )
    report.extra["max_devices_per_token"] = block.get("max_devices_per_token")
    report.extra["criterion"] = (
        block.get("criterion", "score") if block.get("max_devices_per_token") else None
    )
    return report


def comm_complexity_figure(
    source: RoutingReport | Mapping[str, Any] | str | os.PathLike,
    path: str | os.PathLike | None = None,
    *,
    data: Any = "embedded",
    devices: int | None = None,
    max_tokens: int = 2048,
    seq_len: int = 128,
    batch_size: int = 8,
    title: str | None = None,
) -> Figure:
    """The comm_complexity figure (`plot_report`) of a report, or measured on a checkpoint, for a model card.

    Given a checkpoint directory (written by `save_pruned`, the trainer or `occult-ft prune`), the model
    is loaded with `occult_ft.from_pretrained` (its placement and pruned routing active) and run over
    `max_tokens` tokens of `data`; the experts are stored placed, so device d holds experts
    [d*E/D, (d+1)*E/D).

        fig = comm_complexity_figure("out", "out/comm_complexity.png")
        build_model_card("out", figure="out/comm_complexity.png")

    Args:
        source: a `RoutingReport`, its `to_dict()`, or a checkpoint directory.
        path: also write the figure to this PNG.
        data: checkpoint only: what to route (`--data` values of the CLI: a text/JSONL file, a dataset,
            or "embedded" for the shipped eval text).
        devices: checkpoint only: D (default: the `num_devices` the checkpoint records).
        max_tokens, seq_len, batch_size: checkpoint only: how much data, in which shape.
        title: figure title (default: the checkpoint's folder name, or as `plot_report`).

    Returns:
        The Figure.
    """
    if isinstance(source, (str, os.PathLike)):
        checkpoint_dir = os.fspath(source)
        if not os.path.isdir(checkpoint_dir):
            raise ValueError(
                f"checkpoint directory {checkpoint_dir!r} does not exist; pass a report or a folder"
            )
        report = _measure_checkpoint(checkpoint_dir, data, devices, max_tokens, seq_len, batch_size)
        if title is None:
            title = f"{os.path.basename(os.path.abspath(checkpoint_dir))}: {_default_title(report.to_dict())}"
        return plot_report(report, path, title=title)
    return plot_report(source, path, title=title)


# ---- co-activation and placement ---------------------------------------------------------------------
def _expert_device(expert_device: Any, num_experts: int) -> list[int]:
    """(E,) device ids from a tensor / list of ids, or from `groups` (D lists of expert ids)."""
    from .metrics import expert_device_from_groups

    values = _as_list(expert_device)
    if values and isinstance(values[0], (list, tuple)):
        values = expert_device_from_groups(values, num_experts).tolist()
    if len(values) != num_experts:
        raise ValueError(
            f"expert_device has {len(values)} entries but the co-activation matrix has {num_experts} experts; "
            "pass one device per expert (or the placement's groups for this layer)"
        )
    return [int(v) for v in values]


def plot_coactivation(
    coactivation_EE: Any,
    expert_device_E: Any = None,
    ax: Axes | None = None,
    title: str | None = None,
    *,
    path: str | os.PathLike | None = None,
    colorbar: bool = True,
) -> Figure:
    """Heatmap of pair co-selection counts with experts ordered by device and device boundaries drawn.

    A good placement shows dense blocks on the diagonal: experts that tokens select together share a
    device. The diagonal (each expert's own load) is left blank so that it does not set the colour scale.
    The title reports the intra-device share of co-selected pairs (the `intra_share` metric).

    Args:
        coactivation_EE: (E, E) counts (`Profile.layers[i].coactivation`, or
            `occult_ft.placement.coactivation_matrix`); tensor, array or nested list.
        expert_device_E: (E,) device of each expert, or a placement's `groups` for this layer
            (`Placement.groups[i]`); None = one device, no boundaries.
        ax: draw into these axes (default: a new figure).
        title: axes title (default: "co-activation" and the intra-device share).
        path: also write the figure to this PNG.
        colorbar: add a colour bar.

    Returns:
        The Figure that holds the axes.
    """
    import numpy as np

    co = np.asarray(
        coactivation_EE.detach().cpu() if isinstance(coactivation_EE, torch.Tensor) else coactivation_EE,
        dtype=np.float64,
    )
    if co.ndim != 2 or co.shape[0] != co.shape[1]:
        raise ValueError(f"coactivation must be a square (E, E) matrix, got shape {co.shape}")
    e = co.shape[0]
    dev = _expert_device(expert_device_E, e) if expert_device_E is not None else [0] * e
    order = sorted(range(e), key=lambda x: (dev[x], x))
    shown = co[np.ix_(order, order)].copy()
    np.fill_diagonal(shown, np.nan)
    same = np.equal.outer(np.asarray(dev), np.asarray(dev))
    off = ~np.eye(e, dtype=bool)
    pairs = co[off].sum()
    share = co[off & same].sum() / pairs if pairs > 0 else 0.0

    import matplotlib
    from matplotlib.colors import PowerNorm

    fig, ax = _target(ax, size=(6.0, 5.2))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")  # the blank diagonal
    # square-root colour scale: a few hot pairs would otherwise leave every other cell dark
    top = float(np.nanmax(shown)) if e > 1 and np.isfinite(shown).any() else 0.0
    image = ax.imshow(
        shown, cmap=cmap, interpolation="nearest", norm=PowerNorm(0.5, vmin=0.0, vmax=max(top, 1.0))
    )
    boundaries = [i for i in range(1, e) if dev[order[i]] != dev[order[i - 1]]]
    for b in boundaries:
        ax.axhline(b - 0.5, color="white", linewidth=1.6)
        ax.axvline(b - 0.5, color="white", linewidth=1.6)
    if e <= 64:
        ticks = list(range(e))
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        fontsize = 7 if e <= 32 else 5
        ax.set_xticklabels([str(x) for x in order], fontsize=fontsize, rotation=90)
        ax.set_yticklabels([str(x) for x in order], fontsize=fontsize)
    ax.set_xlabel("expert (ordered by device)")
    ax.set_ylabel("expert (ordered by device)")
    ax.set_title(
        title
        if title is not None
        else f"co-activation, {len(set(dev))} device(s): intra-device pairs {share:.1%}",
        fontsize=10,
    )
    if colorbar:
        fig.colorbar(image, ax=ax, shrink=0.8, label="tokens selecting both (square-root scale)")
    return _finish(fig, path)


def plot_placement_comparison(
    per_layer: Mapping[str, Sequence[float]],
    random_expectation: float | None = None,
    lower_bound: float | None = None,
    *,
    layers: Sequence[int] | None = None,
    top_k: int | None = None,
    ax: Axes | None = None,
    path: str | os.PathLike | None = None,
    title: str | None = None,
) -> Figure:
    """comm_complexity per layer for several placements (grouped bars) against the reference points.

    Args:
        per_layer: algorithm -> comm_complexity of each layer (all lists the same length), e.g. from
            `compute_placement(...).metrics["layers"][i]["comm_complexity"]`.
        random_expectation: random-placement expectation (`random_placement_comm_complexity(E, k, D)`).
        lower_bound: `comm_complexity_lower_bound(E, k, D)`.
        layers: layer labels (default 0, 1, ...).
        top_k: also draw k rows per token (per-expert dispatch).
        ax: draw into these axes (default: a new figure); path: also write a PNG; title: axes title.

    Returns:
        The Figure.
    """
    if not per_layer:
        raise ValueError("per_layer is empty; pass {algorithm: [comm_complexity per layer]}")
    series = {name: [float(v) for v in _as_list(values)] for name, values in per_layer.items()}
    lengths = {name: len(v) for name, v in series.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"per_layer lists differ in length {lengths}; give every algorithm one value per layer"
        )
    n = next(iter(lengths.values()))
    labels = [str(x) for x in (layers if layers is not None else range(n))]
    if len(labels) != n:
        raise ValueError(f"{len(labels)} layer labels for {n} values per algorithm")
    fig, ax = _target(ax, size=(max(6.0, 0.55 * n * len(series) + 3), 4.5))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(n)]
        mean = sum(values) / n if n else 0.0
        ax.bar(xs, values, width=width, color=_CYCLE[i % len(_CYCLE)], label=f"{name} (mean {mean:.3f})")
    refs = {}
    if top_k is not None:
        refs["per-expert dispatch (k rows)"] = float(top_k)
    if random_expectation is not None:
        refs["random placement, uniform routing"] = float(random_expectation)
    if lower_bound is not None:
        refs["lower bound ceil(k*D/E)"] = float(lower_bound)
    _hlines(ax, refs)
    ax.set_xticks(list(range(n)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("comm_complexity (devices per token)")
    top = max([v for values in series.values() for v in values] + list(refs.values()) + [1.0])
    ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=8, ncol=2, loc="upper right")
    ax.set_title(title or "comm_complexity per layer by placement")
    return _finish(fig, path)


def plot_placement(
    profile,
    placements: Mapping[str, Any],
    path: str | os.PathLike | None = None,
    *,
    layer: int | None = None,
    chosen: str | None = None,
) -> Figure:
    """The placement picture of `occult-ft place --plot`: one layer's co-activation heatmap with experts in
    their original (sequential) order and in the chosen placement's device order, and comm_complexity per
    layer of every placement against the random expectation and the lower bound.

    Args:
        profile: an `occult_ft.profiling.Profile` (co-activation and token-level routing per layer).
        placements: name -> `Placement` (e.g. sequential, occult and the chosen one).
        path: also write a PNG.
        layer: the layer whose heatmaps are drawn (default: the one the chosen placement improves most).
        chosen: the placement shown in the second heatmap (default: the last of `placements`).

    Returns:
        The Figure.
    """
    from .metrics import (
        comm_complexity,
        comm_complexity_lower_bound,
        contiguous_expert_device,
        random_placement_comm_complexity,
    )

    if not placements:
        raise ValueError("placements is empty; pass {name: Placement}")
    chosen = chosen or list(placements)[-1]
    e, k = int(profile.num_experts), int(profile.top_k)
    d = next(iter(placements.values())).num_devices
    layers = sorted(profile.layers)
    ids = {i: profile.layers[i].topk_ids.long() for i in layers}
    per_layer = {
        name: [comm_complexity(ids[i], pl.expert_device(i), d) for i in layers]
        for name, pl in placements.items()
    }
    if layer is None:
        seq = [comm_complexity(ids[i], contiguous_expert_device(e, d), d) for i in layers]
        gains = [a - b for a, b in zip(seq, per_layer[chosen])]
        layer = layers[max(range(len(layers)), key=gains.__getitem__)]
    fig, (ax_before, ax_after, ax_bars) = _new_figure(ncols=3, size=(17.0, 5.0))
    co = profile.layers[layer].coactivation
    plot_coactivation(
        co, contiguous_expert_device(e, d), ax=ax_before, title=f"layer {layer}: experts in original order"
    )
    plot_coactivation(
        co, placements[chosen].expert_device(layer), ax=ax_after, title=f"layer {layer}: {chosen} placement"
    )
    plot_placement_comparison(
        per_layer,
        random_placement_comm_complexity(e, k, d),
        comm_complexity_lower_bound(e, k, d),
        layers=layers,
        top_k=k,
        ax=ax_bars,
        title=f"comm_complexity per layer, {d} devices",
    )
    return _finish(fig, path)


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
        series[str(label)] = [int(v) for v in _as_list(values)]
    if not series:
        raise ValueError("no histograms given; pass {label: devices_histogram}")
    width_c = max(len(h) for h in series.values())
    first = 0 if any(h and h[0] for h in series.values()) else 1  # c = 0 only when some token reached none
    cs = list(range(first, width_c))
    fig, ax = _target(ax, size=(max(6.0, 0.5 * len(cs) * len(series) + 3), 4.2))
    width = 0.8 / len(series)
    for i, (label, hist) in enumerate(series.items()):
        total = sum(hist)
        shares = [(hist[c] / total if total and c < len(hist) else 0.0) for c in cs]
        xs = [c - 0.4 + width * (i + 0.5) for c in cs]
        ax.bar(
            xs,
            shares,
            width=width,
            color=_CYCLE[i % len(_CYCLE)],
            label=f"{label} (mean {_mean_devices(hist):.2f})",
        )
    ax.set_xticks(cs)
    ax.set_xlabel("devices a token reaches")
    ax.set_ylabel("share of tokens")
    tallest = max((n / sum(h) for h in series.values() if sum(h) for n in h), default=0.1)
    ax.set_ylim(0, tallest * 1.35)  # room for the legend above the bars
    ax.legend(fontsize=8)
    ax.set_title(title or "devices per token")
    return _finish(fig, path)


# ---- training and quality ------------------------------------------------------------------------------
_TRAINING_LABELS = {
    "loss": "loss",
    "comm_complexity": "comm_complexity (devices per token)",
    "removed_mass": "removed router mass (share of top-k probability)",
}


def _series(log_history: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the log entries that carry it (the final summary entry is skipped)."""
    steps, values = [], []
    for i, entry in enumerate(log_history):
        if "train_runtime" in entry or key not in entry or entry[key] is None:
            continue
        steps.append(float(entry.get("step", i)))
        values.append(float(entry[key]))
    return steps, values


def plot_training_curves(
    log_history: Sequence[Mapping[str, Any]],
    path: str | os.PathLike | None = None,
    *,
    metrics: Sequence[str] = ("loss", "comm_complexity", "removed_mass"),
    max_devices_per_token: int | None = None,
    title: str | None = None,
) -> Figure:
    """One panel per metric over training steps: the training log and, where logged, the evaluation.

    Args:
        log_history: `trainer.state.log_history` (list of dicts with `step`; training entries carry
            `loss`, `comm_complexity`, `removed_mass`, ...; evaluation entries the `eval_` forms).
        path: also write the figure to this PNG.
        metrics: metric names to plot (without the `eval_` prefix).
        max_devices_per_token: draw the budget on the comm_complexity panel.
        title: figure title.

    Returns:
        The Figure (one axes per metric; a metric never logged shows "not logged").

    Raises:
        ValueError: none of `metrics` appears in the log.
    """
    history = list(log_history)
    found = {m: (_series(history, m), _series(history, f"eval_{m}")) for m in metrics}
    if not any(train[0] or ev[0] for train, ev in found.values()):
        keys = sorted({k for entry in history for k in entry})
        raise ValueError(f"log_history has none of {list(metrics)}; its keys are {keys}")
    fig, axes = _new_figure(ncols=len(metrics), size=(4.6 * len(metrics), 3.8))
    for ax, metric in zip(axes, metrics):
        (steps, values), (eval_steps, eval_values) = found[metric]
        if steps:
            ax.plot(
                steps,
                values,
                color=_OURS,
                marker="o" if len(steps) < 30 else None,
                markersize=3,
                label="train",
            )
        if eval_steps:
            ax.plot(eval_steps, eval_values, color=_CYCLE[1], marker="s", markersize=4, label="eval")
        if metric == "comm_complexity" and max_devices_per_token is not None:
            ax.axhline(
                max_devices_per_token,
                color=_BUDGET,
                linestyle="--",
                linewidth=1.2,
                label=f"budget M={max_devices_per_token}",
            )
        if not steps and not eval_steps:
            ax.text(0.5, 0.5, f"{metric} not logged", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel(_TRAINING_LABELS.get(metric, metric))
        ax.set_title(metric)
    if title:
        fig.suptitle(title)
    return _finish(fig, path)


def plot_quality_tradeoff(
    rows: Iterable[Mapping[str, Any]],
    path: str | os.PathLike | None = None,
    *,
    metric: str = "eval_loss",
    baseline: float | None = None,
    title: str | None = None,
) -> Figure:
    """Quality against the budget: `metric` vs max_devices_per_token, one line per pruning criterion.

    When the rows carry `comm_complexity`, a second panel plots the same metric against the measured
    comm_complexity (the trade-off itself: what each row per token costs in quality).

    Args:
        rows: dicts with `criterion`, `max_devices_per_token` (None = unpruned) and `metric`, optionally
            `comm_complexity`. An unpruned row gives the baseline line.
        path: also write the figure to this PNG.
        metric: the quality key (lower is better for losses).
        baseline: the unpruned value (default: the mean of the rows whose max_devices_per_token is None).
        title: figure title.

    Returns:
        The Figure.
    """
    rows = [dict(r) for r in rows]
    bad = [
        r
        for r in rows
        if metric not in r or ("criterion" not in r and r.get("max_devices_per_token") is not None)
    ]
    if bad:
        raise ValueError(f"rows need `criterion`, `max_devices_per_token` and `{metric}`; got {bad[0]}")
    unpruned = [float(r[metric]) for r in rows if r.get("max_devices_per_token") is None]
    if baseline is None and unpruned:
        baseline = sum(unpruned) / len(unpruned)
    pruned = [r for r in rows if r.get("max_devices_per_token") is not None]
    if not pruned and baseline is None:
        raise ValueError("no rows to plot; pass rows with max_devices_per_token and the metric")
    by_criterion: dict[str, list[dict]] = {}
    for r in pruned:
        by_criterion.setdefault(str(r["criterion"]), []).append(r)
    with_cc = any("comm_complexity" in r for r in pruned)
    fig, axes = _new_figure(ncols=2 if with_cc else 1, size=(11.0 if with_cc else 6.0, 4.3))
    ax = axes[0]
    budgets = sorted({int(r["max_devices_per_token"]) for r in pruned})
    for i, (criterion, group) in enumerate(by_criterion.items()):
        group = sorted(group, key=lambda r: int(r["max_devices_per_token"]))
        color = _CYCLE[i % len(_CYCLE)]
        ax.plot(
            [int(r["max_devices_per_token"]) for r in group],
            [float(r[metric]) for r in group],
            marker="o",
            color=color,
            label=criterion,
        )
        if with_cc:
            pts = [r for r in group if "comm_complexity" in r]
            axes[1].plot(
                [float(r["comm_complexity"]) for r in pts],
                [float(r[metric]) for r in pts],
                marker="o",
                color=color,
                label=criterion,
            )
            for r in pts:
                axes[1].annotate(
                    f"M={r['max_devices_per_token']}",
                    (float(r["comm_complexity"]), float(r[metric])),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=color,
                )
    for a in axes:
        if baseline is not None:
            a.axhline(baseline, color=_PEER, linestyle=":", linewidth=1.4, label=f"unpruned: {baseline:.3f}")
        a.set_ylabel(metric.replace("_", " "))
        a.legend(fontsize=8)
    ax.set_xticks(budgets)
    ax.set_xlabel("max_devices_per_token (M)")
    ax.set_title(f"{metric} against the budget")
    if with_cc:
        axes[1].set_xlabel("comm_complexity (devices per token)")
        axes[1].set_title(f"{metric} against communication")
    if title:
        fig.suptitle(title)
    return _finish(fig, path)


# ---- benchmark and cost model ------------------------------------------------------------------------
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
            measured) and optionally `peer`, `path_ms`.
        path: also write the figure to this PNG.
        title: figure title (default: E, k, devices, transport).

    Returns:
        The Figure (two axes: rows per token, milliseconds).
    """
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
    names = [str(b["backend"]) for b in backends]
    colors = [_PEER if b.get("peer", not str(b["backend"]).startswith("occult")) else _OURS for b in backends]
    fig, (ax_rows, ax_ms) = _new_figure(ncols=2, size=(12.0, 4.8))
    xs = list(range(len(backends)))
    rows = [float(b["rows_per_token"]) for b in backends]
    ax_rows.bar(xs, rows, color=colors)
    for x, v in zip(xs, rows):
        ax_rows.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    if bench_result.get("top_k"):
        ax_rows.axhline(
            float(bench_result["top_k"]),
            color=_PEER,
            linestyle=":",
            linewidth=1.2,
            label=f"k = {bench_result['top_k']}",
        )
        ax_rows.legend(fontsize=8)
    ax_rows.set_ylabel("rows per token (dispatch, per layer)")
    ax_rows.set_title("volume")

    ms = [b.get("exchange_ms") for b in backends]
    has_path = any(b.get("path_ms") is not None for b in backends)
    width = 0.4 if has_path else 0.7
    shift = 0.2 if has_path else 0.0
    ax_ms.bar([x - shift for x in xs], [v or 0.0 for v in ms], width=width, color=colors, label="exchange")
    if has_path:
        ax_ms.bar(
            [x + shift for x in xs],
            [b.get("path_ms") or 0.0 for b in backends],
            width=width,
            color=colors,
            alpha=0.45,
            label="whole dispatch + combine path",
        )
        ax_ms.legend(fontsize=8)
    for x, v in zip(xs, ms):
        ax_ms.text(
            x - shift,
            v or 0.0,
            "not measured" if v is None else f"{v:.2f}",
            ha="center",
            va="bottom",
            fontsize=7,
            rotation=90 if v is None else 0,
        )
    ax_ms.set_ylabel("ms per forward (dispatch + combine)")
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
    return _finish(fig, path)


_PRUNE = re.compile(r"prune(\d+)$")


def _label_2_and_5(value: float, _position) -> str:
    """Minor tick label on a log axis: only at 2 and 5 times a power of ten."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""


def _cost_series(predictions: Any) -> list[dict]:
    """Normalise cost-model results to [{name, devices, budgets: [(M, ms)], peer_ms}], one per cluster.

    A name ending in `prune{M}` is de-duplicated dispatch with budget M; another name containing
    `dedup` is unpruned de-duplicated dispatch, drawn at M = D (a budget of D restricts nothing); the
    rest are peers (per-expert dispatch and the like), of which the fastest is the reference.
    """
    from .costmodel import get_cluster

    if isinstance(predictions, Mapping) and "cost_model" in predictions:
        predictions = predictions["cost_model"]
    clusters: list[tuple[str, int, list[tuple[str, float]]]] = []
    if isinstance(predictions, Mapping) and "clusters" in predictions:
        for c in predictions["clusters"]:
            if "skipped" in c or not c.get("backends"):
                continue
            d = int(c.get("num_devices") or c["nodes"] * c["devices_per_node"])
            clusters.append(
                (str(c["name"]), d, [(str(p["backend"]), float(p["predicted_ms"])) for p in c["backends"]])
            )
    elif isinstance(predictions, Mapping):
        for key, result in predictions.items():
            shape = get_cluster(key)
            clusters.append(
                (
                    shape.name,
                    shape.num_devices,
                    [(str(name), float(v["exchange_ms"])) for name, v in result.items()],
                )
            )
    else:
        raise ValueError(
            "cost-model input must be {cluster: predict_speedup(...)} or a bench report / its cost_model"
        )
    out = []
    for name, d, entries in clusters:
        points, peers = [], []
        for backend, ms in entries:
            match = _PRUNE.search(backend)
            if match:
                points.append((min(int(match.group(1)), d), ms))
            elif "dedup" in backend:
                points.append((d, ms))
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
            "cost-model input holds no de-duplicated predictions (names with `dedup` / `pruneM`)"
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
        predictions: either {cluster: `occult_ft.costmodel.predict_speedup(...)`} (cluster = a preset
            name, a spec string or a `ClusterShape`; values map `per_expert`, `dedup`, `dedup_prune{M}`
            to dicts with `exchange_ms`), or a bench report / its `cost_model` dict (`clusters` with
            `backends` of `backend`, `predicted_ms`).
        path: also write the figure to this PNG.
        title: figure title.

    Returns:
        The Figure (two axes: predicted ms, speed-up), M on a log2 axis.
    """
    series = _cost_series(predictions)
    fig, (ax_ms, ax_speed) = _new_figure(ncols=2, size=(12.0, 4.6))
    ticks: set[int] = set()
    for i, s in enumerate(series):
        color = _CYCLE[i % len(_CYCLE)]
        ms_ = [m for m, _ in s["budgets"]]
        ticks.update(ms_)
        label = f"{s['name']} (D={s['devices']})"
        ax_ms.plot(ms_, [v for _, v in s["budgets"]], marker="o", color=color, label=label)
        if s["peer_ms"] is not None:
            ax_ms.axhline(s["peer_ms"], color=color, linestyle=":", linewidth=1.2)
            speed = [s["peer_ms"] / v if v > 0 else math.inf for _, v in s["budgets"]]
            ax_speed.plot(ms_, speed, marker="o", color=color, label=label)
            for m, v in zip(ms_, speed):
                ax_speed.annotate(
                    f"{v:.2f}x", (m, v), textcoords="offset points", xytext=(3, 4), fontsize=7, color=color
                )
    ax_speed.axhline(1.0, color=_PEER, linestyle=":", linewidth=1.2, label="per-expert dispatch (1x)")
    ax_ms.plot([], [], color=_PEER, linestyle=":", label="dotted: per-expert dispatch")
    for ax in (ax_ms, ax_speed):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks))
        ax.set_xticklabels([str(t) for t in sorted(ticks)])
        ax.set_xlabel("max_devices_per_token M (M = D: de-duplication only)")
        ax.legend(fontsize=8)
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
    return _finish(fig, path)


# ---- the task quality study ----------------------------------------------------------------------------
def plot_gain_kept(
    summary: Iterable[Mapping[str, Any]],
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """The trade-off of `occult-ft study --task`: gain kept (loss) and exact match against comm_complexity.

    One line per family of rows (zero-shot and fine-tuned per criterion, distilled), points at budgets
    1..D-1 with error bars of one seed-to-seed standard deviation; standard fine-tuning (gain kept 1) and
    the base model (0) are the reference points.

    Args:
        summary: the `summary` rows of a study result (`occult_ft.task_study.summarize_runs`): dicts
            with `setting`, `kind`, `budget`, `criterion`, `comm_complexity`, `gain_kept`(`_sd`) and
            `exact_match`(`_sd`).
        path: also write the figure to this PNG.
        title: figure title.
    """
    rows = [dict(r) for r in summary]
    need = ("setting", "kind", "comm_complexity", "gain_kept", "exact_match")
    bad = [r for r in rows if any(k not in r for k in need)]
    if bad or not rows:
        raise ValueError(f"summary rows need {', '.join(need)}; got {bad[0] if bad else 'no rows'}")
    families: dict[str, list[dict]] = {}
    for r in rows:
        if r["kind"] in ("zero-shot", "pruned", "distilled"):
            label = {"zero-shot": "zero-shot", "pruned": "fine-tuned", "distilled": "distilled"}[r["kind"]]
            families.setdefault(f"{r.get('criterion')}, {label}", []).append(r)
    fig, axes = _new_figure(ncols=2, size=(11.5, 4.4))
    for ax, key, ylabel in (
        (axes[0], "gain_kept", "share of standard fine-tuning's loss gain kept"),
        (axes[1], "exact_match", "exact match on held-out rows"),
    ):
        for i, (label, group) in enumerate(families.items()):
            group = sorted(group, key=lambda r: float(r["comm_complexity"]))
            style = ":" if "zero-shot" in label else "-"
            ax.errorbar(
                [float(r["comm_complexity"]) for r in group],
                [float(r[key]) for r in group],
                yerr=[float(r.get(f"{key}_sd", 0.0)) for r in group],
                marker="o",
                linestyle=style,
                color=_CYCLE[i % len(_CYCLE)],
                capsize=3,
                label=label,
            )
        for r in rows:
            if r["kind"] in ("base", "standard"):
                marker, color = ("*", _OURS) if r["kind"] == "standard" else ("s", _PEER)
                ax.errorbar(
                    [float(r["comm_complexity"])],
                    [float(r[key])],
                    yerr=[float(r.get(f"{key}_sd", 0.0))],
                    marker=marker,
                    markersize=10,
                    color=color,
                    linestyle="none",
                    capsize=3,
                    label=r["setting"],
                )
        ax.set_xlabel("comm_complexity (devices per token)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[0].axhline(1.0, color=_PEER, linestyle=":", linewidth=1.0)
    axes[0].set_title("gain kept against communication")
    axes[1].set_title("exact match against communication")
    if title:
        fig.suptitle(title)
    return _finish(fig, path)
