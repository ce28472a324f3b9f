"""The task quality study (`occult_ft.studies.task_study`, `occult-ft study --task dates`): its statistics by hand,
and the whole study through the CLI on a tiny setting."""

from __future__ import annotations

import json
import os

import pytest

from occult_ft.cli import main
from occult_ft.studies.task_study import (
    finetuning_plan,
    format_task_table,
    merge_results,
    paired_difference,
    summarize_runs,
)


def test_paired_difference_by_hand():
    # differences 1, 2, 3: mean 2, sd 1; t(0.975, 2) = 4.303 -> half-width 4.303 / sqrt 3 = 2.484 > 2: not real
    d = paired_difference([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert d["mean"] == pytest.approx(2.0) and d["sd"] == pytest.approx(1.0) and not d["real"]
    # differences 2, 2.1, 1.9: sd 0.1, half-width 0.248 < 2: real
    assert paired_difference([3.0, 3.1, 2.9], [1.0, 1.0, 1.0])["real"]
    assert not paired_difference([3.0], [1.0])["real"]  # one seed: never real
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1.0], [])


def _run(setting, kind, seed, loss, em, budget=None, criterion=None):
    return {
        "setting": setting,
        "kind": kind,
        "seed": seed,
        "budget": budget,
        "criterion": criterion,
        "distill_coef": 0.0,
        "loss": loss,
        "exact_match": em,
        "comm_complexity": 2.0,
        "removed_mass": 0.0,
    }


def test_every_seed_fine_tunes_standard_then_each_pruned_setting_then_the_distilled_ones():
    assert finetuning_plan((1, 2), ("score", "similarity"), "similarity", 0.0) == [
        ("standard fine-tuning", "standard", None, "score", 0.0),
        ("prune to 1, score, fine-tuned", "pruned", 1, "score", 0.0),
        ("prune to 1, similarity, fine-tuned", "pruned", 1, "similarity", 0.0),
        ("prune to 2, score, fine-tuned", "pruned", 2, "score", 0.0),
        ("prune to 2, similarity, fine-tuned", "pruned", 2, "similarity", 0.0),
    ]
    plan = finetuning_plan((1, 2), ("score",), "similarity", 0.5, distill_budgets=(2,))
    assert plan[-1] == ("prune to 2, similarity, distilled (0.5)", "distilled", 2, "similarity", 0.5)
    assert [row[1] for row in plan] == ["standard", "pruned", "pruned", "distilled"]


def test_gain_kept_is_paired_with_the_standard_run_of_the_same_seed():
    runs = [
        _run("base model", "base", None, 5.0, 0.0),
        _run("prune to 1, score, no fine-tuning", "zero-shot", None, 6.0, 0.0, 1, "score"),
        _run("standard fine-tuning", "standard", 0, 1.0, 0.5),
        _run("prune to 1, score, fine-tuned", "pruned", 0, 2.0, 0.25, 1, "score"),
        _run("standard fine-tuning", "standard", 1, 3.0, 0.4),
        _run("prune to 1, score, fine-tuned", "pruned", 1, 3.5, 0.1, 1, "score"),
    ]
    rows = {r["setting"]: r for r in summarize_runs(runs)}
    # seed 0: (5 - 2) / (5 - 1) = 0.75; seed 1: (5 - 3.5) / (5 - 3) = 0.75
    assert rows["prune to 1, score, fine-tuned"]["gain_kept"] == pytest.approx(0.75)
    assert rows["prune to 1, score, fine-tuned"]["gain_kept_sd"] == pytest.approx(0.0)
    # exact match: 0.25 / 0.5 = 0.5 and 0.1 / 0.4 = 0.25
    assert rows["prune to 1, score, fine-tuned"]["em_kept"] == pytest.approx(0.375)
    assert rows["standard fine-tuning"]["gain_kept"] == pytest.approx(1.0)
    # zero-shot is worse than the base model: (5 - 6) / 4 = -0.25 and (5 - 6) / 2 = -0.5
    assert rows["prune to 1, score, no fine-tuning"]["gain_kept"] == pytest.approx(-0.375)
    assert rows["prune to 1, score, fine-tuned"]["vs_standard"]["mean"] == pytest.approx(0.75)
    table = format_task_table({"seeds": [0, 1], "summary": list(rows.values())})
    assert "| prune to 1, score, fine-tuned | 2.7500 ± 1.0607 |" in table


