"""occult_ft.plots: every figure renders to a non-empty PNG from small inputs; `analyze --plot` writes one."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")

from occult_ft import plots  # noqa: E402
from occult_ft.metrics import (  # noqa: E402
    comm_complexity_lower_bound,
    contiguous_expert_device,
    random_placement_comm_complexity,
    routing_report,
)
from occult_ft.placement import coactivation_matrix  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 2000  # a blank canvas of this size is already ~2 kB; a drawn figure is far more


def small_report():
    # 16 experts, top-4, 4 devices, 2 layers of 32 tokens with random routing
    gen = torch.Generator().manual_seed(0)
    ids = {i: torch.rand(32, 16, generator=gen).topk(4, dim=1).indices for i in (0, 1)}
    report = routing_report(ids, contiguous_expert_device(16, 4), 4, 16)
    report.extra["random_placement_comm_complexity"] = random_placement_comm_complexity(16, 4, 4)
    return report, ids


def test_plot_report_writes_png_and_accepts_the_dict_form(tmp_path):
    report, _ = small_report()
    fig = plots.plot_report(report, tmp_path / "report.png")
    assert len(fig.axes) == 2
    assert_png(tmp_path / "report.png")
    # `occult-ft analyze --json` output is the to_dict() form
    plots.plot_report(json.loads(json.dumps(report.to_dict())), tmp_path / "report_dict.png")
    assert_png(tmp_path / "report_dict.png")


def test_plot_report_draws_the_reference_lines(tmp_path):
    report, _ = small_report()
    report.extra["max_devices_per_token"] = 2
    fig = plots.plot_report(report)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    # k = 4; random: 4 * (1 - C(12,4)/C(16,4)) = 4 * (1 - 495/1820) = 2.912; bound ceil(4*4/16) = 1
    assert any(label.startswith("per-expert dispatch (k rows): 4.00") for label in labels)
    assert any(label.startswith("random placement, uniform routing: 2.91") for label in labels)
    assert any(label.startswith("lower bound ceil(k*D/E): 1.00") for label in labels)
    assert any(label.startswith("budget M=2: 2.00") for label in labels)


def test_plot_report_without_tokens_still_renders(tmp_path):
    empty = routing_report({0: torch.zeros(0, 4, dtype=torch.long)}, contiguous_expert_device(16, 4), 4, 16)
    plots.plot_report(empty, tmp_path / "empty.png")
    assert_png(tmp_path / "empty.png")


def test_plot_report_rejects_something_else():
    with pytest.raises(ValueError, match="RoutingReport"):
        plots.plot_report({"comm_complexity": 2.0})


def test_plot_report_rejects_a_non_png_path(tmp_path):
    report, _ = small_report()
    with pytest.raises(ValueError, match=r"\.png"):
        plots.plot_report(report, tmp_path / "report.jpg")


def test_plot_coactivation_orders_experts_by_device(tmp_path):
    _, ids = small_report()
    co = coactivation_matrix(ids[0], 16)
    groups = [[0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]]
    fig = plots.plot_coactivation(co, groups, path=tmp_path / "co.png")
    assert_png(tmp_path / "co.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()][:4] == ["0", "5", "10", "15"]
    # share of co-selected pairs inside devices, counted by hand from the matrix
    dev = torch.tensor([d for e in range(16) for d, g in enumerate(groups) if e in g])
    off = ~torch.eye(16, dtype=torch.bool)
    share = co[off & (dev[:, None] == dev[None, :])].sum().item() / co[off].sum().item()
    assert f"{share:.1%}" in ax.get_title()


def test_plot_coactivation_draws_into_given_axes(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    left, right = fig.subplots(1, 2)
    co = torch.ones(8, 8)
    assert plots.plot_coactivation(co, contiguous_expert_device(8, 2), ax=left, colorbar=False) is fig
    assert plots.plot_coactivation(co.tolist(), None, ax=right, title="one device") is fig
    assert right.get_title() == "one device"
    fig.savefig(tmp_path / "pair.png")
    assert_png(tmp_path / "pair.png")


def test_every_coactivation_heatmap_has_a_colour_bar():
    """`occult-ft place --plot` draws two heatmaps; each gets its colour bar (its own scale)."""
    from transformers import AutoModelForCausalLM

    from occult_ft.models import tiny_config
    from occult_ft.placement import compute_placement
    from occult_ft.profiling import profile_model

    fig = plots.plot_coactivation(torch.ones(8, 8), contiguous_expert_device(8, 2))
    assert len(fig.axes) == 2 and "tokens selecting both" in fig.axes[1].get_ylabel()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    prof = profile_model(model, [{"input_ids": torch.randint(0, 128, (4, 32))}], progress=False)
    fig = plots.plot_placement(prof, {"search": compute_placement(prof, 4)})
    colour_bars = [ax for ax in fig.axes if "tokens selecting both" in ax.get_ylabel()]
    assert len(colour_bars) == 2


def test_plot_coactivation_rejects_a_mapping_of_the_wrong_size():
    with pytest.raises(ValueError, match="3 entries"):
        plots.plot_coactivation(torch.ones(4, 4), [0, 0, 1])


def test_plot_placement_comparison_writes_png(tmp_path):
    per_layer = {"sequential": [2.9, 3.0, 2.8], "occult": [2.4, 2.5, 2.3], "search": [2.2, 2.3, 2.1]}
    plots.plot_placement_comparison(
        per_layer,
        random_placement_comm_complexity(16, 4, 4),
        comm_complexity_lower_bound(16, 4, 4),
        layers=[0, 1, 3],
        top_k=4,
        path=tmp_path / "cmp.png",
    )
    assert_png(tmp_path / "cmp.png")


def test_plot_placement_comparison_rejects_ragged_lists():
    with pytest.raises(ValueError, match="differ in length"):
        plots.plot_placement_comparison({"a": [1.0, 2.0], "b": [1.0]})


def test_plot_devices_histogram_writes_png(tmp_path):
    report, _ = small_report()
    plots.plot_devices_histogram({"report": report, "pruned": [0, 30, 34, 0, 0]}, path=tmp_path / "hist.png")
    assert_png(tmp_path / "hist.png")
    plots.plot_devices_histogram([0, 1, 5, 3], path=tmp_path / "one.png")
    assert_png(tmp_path / "one.png")


def log_history():
    history = []
    for step in range(1, 6):
        history.append(
            {
                "loss": 3.0 - 0.1 * step,
                "comm_complexity": 2.0 - 0.05 * step,
                "removed_mass": 0.2 - 0.01 * step,
                "learning_rate": 1e-4,
                "step": step,
                "epoch": step / 5,
            }
        )
    history.append({"eval_loss": 2.6, "eval_comm_complexity": 1.8, "eval_removed_mass": 0.15, "step": 5})
    history.append({"train_runtime": 1.0, "train_loss": 2.7, "step": 5})  # the summary entry, not a point
    return history


def test_plot_training_curves_writes_png(tmp_path):
    fig = plots.plot_training_curves(log_history(), tmp_path / "train.png", max_devices_per_token=2)
    assert len(fig.axes) == 3
    assert_png(tmp_path / "train.png")
    loss_line = fig.axes[0].get_lines()[0]
    assert list(loss_line.get_xdata()) == [1.0, 2.0, 3.0, 4.0, 5.0]  # summary entry skipped


def test_plot_training_curves_marks_missing_metrics_and_rejects_empty_logs(tmp_path):
    fig = plots.plot_training_curves([{"loss": 1.0, "step": 1}], tmp_path / "partial.png")
    assert any("not logged" in t.get_text() for t in fig.axes[2].texts)
    with pytest.raises(ValueError, match="learning_rate"):
        plots.plot_training_curves([{"learning_rate": 1.0, "step": 1}])


def test_plot_quality_tradeoff_writes_png(tmp_path):
    rows = [{"criterion": None, "max_devices_per_token": None, "eval_loss": 2.50, "comm_complexity": 2.9}]
    for criterion, shift in (("score", 0.0), ("similarity", -0.02)):
        for m, loss, cc in ((1, 2.9, 1.0), (2, 2.6, 1.9), (3, 2.52, 2.5)):
            rows.append(
                {
                    "criterion": criterion,
                    "max_devices_per_token": m,
                    "eval_loss": loss + shift,
                    "comm_complexity": cc,
                }
            )
    fig = plots.plot_quality_tradeoff(rows, tmp_path / "quality.png")
    assert len(fig.axes) == 2
    assert_png(tmp_path / "quality.png")
    fig = plots.plot_quality_tradeoff(
        [{"criterion": "score", "max_devices_per_token": 1, "eval_loss": 3.0}], baseline=2.5
    )
    assert len(fig.axes) == 1


def test_plot_quality_tradeoff_rejects_rows_without_the_metric():
    with pytest.raises(ValueError, match="eval_loss"):
        plots.plot_quality_tradeoff([{"criterion": "score", "max_devices_per_token": 1}])


def bench_row(name, kind, budget, rows, ms, path_ms):
    return {
        "backend": name,
        "peer": kind != "dedup",
        "kind": kind,
        "max_devices_per_token": budget,
        "rows_per_token": rows,
        "exchange_ms": ms,
        "path_ms": path_ms,
    }


def bench_result():
    backends = [
        bench_row("per_expert", "per_expert", None, 4.0, 2.0, 3.0),
        bench_row("hf_native_ep", "per_expert", None, 4.0, None, None),
        bench_row("occult_dedup", "dedup", None, 2.9, 1.5, 2.4),
        bench_row("occult_dedup_prune1", "dedup", 1, 1.0, 0.7, 1.1),
    ]
    clusters = [
        {
            "name": "8xH100-nvlink",
            "nodes": 1,
            "devices_per_node": 8,
            "num_devices": 8,
            "backends": [
                {
                    "backend": "per_expert",
                    "kind": "per_expert",
                    "max_devices_per_token": None,
                    "predicted_ms": 0.4,
                },
                {
                    "backend": "occult_dedup",
                    "kind": "dedup",
                    "max_devices_per_token": None,
                    "predicted_ms": 0.3,
                },
                {
                    "backend": "occult_dedup_prune1",
                    "kind": "dedup",
                    "max_devices_per_token": 1,
                    "predicted_ms": 0.1,
                },
            ],
        },
        {
            "name": "4x8-ib",
            "nodes": 4,
            "devices_per_node": 8,
            "num_devices": 32,
            "skipped": "too few experts",
        },
    ]
    return {
        "num_experts": 16,
        "top_k": 4,
        "devices": 2,
        "tokens": 64,
        "transport": "2 gloo processes on CPU",
        "backends": backends,
        "cost_model": {"bytes_per_row": 128, "clusters": clusters},
    }


def test_plot_bench_writes_png(tmp_path):
    plots.plot_bench(bench_result(), tmp_path / "bench.png")
    assert_png(tmp_path / "bench.png")
    # the minimal form a hand-written result takes: backend, rows_per_token, exchange_ms
    minimal = {
        "backends": [
            {"backend": b["backend"], "rows_per_token": b["rows_per_token"], "exchange_ms": b["exchange_ms"]}
            for b in bench_result()["backends"]
        ]
    }
    plots.plot_bench(minimal, tmp_path / "minimal.png")
    assert_png(tmp_path / "minimal.png")


def test_bench_figures_read_the_budget_from_the_field_not_the_name(tmp_path):
    # backend names that carry no budget text: only `kind` and `max_devices_per_token` say what each is
    report = bench_result()
    for row, name in zip(report["backends"], ("peer_a", "peer_b", "ours", "ours_small")):
        row["backend"] = name
    report["backends"][3]["max_devices_per_token"] = 2  # a budget the old name (prune1) did not say
    fig = plots.plot_bench(report, tmp_path / "bench_fields.png")
    assert_png(tmp_path / "bench_fields.png")
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["peer_a", "peer_b", "ours", "ours_small (M=2)"]
    # kind "dedup" is drawn in our colour, the peers in grey
    from matplotlib.colors import to_hex

    colors = [to_hex(bar.get_facecolor()) for bar in fig.axes[0].patches]
    assert colors[0] == colors[1] != colors[2] == colors[3]

    clusters = [
        {
            "name": "8 devices",
            "nodes": 1,
            "devices_per_node": 8,
            "num_devices": 8,
            "backends": [
                {"backend": "a", "kind": "per_expert", "max_devices_per_token": None, "predicted_ms": 0.8},
                {"backend": "b", "kind": "dedup", "max_devices_per_token": None, "predicted_ms": 0.4},
                {"backend": "c", "kind": "dedup", "max_devices_per_token": 2, "predicted_ms": 0.2},
                {"backend": "d", "kind": "dedup", "max_devices_per_token": 16, "predicted_ms": 0.5},
            ],
        }
    ]
    fig = plots.plot_cost_model({"cost_model": {"clusters": clusters}}, tmp_path / "cost_fields.png")
    assert_png(tmp_path / "cost_fields.png")
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "o"]
    # unpruned at M = D = 8; budget 16 >= D is plain de-duplication too, the faster (0.4) point is kept
    assert line.get_xdata().tolist() == [2, 8] and line.get_ydata().tolist() == [0.2, 0.4]
    (speed,) = [ln for ln in fig.axes[1].get_lines() if ln.get_marker() == "o"]
    assert speed.get_ydata().tolist() == [0.8 / 0.2, 0.8 / 0.4]  # the peer (0.8 ms) over each point
    # the speed-ups are written once, in the legend: labels at the points overlap between clusters
    assert not fig.axes[1].texts and "M=2: 4.00x, M=8: 2.00x" in speed.get_label()


def test_plot_cost_model_rejects_entries_without_a_kind():
    result = {"per_expert": {"exchange_ms": 1.0}, "dedup_prune1": {"exchange_ms": 0.5}}
    with pytest.raises(ValueError, match="has no `kind`"):
        plots.plot_cost_model({"8xH100-nvlink": result})


def test_plot_bench_rejects_a_report_without_backends():
    with pytest.raises(ValueError, match="backends"):
        plots.plot_bench({"model": "x"})


def test_plot_cost_model_from_predict_speedup(tmp_path):
    from occult_ft.bench.costmodel import CLUSTER_PRESETS, predict_speedup

    gen = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(64, 32, generator=gen), dim=-1)
    predictions = {}
    for name, shape in CLUSTER_PRESETS.items():
        per_device = 32 // shape.num_devices
        budgets = [m for m in (1, 2, 4) if m * per_device >= 4 and m < shape.num_devices]
        predictions[name] = predict_speedup(scores, 4, shape, bytes_per_row=4096, budgets=budgets)
    fig = plots.plot_cost_model(predictions, tmp_path / "cost.png")
    assert len(fig.axes) == 2
    assert_png(tmp_path / "cost.png")
    # one line per cluster on the time panel, its last point at M = D (de-duplication only)
    lines = [line for line in fig.axes[0].get_lines() if line.get_marker() == "o"]
    assert sorted(int(line.get_xdata()[-1]) for line in lines) == sorted(
        s.num_devices for s in CLUSTER_PRESETS.values()
    )


def test_plot_cost_model_from_a_bench_report(tmp_path):
    plots.plot_cost_model(bench_result(), tmp_path / "cost_bench.png")  # the skipped cluster is left out
    assert_png(tmp_path / "cost_bench.png")
    with pytest.raises(ValueError, match="de-duplicated"):
        plots.plot_cost_model(
            {
                "cost_model": {
                    "clusters": [
                        {
                            "name": "x",
                            "nodes": 1,
                            "devices_per_node": 2,
                            "backends": [
                                {"backend": "per_expert", "kind": "per_expert", "predicted_ms": 1.0}
                            ],
                        }
                    ]
                }
            }
        )


def test_comm_complexity_figure_from_report(tmp_path):
    report, _ = small_report()
    plots.comm_complexity_figure(report, tmp_path / "card.png", title="card")
    assert_png(tmp_path / "card.png")


def test_comm_complexity_figure_draws_reports_only(tmp_path):
    with pytest.raises(ValueError, match="measure_checkpoint"):
        plots.comm_complexity_figure(str(tmp_path), tmp_path / "card.png")


def test_plots_import_no_model_loading_code():
    # figures draw data: the package never imports the loaders, the profiler or the evaluation
    import ast
    from pathlib import Path

    forbidden = {"hub", "checkpoint", "profiling", "evaluation"}
    for file in Path(plots.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert not forbidden & set((node.module or "").split(".")), (file.name, node.module)


def test_comm_complexity_figure_from_checkpoint_feeds_the_model_card(tmp_path, tiny_olmoe_dir, text_file):
    from occult_ft.checkpoint import save_pruned
    from occult_ft.checkpoint.load import from_pretrained
    from occult_ft.evaluation import measure_checkpoint
    from occult_ft.hub import build_model_card
    from occult_ft.routing import PruningConfig

    model = from_pretrained(tiny_olmoe_dir)
    from transformers import AutoTokenizer

    out = tmp_path / "ckpt"
    save_pruned(
        model,
        str(out),
        tokenizer=AutoTokenizer.from_pretrained(tiny_olmoe_dir),
        pruning=PruningConfig(num_devices=2, max_devices_per_token=1),
    )
    png = out / "comm_complexity.png"
    report = measure_checkpoint(str(out), data=text_file, max_tokens=128, seq_len=32)
    assert report.extra == {
        "model": "ckpt",
        "max_devices_per_token": 1,
        "max_nodes_per_token": None,
        "criterion": "score",
    }
    # the budget holds: every measured token reaches exactly one of the 2 devices
    assert report.devices_histogram[0] == 0 and report.devices_histogram[2] == 0
    assert report.devices_histogram[1] == sum(m.tokens for m in report.layers) > 0
    fig = plots.comm_complexity_figure(report, png)
    assert_png(png)
    assert fig._suptitle.get_text().startswith("ckpt: ")
    assert "max_devices_per_token=1" in fig._suptitle.get_text()
    hist_ax = fig.axes[1]  # c = 1 .. D = 2 (no token reached none)
    assert hist_ax.get_xticks().tolist()[-1] == 2
    card = build_model_card(str(out), figure=str(png))
    assert "](comm_complexity.png)" in card.content


def test_measure_checkpoint_rejects_bad_input(tmp_path, tiny_olmoe_dir):
    from occult_ft.evaluation import measure_checkpoint

    with pytest.raises(ValueError, match="does not exist"):
        measure_checkpoint(tmp_path / "missing")
    # a plain (never pruned) checkpoint records no device count
    with pytest.raises(ValueError, match="records no num_devices; pass devices=D"):
        measure_checkpoint(tiny_olmoe_dir)
    with pytest.raises(ValueError, match="devices=0"):
        measure_checkpoint(tiny_olmoe_dir, devices=0)


def test_analyze_cli_plot_writes_png(tmp_path, tiny_olmoe_dir, text_file, capsys):
    from occult_ft.cli import main

    png = tmp_path / "analyze.png"
    rc = main(
        [
            "analyze",
            tiny_olmoe_dir,
            "--data",
            text_file,
            "--devices",
            "2",
            "--max-tokens",
            "128",
            "--seq-len",
            "32",
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    assert "comm_cx" in capsys.readouterr().out
    assert_png(png)


def test_place_cli_plot_draws_heatmaps_and_the_comparison(tmp_path, tiny_olmoe_dir, text_file, capsys):
    from occult_ft.cli import main

    prof, png = tmp_path / "p.safetensors", tmp_path / "place.png"
    assert (
        main(
            [
                "profile",
                tiny_olmoe_dir,
                "--data",
                text_file,
                "--out",
                str(prof),
                "--max-tokens",
                "256",
                "--seq-len",
                "32",
            ]
        )
        == 0
    )
    assert (
        main(["place", str(prof), "--devices", "4", "--out", str(tmp_path / "pl.json"), "--plot", str(png)])
        == 0
    )
    assert png.stat().st_size > 10_000
    assert str(png) in capsys.readouterr().err


def test_plot_placement_has_two_heatmaps_and_bars():
    from transformers import AutoModelForCausalLM

    from occult_ft.models import tiny_config
    from occult_ft.placement import compute_placement, sequential_placement
    from occult_ft.plots import plot_placement
    from occult_ft.profiling import profile_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    prof = profile_model(model, [{"input_ids": torch.randint(0, 128, (4, 32))}], progress=False)
    fig = plot_placement(
        prof,
        {"sequential": sequential_placement(8, 4, list(prof.layers)), "search": compute_placement(prof, 4)},
    )
    assert len(fig.axes) >= 3
    assert "search placement" in fig.axes[1].get_title()
