"""What the train-step benchmark reports (`occult_ft.bench.step.run_train_step`): each contender's
rounds summarised (step times, the step split, phases, memory, losses, the trainer's routing), the
comparison between contenders, and the report as text.

The split of one rank's step (`SPLIT`, seconds): exposed_exchange is the time blocked in an exchange
collective or its wait() with every rank of its group already there; waiting the time blocked in one
before the last rank of its group issued it (`waiting_by_rank`, from each rank's issue times on the
machine's one clock, or the diagnostic barriers); dense_allreduce and other_collectives as `PhaseClock`
(`occult_ft.bench.step_worker`) timed them; compute is the rest of the step.
"""

from __future__ import annotations

import statistics

__all__ = [
    "SPLIT",
    "PHASES",
    "waiting_by_rank",
    "summarise_contender",
    "compare_contenders",
    "format_step_report",
]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def waiting_by_rank(events_by_rank: list[list]) -> list[float]:
    """Seconds each rank waited for other ranks inside exchange collectives of one step.

    Args:
        events_by_rank: per rank, its events [group, seq, issued, [[from, to], ...]] (`PhaseClock`):
            the seq-th exchange collective of `group`, issued at `issued`, this rank blocked in it (or in
            its wait) over the intervals.

    Returns:
        per rank, the blocked time before the collective's last issue among its group's ranks (the
        collective cannot move a byte before every rank issued it): waiting, not transfer.
    """
    last: dict[tuple, float] = {}
    for events in events_by_rank:
        for group, seq, issued, _ in events:
            last[(group, seq)] = max(last.get((group, seq), issued), issued)
    out = []
    for events in events_by_rank:
        waited = 0.0
        for group, seq, _, blocked in events:
            everyone = last[(group, seq)]
            waited += sum(max(0.0, min(to, everyone) - frm) for frm, to in blocked)
        out.append(waited)
    return out


SPLIT = ("compute", "exposed_exchange", "waiting", "dense_allreduce", "other_collectives")
"""The step split every contender reports (module docstring)."""


def _split(record: dict, waited: float) -> dict[str, float]:
    """One rank's step as SPLIT (seconds); `waited` from `waiting_by_rank` (or the barriers)."""
    p = record["phases"]
    blocked = sum(p.get(k, 0.0) for k in ("exchange_fwd", "exchange_bwd"))
    barrier = p.get("exchange_fwd_wait", 0.0) + p.get("exchange_bwd_wait", 0.0)
    waiting = barrier + min(waited, blocked)
    out = {
        "exposed_exchange": blocked - min(waited, blocked),
        "waiting": waiting,
        "dense_allreduce": p.get("dense_allreduce", 0.0),
        "other_collectives": p.get("other_collectives", 0.0),
    }
    out["compute"] = record["seconds"] - sum(out.values())
    return out


def summarise_contender(name: str, runs: list[dict], warm: int, tokens_per_step: int) -> dict:
    """One contender's rounds (the gathered worker results, `warm` warm-up steps first in each) -> step
    times, tokens/s, the split, phases, memory, losses, syncs, the trainer's routing."""
    steps_s, phases, splits = [], [], []
    for run in runs:
        ranks = run["ranks"]
        n = min(len(r["records"]) for r in ranks)
        for i in range(warm, n):
            steps_s.append(max(r["records"][i]["seconds"] for r in ranks))
            waited = waiting_by_rank([r["records"][i].get("events", []) for r in ranks])
            for r, w in zip(ranks, waited):
                rec = r["records"][i]
                splits.append(_split(rec, w))
                phases.append(_phases(rec))
    median = statistics.median(steps_s)
    first = runs[0]["ranks"]
    return {
        "contender": name,
        "rounds": len(runs),
        "step_s": median,
        "spread_s": [_percentile(steps_s, 0.25), _percentile(steps_s, 0.75)],
        "step_s_runs": [round(s, 4) for s in steps_s],
        "tokens_per_s": tokens_per_step / median,
        "phases_ms": {k: 1000.0 * statistics.fmean(p[k] for p in phases) for k in phases[0]}
        if phases
        else {},
        "split_ms": {k: 1000.0 * statistics.fmean(x[k] for x in splits) for k in SPLIT} if splits else {},
        "exchange_share": statistics.fmean(
            (x["exposed_exchange"] + x["waiting"]) / max(1e-12, sum(x.values())) for x in splits
        )
        if splits
        else None,
        "peak_mb": max(r["peak_mb"] for r in first),
        "peak_mb_per_rank": [round(r["peak_mb"], 1) for r in first],
        "losses": first[0]["losses"],
        "syncs_per_layer": first[0]["syncs"],
        **_routing_means(runs, warm),
    }