@pytest.mark.slow
def test_study_task_runs_from_the_cli(tmp_path, capsys):
    out = tmp_path / "study"
    args = ["study", "--task", "months", "--output-dir", str(out), "--steps", "2", "--batch-size", "4"]
    args += [
        "--seeds",
        "0",
        "--budgets",
        "1",
        "--train-rows",
        "24",
        "--eval-rows",
        "8",
        "--profile-tokens",
        "512",
    ]
    assert main(args) == 0
    result = json.load(open(os.path.join(out, "study_months_results.json")))
    rows = {r["setting"]: r for r in result["summary"]}
    assert set(rows) == {
        "base model",
        "standard fine-tuning",
        "prune to 1, score, no fine-tuning",
        "prune to 1, similarity, no fine-tuning",
        "prune to 1, score, fine-tuned",
        "prune to 1, similarity, fine-tuned",
        "prune to 1, similarity, distilled (1)",
    }
    assert rows["standard fine-tuning"]["gain_kept"] == pytest.approx(1.0)
    for name, row in rows.items():
        assert 0.0 <= row["exact_match"] <= 1.0
        if name.startswith("prune to 1"):
            assert row["comm_complexity"] == pytest.approx(1.0)  # one device per token
    assert rows["base model"]["comm_complexity"] > 1.5
    assert "| standard fine-tuning |" in capsys.readouterr().out


def test_study_rejects_bad_flags(capsys):
    assert main(["study", "--task", "months", "--budgets", "5"]) == 2
    assert "max_devices_per_token=5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["study", "--task", "maths"])


def test_plot_gain_kept_draws_every_family(tmp_path):
    pytest.importorskip("matplotlib")
    from occult_ft.plots import plot_gain_kept

    runs = [
        _run("base model", "base", None, 5.0, 0.0),
        _run("standard fine-tuning", "standard", 0, 1.0, 0.5),
        _run("prune to 1, score, no fine-tuning", "zero-shot", None, 6.0, 0.0, 1, "score"),
        _run("prune to 1, score, fine-tuned", "pruned", 0, 2.0, 0.25, 1, "score"),
    ]
    fig = plot_gain_kept(summarize_runs(runs), tmp_path / "gain.png", title="t")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["score, zero-shot", "score, fine-tuned", "base model", "standard fine-tuning"]
    assert (tmp_path / "gain.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="summary rows need"):
        plot_gain_kept([{"setting": "x"}])


def test_merge_results_joins_disjoint_seeds():
    base = [_run("base model", "base", None, 5.0, 0.0)]
    one = [_run("standard fine-tuning", "standard", 0, 1.0, 0.5)]
    two = [_run("standard fine-tuning", "standard", 1, 3.0, 0.4)]
    meta = {"task": "months", "settings": {"steps": 2, "output_dir": "a"}, "train_rows": 4, "eval_rows": 2}
    meta["distill_coef"] = 1.0
    a = {**meta, "seeds": [0], "runs": base + one, "wall_seconds": 1.0}
    b = {
        **meta,
        "settings": {"steps": 2, "output_dir": "b"},
        "seeds": [1],
        "runs": base + two,
        "wall_seconds": 2.0,
    }
    merged = merge_results(a, b)
    assert merged["seeds"] == [0, 1] and len(merged["runs"]) == 3 and merged["wall_seconds"] == 3.0
    rows = {r["setting"]: r for r in merged["summary"]}
    assert rows["standard fine-tuning"]["loss"] == pytest.approx(2.0)  # (1 + 3) / 2
    with pytest.raises(ValueError, match="seeds \\[0\\] appear in two results"):
        merge_results(a, a)
    with pytest.raises(ValueError, match="differ in task or settings"):
        merge_results(a, {**b, "settings": {"steps": 3, "output_dir": "b"}})
