"""The generation benchmark (`occult_ft.bench.generate`, `occult-ft bench --generate`): contender names,
settings and command refusals, the aggregation worked by hand, and one real run on 2 gloo processes of
the embedded model (no timing is asserted: every contender must run, and the contenders without a
budget must generate the same tokens).
"""

from __future__ import annotations

import json

import pytest

from occult_ft.bench.generate import (
    GenerateSettings,
    _compare,
    _summarise,
    default_contenders,
    format_generate_report,
    generate_contender,
    run_generate_bench,
)
from occult_ft.cli import main

SMALL = dict(devices=2, batch=2, prompt_len=16, new_tokens=4, iters=1, warmup=0, rounds=1, device="cpu")


def test_contender_names():
    s = GenerateSettings(devices=4)
    assert generate_contender("occult_ep", s) == {
        "name": "occult_ep",
        "kind": "occult_ep",
        "exchange": "flat",
        "capacity": "auto",
        "checkpoint": "placed",
        "ours": True,
    }
    budget = generate_contender("occult_ep_budget2_exact", s)
    assert budget["max_devices_per_token"] == 2 and budget["checkpoint"] == "budget2"
    assert budget["capacity"] is None
    per_expert = generate_contender("occult_ep_per_expert", s)
    assert (
        per_expert["exchange"] == "per_expert" and per_expert["capacity"] is None and not per_expert["ours"]
    )
    assert generate_contender("hf_native_ep", s)["checkpoint"] == "original"
    assert default_contenders(GenerateSettings(devices=2)) == [
        "occult_ep",
        "occult_ep_budget1",
        "occult_ep_per_expert",
        "hf_native_ep",
    ]
    with pytest.raises(ValueError, match=r"^unknown contender 'deepspeed_moe'; choose from occult_ep"):
        generate_contender("deepspeed_moe", s)
    with pytest.raises(ValueError, match=r"^occult_ep_two_stage needs nodes > 1 \(got nodes=1\)"):
        generate_contender("occult_ep_two_stage", s)
    with pytest.raises(ValueError, match=r"^occult_ep_budget4: a budget of 4 devices must be between 1 and"):
        generate_contender("occult_ep_budget4", s)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(devices=1), r"^devices=1 must be at least 2"),
        (dict(devices=3), r"^devices=3 must divide the 32 experts"),
        (dict(new_tokens=1), r"^new_tokens=1 must be at least 2"),
        (dict(prompt_len=500, new_tokens=16), r"^prompt_len \+ new_tokens = 516 exceeds"),
        (dict(batch=0), r"^batch=0 must be a positive integer"),
        (dict(link_rate="fast"), r"link rate|rate"),
    ],
)
def test_settings_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerateSettings(**kwargs)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--generate", "some/model"], "--generate measures the embedded model"),
        (["--generate", "--train"], "--train and --generate measure different things"),
        (["--generate", "--synthetic"], "--generate takes no --synthetic"),
        (["--generate", "--plot", "x.png"], "--generate draws no figure"),
        (["--generate", "--backends", "occult_ep,nccl"], "unknown contender 'nccl'"),
        (["--generate", "--devices", "3"], "devices=3 must divide the 32 experts"),
        (["--synthetic", "--new-tokens", "4"], "--new-tokens is a --generate setting"),
    ],
)
def test_cli_generate_refusals(argv, message, capsys):
    argv = ["bench", *argv] + ([] if "--devices" in argv else ["--devices", "2"])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err[-1]


def test_summary_and_comparison_by_hand():
    s = GenerateSettings(devices=2, batch=2, prompt_len=10, new_tokens=3, iters=2, warmup=1, rounds=1)
    # launch -> ranks -> generate calls -> forward seconds (prefill first); the warm-up call is dropped
    run = {
        "ranks": [
            {"forwards": [[9.0, 9.0, 9.0], [0.2, 0.01, 0.03], [0.4, 0.02, 0.02]], "tokens": [[1, 2, 3]]},
            {"forwards": [[9.0, 9.0, 9.0], [0.1, 0.02, 0.01], [0.5, 0.01, 0.01]], "tokens": [[4, 5, 6]]},
        ]
    }
    got = _summarise([run], s)
    assert got["prefill_s_runs"] == [0.2, 0.5]  # the slowest rank of each prefill
    assert got["prefill_s"] == pytest.approx(0.35)
    assert got["prefill_tokens_per_s"] == pytest.approx(2 * 2 * 10 / 0.35)
    assert got["decode_ms_per_token"] == pytest.approx(1000 * 0.02)  # slowest ranks: 0.02 0.03 0.02 0.02
    rows = [
        {"contender": "occult_ep", "ours": True, "checkpoint": "placed", "measured": True, **got},
        {
            "contender": "occult_ep_per_expert",
            "ours": False,
            "checkpoint": "placed",
            "measured": True,
            **got,
            "prefill_tokens_per_s": got["prefill_tokens_per_s"] / 2,
            "decode_ms_per_token": 50.0,
        },
        {
            "contender": "occult_ep_budget1",
            "ours": True,
            "checkpoint": "budget1",
            "max_devices_per_token": 1,
            "measured": True,
            **got,
            "tokens": [[0]],
        },
        {
            "contender": "hf_native_ep",
            "ours": False,
            "checkpoint": "original",
            "measured": False,
            "reason": "x",
        },
    ]
    _compare(rows)
    assert rows[0]["prefill_vs_per_expert"] == pytest.approx(2.0)
    assert rows[0]["decode_vs_per_expert"] == pytest.approx(50.0 / 20.0)
    assert rows[0]["tokens_match"] and rows[1]["tokens_match"] and rows[1]["same_tokens_as"] == "occult_ep"
    assert "tokens_match" not in rows[2]  # a pruned checkpoint routes otherwise
    text = format_generate_report(
        {
            "settings": vars(s),
            "model": "m",
            "device": "cpu",
            "network": "n",
            "contenders": rows,
            "notes": ["noted"],
        }
    )
    assert "occult_ep_budget1" in text and "not measured: x" in text and "note: noted" in text


@pytest.mark.slow
def test_generate_bench_runs_every_contender_and_tokens_agree(tmp_path):
    report = run_generate_bench(GenerateSettings(**SMALL), workdir=str(tmp_path))
    json.dumps(report)  # the --json output
    rows = {r["contender"]: r for r in report["contenders"]}
    assert list(rows) == default_contenders(GenerateSettings(**SMALL))
    for name, row in rows.items():
        assert row["measured"], (name, row.get("reason"))
        assert row["prefill_tokens_per_s"] > 0 and row["decode_ms_per_token"] > 0
        assert len(row["tokens"]) == SMALL["batch"] and all(
            len(t) == SMALL["new_tokens"] for t in row["tokens"]
        )
        assert row["prefill_vs_per_expert"] > 0 and row["decode_vs_per_expert"] > 0
    for name in ("occult_ep", "occult_ep_per_expert", "hf_native_ep"):  # the same routing: the same tokens
        assert rows[name]["tokens_match"] is True, name
    assert "tokens_match" not in rows["occult_ep_budget1"]
    assert rows["occult_ep"]["syncs_per_decode_layer"] == 0  # decode on the capacity-bounded exchange
    assert rows["occult_ep_per_expert"]["syncs_per_decode_layer"] >= 1
    assert report["network"] == "the host's loopback (unshaped)"
    assert "occult_ep_budget1" in format_generate_report(report)
