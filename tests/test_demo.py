"""The demo pipeline on the embedded model (small settings) and the embedded default itself."""

import json
import os

import pytest

from occult_ft.cli import main
from occult_ft.studies.finetune import DemoSettings


def test_embedded_model_has_structured_routing():
    """Random weights would give comm_complexity near the random expectation; the shipped model must not."""
    from occult_ft.checkpoint.load import load_model_and_tokenizer
    from occult_ft.evaluation import data_batches
    from occult_ft.metrics import random_placement_comm_complexity, routing_report
    from occult_ft.placement import compute_placement
    from occult_ft.profiling import profile_model

    model, tok = load_model_and_tokenizer("embedded")
    assert model.config.model_type == "olmoe" and model.config.num_experts == 32
    prof = profile_model(model, data_batches(tok, "embedded", 64, 8, 4096), progress=False)
    placed = compute_placement(prof, 4, algorithm="search", bound_time_limit=0)  # the structure, not a bound
    ids = prof.topk_ids()
    cc = routing_report(ids, {i: placed.expert_device(i) for i in ids}, 4, 32).comm_complexity
    assert cc < 0.9 * random_placement_comm_complexity(32, 4, 4)


def test_demo_rejects_bad_flags(capsys):
    assert main(["demo", "--max-devices-per-token", "9"]) == 2
    assert "max_devices_per_token=9" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_command_runs_the_whole_pipeline_with_a_bar_or_a_line_for_every_phase(tmp_path, capsys):
    """`occult-ft demo` at small settings: profiling, placing, evaluating and fine-tuning each show a
    progress bar on stderr; the phase lines and the summary table go to stdout; the command's defaults are
    DemoSettings' own; the results (placements, pruning, fine-tuning, reload) hold."""
    import argparse

    from occult_ft.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    defaults = vars(sub.choices["demo"].parse_args([]))
    for name, value in vars(DemoSettings()).items():
        if name not in ("progress",):
            assert defaults[name] == value, name
    out_dir = tmp_path / "d"
    argv = ["demo", "--output-dir", str(out_dir), "--steps", "6", "--batch-size", "4", "--seq-len", "64"]
    assert main([*argv, "--eval-tokens", "2048", "--profile-tokens", "4096"]) == 0
    out, err = capsys.readouterr()
    for bar in ("profiling", "placing", "evaluating", "6/6"):  # 6/6: the trainer's bar over the steps
        assert bar in err, bar
    assert all(f"[{i}/5]" in out for i in range(1, 6)) and "reloaded checkpoint" in out

    result = json.loads((out_dir / "demo_results.json").read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    seq, occ, search = (
        rows[f"placement: {a}"]["comm_complexity"] for a in ("sequential", "occult", "search")
    )
    # held out, both placements beat the sequential one (the trained co-activation has structure) ...
    assert occ < seq and search < seq
    # ... and on the profiled tokens search is never worse than occult (held out it may be: other tokens)
    profiled = {
        a: json.loads((out_dir / f"placement-{a}.json").read_text())["metrics"]["comm_complexity"]
        for a in ("occult", "search")
    }
    assert profiled["search"] <= profiled["occult"] + 1e-9
    assert rows["random placement (expected)"]["comm_complexity"] == pytest.approx(2.8176, abs=1e-3)
    assert rows["pruned to 2, fine-tuned"]["comm_complexity"] <= 2.0
    assert rows["pruned to 2, no fine-tuning"]["removed_mass"] > 0
    assert rows["reloaded checkpoint"]["loss"] == pytest.approx(
        rows["pruned to 2, fine-tuned"]["loss"], abs=1e-4
    )
    cfg = json.load(open(os.path.join(result["checkpoint"], "config.json")))
    assert cfg["occult"]["max_devices_per_token"] == 2 and cfg["occult"]["placement"]["algorithm"] == "search"