PHASES = (
    "attention_dense",
    "router",
    "exchange_fwd_wait",
    "exchange_fwd",
    "local_experts_fwd",
    "backward_rest",
    "exchange_bwd_wait",
    "exchange_bwd",
    "dense_allreduce",
    "other_collectives",
    "optimizer",
)
"""The finer phases of a step (`occult_ft.bench.step` module docstring), in the report's column order."""


def _phases(record: dict) -> dict[str, float]:
    """One rank's step as PHASES (seconds), from the times `PhaseClock` recorded: the forward outside the
    MoE blocks is attention_dense, a block minus its router and exchange is local_experts_fwd, and the
    step minus forward and optimizer is backward_rest."""
    p = record["phases"]
    fwd, moe, router = p.get("forward", 0.0), p.get("moe_block", 0.0), p.get("router", 0.0)
    out = {k: p.get(k, 0.0) for k in PHASES}
    out["attention_dense"] = fwd - moe
    out["local_experts_fwd"] = moe - router - out["exchange_fwd"] - out["exchange_fwd_wait"]
    out["backward_rest"] = record["seconds"] - fwd - out["optimizer"]
    return out


def _routing_means(runs: list[dict], warm: int) -> dict[str, float]:
    """The trainer's logged device load imbalance and comm_complexity, mean over the timed steps of all
    rounds (rank 0's log; only contenders with an `OccultTrainer` log them)."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for record in run["ranks"][0]["records"][warm:]:
            for key, value in record.get("routing", {}).items():
                values.setdefault(key, []).append(value)
    return {key: statistics.fmean(v) for key, v in values.items() if v}


def compare_contenders(rows: list[dict]) -> None:
    """Adds to every measured row its ratio to the fastest contender that is not occult_ft's (`ours`), and
    its peak memory and losses against data parallel's where data parallel was measured."""
    measured = [r for r in rows if r["measured"]]
    others = [r for r in measured if not r["ours"]]
    best_other = max(others, key=lambda r: r["tokens_per_s"], default=None)
    dp = next((r for r in measured if r["contender"] == "data_parallel"), None)
    for row in measured:
        row["vs_best_other"] = row["tokens_per_s"] / best_other["tokens_per_s"] if best_other else None
        row["best_other"] = best_other["contender"] if best_other else None
        if dp is not None:
            row["peak_vs_dp"] = row["peak_mb"] / dp["peak_mb"] if dp["peak_mb"] else None
            pairs = list(zip(row["losses"], dp["losses"]))
            row["loss_vs_dp"] = {
                "first_step": abs(pairs[0][0] - pairs[0][1]) if pairs else None,
                "max": max((abs(a - b) for a, b in pairs), default=None),
            }


