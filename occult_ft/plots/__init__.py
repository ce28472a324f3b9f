"""Figures for choosing a placement and a budget: routing reports, co-activation, training, benchmarks.

Every function draws data it is given (reports, profiles, logs, predictions; none loads or runs a
model) and returns the `matplotlib.figure.Figure`, also written as PNG given `path`. matplotlib (the
`plot` extra) is imported inside the functions and used through its object-oriented API (no pyplot, PNGs
through Agg), so they work headless, in worker threads and in notebooks.

    base.py        colours, figure creation, PNG writing, reference lines
    routing.py     plot_report (comm_complexity per layer and devices-per-token histogram of a
                   `RoutingReport` against k, random placement and ceil(k*D/E); `occult-ft analyze --plot`),
                   comm_complexity_figure (the same for the model card), plot_devices_histogram
    placement.py   plot_coactivation ((E, E) heatmap, experts ordered by device), plot_placement_comparison
                   (comm_complexity per layer per algorithm), plot_placement (`occult-ft place --plot`)
    training.py    plot_training_curves (loss, comm_complexity, removed router mass), plot_quality_tradeoff
                   (eval loss against the budget), plot_gain_kept (the task study)
    bench.py       plot_bench (rows per token, exchange time per backend), plot_cost_model (predicted
                   exchange time against the budget), plot_train_step (tokens/s, per-phase breakdown)

Shape legend: T tokens, K experts per token (top-k), E experts, D devices, M = max_devices_per_token.
"""

from .base import DPI
from .bench import plot_bench, plot_cost_model, plot_train_step
from .placement import plot_coactivation, plot_placement, plot_placement_comparison
from .routing import comm_complexity_figure, plot_devices_histogram, plot_report
from .training import plot_gain_kept, plot_quality_tradeoff, plot_training_curves

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
    "plot_gain_kept",
    "plot_bench",
    "plot_cost_model",
    "plot_train_step",
]
