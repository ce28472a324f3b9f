"""The demo pipeline on the embedded model (small settings) and the embedded default itself."""

import json
import os

import pytest

from occult_ft.cli import main
from occult_ft.studies.demo import run_demo
from occult_ft.studies.finetune import DemoSettings


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline(tmp_path):
    s = DemoSettings(
        output_dir=str(tmp_path / "demo"),
        steps=6,
        batch_size=4,
        seq_len=64,
        eval_tokens=2048,
        profile_tokens=4096,
    )
    result = run_demo(s, verbose=False)
    rows = {r["setting"]: r for r in result["rows"]}
    seq, occ, search = (
        rows[f"placement: {a}"]["comm_complexity"] for a in ("sequential", "occult", "search")
    )
    assert search <= occ + 1e-9 and search < seq  # the trained model's co-activation has structure
    assert rows["random placement (expected)"]["comm_complexity"] == pytest.approx(2.8176, abs=1e-3)
    assert rows["pruned to 2, fine-tuned"]["comm_complexity"] <= 2.0
    assert rows["pruned to 2, no fine-tuning"]["removed_mass"] > 0
    assert rows["reloaded checkpoint"]["loss"] == pytest.approx(
        rows["pruned to 2, fine-tuned"]["loss"], abs=1e-4
    )
    cfg = json.load(open(os.path.join(result["checkpoint"], "config.json")))
    assert cfg["occult"]["max_devices_per_token"] == 2 and cfg["occult"]["placement"]["algorithm"] == "search"
    assert os.path.isfile(tmp_path / "demo" / "demo_results.json")


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
    placed = compute_placement(prof, 4, algorithm="search")  # the structure, not the solver, is tested here
    ids = prof.topk_ids()
    cc = routing_report(ids, {i: placed.expert_device(i) for i in ids}, 4, 32).comm_complexity
    assert cc < 0.9 * random_placement_comm_complexity(32, 4, 4)


def test_demo_rejects_bad_flags(capsys):
    assert main(["demo", "--max-devices-per-token", "9"]) == 2
    assert "max_devices_per_token=9" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_command_shows_a_bar_or_a_line_for_every_phase(tmp_path, capsys):
    """Profiling, placing, evaluating and fine-tuning each show a progress bar on stderr; the phase lines
    and the summary table go to stdout. The command's defaults are DemoSettings' own."""
    import argparse

    from occult_ft.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    defaults = vars(sub.choices["demo"].parse_args([]))
    for name, value in vars(DemoSettings()).items():
        if name not in ("progress",):
            assert defaults[name] == value, name
    argv = [
        "demo",
        "--output-dir",
        str(tmp_path / "d"),
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
    ]
    assert main([*argv, "--eval-tokens", "512", "--profile-tokens", "1024"]) == 0
    out, err = capsys.readouterr()
    for bar in ("profiling", "placing", "evaluating", "4/4"):  # 4/4: the trainer's bar over the steps
        assert bar in err, bar
    assert all(f"[{i}/5]" in out for i in range(1, 6)) and "reloaded checkpoint" in out
