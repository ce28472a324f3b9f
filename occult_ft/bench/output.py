"""The benchmark report as a readable table, and as a bar chart (matplotlib, imported lazily)."""

from __future__ import annotations

__all__ = ["format_report"]


def _num(value, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


def format_report(report: dict) -> str:
    """The report of `run_benchmark` as text: header, one line per backend, per-layer C_T, cost model, notes."""
    r = report
    nodes = r.get("nodes", 1)
    node_head = f" {'x-node/tok':>10} {'x-node MB':>9} {'in-node':>9}" if nodes > 1 else ""
    lines = [
        _header(r),
        "",
        f"{'backend':<26} {'rows/tok':>8} {'rows':>10} {'remote':>10} {'MB':>9}{node_head} {'imbal':>6} "
        f"{'exch ms':>9} {'path ms':>9} {'vs best':>8}  notes",
    ]
    lines += [_backend_line(b, r.get("best_peer"), nodes) for b in r["backends"]]
    lines.append("")
    lines += _complexity_lines(r, nodes)
    # results only: the speed-ups are the table's last column; the exactness checks are printed as such
    checks = {
        "rows_equal_comm_complexity_x_tokens": "de-duplicated rows sent = sum over tokens of comm_complexity",
        "cross_node_rows_equal_node_count": "two-stage cross-node rows = sum over tokens of remote nodes",
    }
    for name, label in checks.items():
        if name in r["targets"]:
            lines.append(f"check: {label}: {'yes' if r['targets'][name] else 'NO'}")
    lines += _cost_model_lines(r["cost_model"])
    if r["notes"]:
        lines.append("")
        lines.extend(f"note: {n}" for n in r["notes"])
    return "\n".join(lines)


def _header(r: dict) -> str:
    """The run in one line: model, experts, transport, tokens, layers, iterations (and nodes)."""
    head = (
        f"occult-ft bench: {r['model']}"
        + (f" (placement {r['placement']})" if r.get("placement") else "")
        + f" | E={r['num_experts']} top-{r['top_k']} | {r['transport']} | {r['tokens']} tokens "
        f"({r['tokens_per_device']}/process) | hidden {r['hidden']} {r['dtype']} | "
        f"{len(r['moe_layers'])} MoE layer(s) | median of {r['iters']} after {r['warmup']} warm-up"
    )
    nodes = r.get("nodes", 1)
    return head + (f" | {nodes} nodes x {r['devices'] // nodes} processes" if nodes > 1 else "")


def _backend_line(b: dict, best_peer: str | None, nodes: int) -> str:
    """One backend's row of the table (the node columns with nodes > 1)."""
    mb = 1e6
    notes = []
    if b["peer"]:
        notes.append("peer" + (" (best)" if b["backend"] == best_peer else ""))
    if b.get("dropped_share"):
        notes.append(f"drops {100 * b['dropped_share']:.1f}% of routes")
    if not b["measured"]:
        notes.append(f"not measured: {b.get('reason', '')}")
    speed = b.get("speedup_vs_best_peer")
    node_cols = (
        f" {b['cross_node_rows_per_token']:>10.3f} {b['cross_node_bytes'] / mb:>9.1f} {b['intra_node_rows']:>9}"
        if nodes > 1
        else ""
    )
    return (
        f"{b['backend']:<26} {b['rows_per_token']:>8.3f} {b['rows']:>10} {b['remote_rows']:>10} "
        f"{b['bytes'] / mb:>9.1f}{node_cols} {_num(b.get('load_imbalance'), '.2f', 6)} "
        f"{_num(b['exchange_ms'], '.2f', 9)} {_num(b['path_ms'], '.2f', 9)} "
        f"{_num(speed, '.2f', 7)}{'x' if speed is not None else ' '}  {'; '.join(notes)}"
    )


def _complexity_lines(r: dict, nodes: int) -> list[str]:
    """C_T per layer (and after each pruning budget); N_T too with nodes > 1."""
    keys = ["comm_complexity"] + (["node_comm_complexity"] if nodes > 1 else [])
    return [
        f"{key} per layer: "
        + ", ".join(
            f"{pl['layer']}: {pl[key]:.3f}"
            + "".join(f" / prune{m} {pl[f'{key}_prune{m}']:.3f}" for m in r["budgets"])
            for pl in r["layers"]
        )
        for key in keys
    ]


def _cost_model_lines(cm: dict) -> list[str]:
    """The cost model: per cluster its links and each backend's predicted exchange."""
    lines = [
        "",
        f"cost model: predicted forward exchange ms (dispatch + combine, {cm['bytes_per_row']} bytes/row)",
    ]
    for c in cm["clusters"]:
        label = (
            f"  {c['name']:<16} {c['nodes']}x{c['devices_per_node']} intra {c['intra_node_GBps']:g} GB/s "
            f"inter {c['inter_node_GBps']:g} GB/s ({c['volumes']} volumes)"
        )
        if "skipped" in c:
            lines.append(f"{label}: skipped, {c['skipped']}")
            continue
        lines.append(label)
        lines.append(
            "    "
            + "  ".join(
                f"{p['backend']} {p['predicted_ms']:.3f}"
                + (f" ({p['speedup_vs_best_peer']:.2f}x)" if p.get("speedup_vs_best_peer") else "")
                + (
                    f" [{p['cross_node_MB']:.1f} MB x-node]"
                    if c["nodes"] > 1 and "cross_node_MB" in p
                    else ""
                )
                for p in c["backends"]
            )
        )
        if c.get("not_predicted"):
            lines.append(f"    not predicted: {c['not_predicted']}")
    return lines
