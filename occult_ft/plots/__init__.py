"""Figures for choosing a placement and a budget: routing reports, co-activation, training, benchmarks.

Users pick an expert placement and a `max_devices_per_token` budget by looking at what they buy:

    plot_report                 comm_complexity per layer + devices-per-token histogram of one
                                `RoutingReport`, against k rows (per-expert dispatch), the random-placement
                                expectation and the lower bound ceil(k*D/E)   (`occult-ft analyze --plot`)
    comm_complexity_figure      the same figure for the model card (`occult_ft.hub.build_model_card(...,
                                figure=PNG)`); a checkpoint is measured first with
                                `occult_ft.evaluation.measure_checkpoint`
    plot_coactivation           an (E, E) co-activation heatmap with experts ordered by device and the
                                device boundaries drawn: collaborating experts on one device form blocks
    plot_placement_comparison   comm_complexity per layer for several placement algorithms
    plot_placement              `occult-ft place --plot`: heatmaps before / after and the comparison
    plot_devices_histogram      share of tokens reaching c devices, for several routings side by side
    plot_training_curves        loss, comm_complexity and removed router mass from `Trainer.state.log_history`
    plot_quality_tradeoff       eval loss against max_devices_per_token, one line per pruning criterion
    plot_gain_kept              the task study's gain kept and exact match against comm_complexity
    plot_bench                  rows per token and exchange time per backend of an `occult-ft bench` report
    plot_cost_model             predicted exchange time and speed-up against the budget, per cluster shape
    plot_train_step             tokens/s and per-phase breakdown of a train-step benchmark report

Every function draws data it is given (reports, profiles, logs, predictions); none loads or runs a model.
Each returns the `matplotlib.figure.Figure` and, given `path`, also writes it as PNG. Figures are built
with matplotlib's object-oriented API (no pyplot): nothing switches the global backend or keeps figures
alive, PNGs render through Agg, so the functions work headless, in worker threads and in notebooks (after
`%matplotlib inline` a returned Figure shows inline). matplotlib is imported inside the functions; it is
the optional `plot` extra (`pip install "occult-ft[plot]"`).

    base.py        colours, figure creation, PNG writing, reference lines
    routing.py     plot_report, comm_complexity_figure, plot_devices_histogram
    placement.py   plot_coactivation, plot_placement_comparison, plot_placement
    training.py    plot_training_curves, plot_quality_tradeoff, plot_gain_kept
    bench.py       plot_bench, plot_cost_model, plot_train_step

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
