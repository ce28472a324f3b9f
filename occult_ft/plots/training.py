"""Figures of training and quality: logged curves over steps, quality against the budget.

plot_training_curves        loss, comm_complexity and removed router mass from `Trainer.state.log_history`
plot_quality_tradeoff       eval loss against max_devices_per_token, one line per pruning criterion
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .base import BUDGET, CYCLE, OURS, PEER, finish, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_training_curves", "plot_quality_tradeoff", "plot_gain_kept"]


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
    fig, axes = new_figure(ncols=len(metrics), size=(4.6 * len(metrics), 3.8))
    for ax, metric in zip(axes, metrics):
        (steps, values), (eval_steps, eval_values) = found[metric]
        if steps:
            ax.plot(
                steps,
                values,
                color=OURS,
                marker="o" if len(steps) < 30 else None,
                markersize=3,
                label="train",
            )
        if eval_steps:
            ax.plot(eval_steps, eval_values, color=CYCLE[1], marker="s", markersize=4, label="eval")
        if metric == "comm_complexity" and max_devices_per_token is not None:
            ax.axhline(
                max_devices_per_token,
                color=BUDGET,
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
    return finish(fig, path)


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
    pruned, baseline = _tradeoff_rows(rows, metric, baseline)
    by_criterion: dict[str, list[Mapping[str, Any]]] = {}
    for r in pruned:
        by_criterion.setdefault(str(r["criterion"]), []).append(r)
    with_cc = any("comm_complexity" in r for r in pruned)
    fig, axes = new_figure(ncols=2 if with_cc else 1, size=(11.0 if with_cc else 6.0, 4.3))
    ax = axes[0]
    budgets = sorted({int(r["max_devices_per_token"]) for r in pruned})
    for i, (criterion, group) in enumerate(by_criterion.items()):
        group = sorted(group, key=lambda r: int(r["max_devices_per_token"]))
        color = CYCLE[i % len(CYCLE)]
        ax.plot(
            [int(r["max_devices_per_token"]) for r in group],
            [float(r[metric]) for r in group],
            marker="o",
            color=color,
            label=criterion,
        )
        if with_cc:
            _plot_against_comm(axes[1], group, metric, criterion, color)
    for a in axes:
        if baseline is not None:
            a.axhline(baseline, color=PEER, linestyle=":", linewidth=1.4, label=f"unpruned: {baseline:.3f}")
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
    return finish(fig, path)


def _tradeoff_rows(
    rows: Iterable[Mapping[str, Any]], metric: str, baseline: float | None
) -> tuple[list[dict], float | None]:
    """(the pruned rows, the baseline: given, or the mean `metric` of the unpruned rows), checked."""
    copies = [dict(r) for r in rows]
    bad = [
        r
        for r in copies
        if metric not in r or ("criterion" not in r and r.get("max_devices_per_token") is not None)
    ]
    if bad:
        raise ValueError(f"rows need `criterion`, `max_devices_per_token` and `{metric}`; got {bad[0]}")
    unpruned = [float(r[metric]) for r in copies if r.get("max_devices_per_token") is None]
    if baseline is None and unpruned:
        baseline = sum(unpruned) / len(unpruned)
    pruned = [r for r in copies if r.get("max_devices_per_token") is not None]
    if not pruned and baseline is None:
        raise ValueError("no rows to plot; pass rows with max_devices_per_token and the metric")
    return pruned, baseline


def _plot_against_comm(ax, group: list, metric: str, criterion: str, color) -> None:
    """One criterion's rows that carry comm_complexity: `metric` against it, each point labelled M."""
    pts = [r for r in group if "comm_complexity" in r]
    ax.plot(
        [float(r["comm_complexity"]) for r in pts],
        [float(r[metric]) for r in pts],
        marker="o",
        color=color,
        label=criterion,
    )
    for r in pts:
        ax.annotate(
            f"M={r['max_devices_per_token']}",
            (float(r["comm_complexity"]), float(r[metric])),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=7,
            color=color,
        )


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
        summary: the `summary` rows of a study result (`occult_ft.studies.task_study.summarize_runs`): dicts
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
    fig, axes = new_figure(ncols=2, size=(11.5, 4.4))
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
                color=CYCLE[i % len(CYCLE)],
                capsize=3,
                label=label,
            )
        for r in rows:
            if r["kind"] in ("base", "standard"):
                marker, color = ("*", OURS) if r["kind"] == "standard" else ("s", PEER)
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
    axes[0].axhline(1.0, color=PEER, linestyle=":", linewidth=1.0)
    axes[0].set_title("gain kept against communication")
    axes[1].set_title("exact match against communication")
    if title:
        fig.suptitle(title)
    return finish(fig, path)