def format_step_report(report: dict) -> str:
    """The report as text: the step table, the step split, the trainer's routing, the finer phases, the
    cost model, notes."""
    lines = _table_lines(report)
    measured = [r for r in report["contenders"] if r["measured"]]
    lines += ["", "step split, ms per step (mean over ranks): " + ", ".join(SPLIT) + ", exchange share"]
    for r in measured:
        if r.get("split_ms"):
            share = r.get("exchange_share")
            lines.append(
                f"{r['contender']:<28} "
                + " ".join(f"{r['split_ms'].get(k, 0.0):>9.1f}" for k in SPLIT)
                + (f" {100 * share:>6.1f}%" if share is not None else "")
            )
    routed = [r for r in measured if "load_imbalance" in r]
    if routed:
        lines += ["", "routing the trainer logged (timed steps): device load imbalance, comm_complexity"]
        lines += [
            f"{r['contender']:<28} {r['load_imbalance']:>9.3f} {r.get('comm_complexity', float('nan')):>9.3f}"
            for r in routed
        ]
    lines += ["", "phases, ms per step (mean over ranks): " + ", ".join(PHASES)]
    for r in measured:
        lines.append(
            f"{r['contender']:<28} " + " ".join(f"{r['phases_ms'].get(k, 0.0):>8.1f}" for k in PHASES)
        )
    lines += _cost_model_lines(report["cost_model"])
    lines.append("")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def _table_lines(report: dict) -> list[str]:
    """The settings, the network and one row per contender: tokens/s, step time and spread, ratio to the
    best other contender, peak memory (and against data parallel), loss difference, host syncs."""
    s = report["settings"]
    if s.get("model") == "embedded":
        model = "the embedded model"
    elif s.get("shared_experts"):
        model = f"DeepSeek-V3-shaped random model ({s['shared_experts']} shared)"
    else:
        model = "OLMoE-shaped random model"
    accum = s.get("grad_accum", 1)
    lines = [
        f"train step: {model}, hidden {s['hidden']}, {s['layers']} layers, {s['experts']} experts top-{s['top_k']}, "
        f"seq {s['seq_len']}, {report['tokens_per_step']} tokens/step ({accum} micro-batches) on {s['devices']} "
        f"processes ({report['device']}), {s['rounds']} rounds x {s['steps']} steps after {s['warmup']} warm-up",
        f"network: {report.get('network', 'the host loopback')}",
        "",
        f"{'contender':<28} {'tokens/s':>9} {'step s':>8} {'spread':>15} {'vs best':>8} {'peak MB':>9} "
        f"{'vs DP':>6} {'loss diff':>10} {'syncs/layer':>11}",
    ]
    for r in report["contenders"]:
        if not r["measured"]:
            lines.append(f"{r['contender']:<28} not measured: {r['reason']}")
            continue
        spread = f"[{r['spread_s'][0]:.2f}, {r['spread_s'][1]:.2f}]"
        vs = f"{r['vs_best_other']:.2f}x" if r.get("vs_best_other") else "-"
        peak_vs = f"{r['peak_vs_dp']:.2f}" if r.get("peak_vs_dp") else "-"
        loss = r.get("loss_vs_dp", {}).get("max")
        syncs = r.get("syncs_per_layer")
        lines.append(
            f"{r['contender']:<28} {r['tokens_per_s']:>9.0f} {r['step_s']:>8.3f} {spread:>15} {vs:>8} "
            f"{r['peak_mb']:>9.0f} {peak_vs:>6} {'-' if loss is None else format(loss, '.1e'):>10} "
            f"{'-' if syncs is None else format(syncs, '.2f'):>11}"
        )
    return lines


def _cost_model_lines(cost_model: dict) -> list[str]:
    """The cost model's predictions, a blank line before each cluster."""
    lines = []
    for c in cost_model["clusters"]:
        lines.append("")
        if "skipped" in c:
            lines.append(f"cost model {c['name']}: skipped, {c['skipped']}")
            continue
        for label in ("same_global_batch", "same_tokens_per_device"):
            p = c[label]
            lines.append(
                f"cost model {c['name']} ({c['nodes']}x{c['devices_per_node']}), {label} ({p['tokens']} tokens): "
                "predicted exchange ms per step (fwd + bwd): "
                + ", ".join(f"{k} {v:.2f}" for k, v in p["exchange_ms_per_step"].items())
            )
    return lines
