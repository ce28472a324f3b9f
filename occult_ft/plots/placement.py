"""Figures for choosing a placement: co-activation heatmaps and comm_complexity per layer by placement.

plot_coactivation           an (E, E) co-activation heatmap with experts ordered by device and the
                            device boundaries drawn: collaborating experts on one device form blocks
plot_placement_comparison   comm_complexity per layer for several placement algorithms
plot_placement              `occult-ft place --plot`: heatmaps before / after and the comparison
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..metrics import (
    comm_complexity,
    comm_complexity_lower_bound,
    contiguous_expert_device,
    expert_device_from_groups,
    random_placement_comm_complexity,
)
from .base import CYCLE, as_list, finish, hlines, new_figure, target

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_coactivation", "plot_placement_comparison", "plot_placement"]


def _expert_device(expert_device: Any, num_experts: int) -> list[int]:
    """(E,) device ids from a tensor / list of ids, or from `groups` (D lists of expert ids)."""

    values = as_list(expert_device)
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

    fig, ax = target(ax, size=(6.0, 5.2))
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
    return finish(fig, path)


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
    series = {name: [float(v) for v in as_list(values)] for name, values in per_layer.items()}
    lengths = {name: len(v) for name, v in series.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"per_layer lists differ in length {lengths}; give every algorithm one value per layer"
        )
    n = next(iter(lengths.values()))
    labels = [str(x) for x in (layers if layers is not None else range(n))]
    if len(labels) != n:
        raise ValueError(f"{len(labels)} layer labels for {n} values per algorithm")
    fig, ax = target(ax, size=(max(6.0, 0.55 * n * len(series) + 3), 4.5))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(n)]
        mean = sum(values) / n if n else 0.0
        ax.bar(xs, values, width=width, color=CYCLE[i % len(CYCLE)], label=f"{name} (mean {mean:.3f})")
    refs = {}
    if top_k is not None:
        refs["per-expert dispatch (k rows)"] = float(top_k)
    if random_expectation is not None:
        refs["random placement, uniform routing"] = float(random_expectation)
    if lower_bound is not None:
        refs["lower bound ceil(k*D/E)"] = float(lower_bound)
    hlines(ax, refs)
    ax.set_xticks(list(range(n)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("comm_complexity (devices per token)")
    top = max([v for values in series.values() for v in values] + list(refs.values()) + [1.0])
    ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=8, ncol=2, loc="upper right")
    ax.set_title(title or "comm_complexity per layer by placement")
    return finish(fig, path)


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
    fig, (ax_before, ax_after, ax_bars) = new_figure(ncols=3, size=(17.0, 5.0))
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
    return finish(fig, path)
