"""Shared plumbing of the figures: colours, figure creation without pyplot, PNG writing, reference lines.

Every figure is built with matplotlib's object-oriented API (no pyplot): nothing switches the global
backend or keeps figures alive, PNGs render through Agg. matplotlib is imported inside the functions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from ..fileio import atomic_save
from ..metrics import RoutingReport, comm_complexity_lower_bound, random_placement_comm_complexity

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


# the shared pieces of every figure module (not re-exported by `occult_ft.plots`)
__all__ = [
    "DPI",
    "OURS",
    "PEER",
    "RANDOM",
    "BOUND",
    "BUDGET",
    "CYCLE",
    "REF_STYLE",
    "new_figure",
    "target",
    "finish",
    "report_dict",
    "references",
    "hlines",
    "as_list",
    "mean_devices",
]

DPI = 110
"""Resolution of saved PNGs (a 12 x 4.5 inch figure is 1320 x 495 pixels, ~60-120 kB)."""

# one colour per role, the same in every figure
OURS = "#2a7ab9"  # occult_ft's numbers (measured routing, de-duplicated dispatch)
PEER = "#8c8c8c"  # per-expert dispatch and other peers
RANDOM = "#d62728"  # random-placement expectation
BOUND = "#2ca02c"  # lower bound ceil(k*D/E)
BUDGET = "#9467bd"  # a pruning budget
# series colours: none of them is a reference-line colour above
CYCLE = ("#2a7ab9", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#1f3b73", "#f2b701")


# ---- plumbing ----------------------------------------------------------------------------------------
def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (6.0, 4.5)):
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


def target(ax: Axes | None, size: tuple[float, float] = (6.0, 4.5)) -> tuple[Figure, Axes]:
    """Draw into `ax` when given, else into a new one-axes figure."""
    if ax is not None:
        return cast("Figure", ax.figure), ax
    fig, (new_ax,) = new_figure(size=size)
    return fig, new_ax


def check_figure_path(path: str | os.PathLike) -> str:
    """A figure's path: a .png in an existing directory (one-line ValueError otherwise); returned as str."""
    path = os.fspath(path)
    if not path.lower().endswith(".png"):
        raise ValueError(f"figure path {path!r} does not end in .png; the figures are written as PNG")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write figure {path!r}: directory {parent!r} does not exist")
    return path


def finish(fig: Figure, path: str | os.PathLike | None) -> Figure:
    if path is not None:
        path = check_figure_path(path)
        atomic_save(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    return fig


def report_dict(report: RoutingReport | Mapping[str, Any]) -> dict:
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


def references(
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


REF_STYLE: dict[str, dict[str, Any]] = {
    "per-expert dispatch (k rows)": dict(color=PEER, linestyle=":"),
    "random placement, uniform routing": dict(color=RANDOM, linestyle="--"),
    "lower bound ceil(k*D/E)": dict(color=BOUND, linestyle="-."),
}


def hlines(ax: Axes, refs: Mapping[str, float]) -> None:
    for label, value in refs.items():
        style = REF_STYLE.get(label, dict(color=BUDGET, linestyle="--"))
        ax.axhline(value, linewidth=1.4, label=f"{label}: {value:.2f}", **style)


def as_list(values: Any) -> list:
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return list(values)


def mean_devices(hist: Sequence[int]) -> float:
    total = sum(hist)
    return sum(c * n for c, n in enumerate(hist)) / total if total else 0.0
