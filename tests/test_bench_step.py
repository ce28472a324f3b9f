"""The train-step benchmark (`occult_ft.bench.step`, benchmarks/train_step.py, `occult-ft bench --train`):
contender names, settings checks, the aggregation worked by hand, the cost model of the step, the text
and the figure, and one real run of every contender on 2 gloo processes on a tiny model (no timing is
asserted: the run must finish, and occult_ft's and transformers' expert parallelism must reproduce data
parallel's losses).

Shape legend: D processes, E experts, K top-k.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from occult_ft.bench.costmodel import get_cluster, predict_exchange_ms, rows_matrix
from occult_ft.bench.launch import failure_reason
from occult_ft.bench.step import (
    BALANCED_BIAS_RATE,
    Contender,
    StepSettings,
    _cost_model,
    contender_spec,
    run_train_step,
)
from occult_ft.bench.step_report import (
    compare_contenders,
    format_step_report,
    summarise_contender,
    waiting_by_rank,
)
from occult_ft.cli import main

TINY = dict(
    hidden=32,
    layers=2,
    experts=8,
    top_k=2,
    expert_width=16,
    heads=2,
    vocab=128,
    seq_len=16,
    micro_batch_tokens=64,
)


def test_contender_names_say_what_runs():
    s = StepSettings(**TINY, devices=2)
    assert contender_spec("occult_ep", s) == {
        "name": "occult_ep",
        "kind": "occult_ep",
        "exchange": "flat",
        "ours": True,
    }
    spec = contender_spec("occult_ep_per_expert_budget1_chunks2", s)
    assert (spec["exchange"], spec["max_devices_per_token"], spec["chunks"], spec["ours"]) == (
        "per_expert",
        1,
        2,
        False,
    )
    assert contender_spec("occult_ep_capacity", s)["capacity"] == "auto"
    assert contender_spec("deepspeed_moe", s) == {
        "name": "deepspeed_moe",
        "kind": "deepspeed_moe",
        "ours": False,
    }
    with pytest.raises(ValueError, match="unknown contender 'tutel'"):
        contender_spec("tutel", s)
    with pytest.raises(ValueError, match="needs nodes > 1"):
        contender_spec("occult_ep_two_stage", s)
    # 8 experts on 4 devices: 2 per device; a budget of 1 device holds 2 experts, enough for top-2 only
    with pytest.raises(ValueError, match="a budget of 1 devices holds 2 experts < top_k=4"):
        contender_spec("occult_ep_budget1", StepSettings(**{**TINY, "top_k": 4}, devices=4))
    with pytest.raises(ValueError, match="a budget of 3 devices exceeds devices=2"):
        contender_spec("occult_ep_budget3", s)


def test_a_contender_is_its_fields_and_its_name_spells_them():
    # the suffixes in any order, as the command line takes them; the label keeps the spelling given
    given = Contender.from_name("occult_ep_budget2_per_expert")
    assert given == Contender(exchange="per_expert", budget=2)
    assert (given.name, Contender(exchange="per_expert", budget=2).name) == (
        "occult_ep_budget2_per_expert",
        "occult_ep_per_expert_budget2",
    )
    for name in (
        "occult_ep",
        "occult_ep_two_stage_budget1_chunks4_capacity",
        "data_parallel",
        "hf_native_ep",
    ):
        assert Contender.from_name(name).name == name
        assert Contender.from_name(name) == Contender.from_name(Contender.from_name(name).name)
    assert Contender.from_name("occult_ep_chunks3").spec()["chunks"] == 3
    assert Contender.from_name("occult_ep_budget2_overlap").spec()["overlap"] is True
    assert "overlap" not in Contender.from_name("occult_ep_budget2").spec()
    # _balanced: the device bias at the tiny recipe's rate, fitted on the first micro-batch by the worker
    assert Contender.from_name("occult_ep_budget2_balanced").spec()["device_bias_rate"] == BALANCED_BIAS_RATE
    assert "device_bias_rate" not in Contender.from_name("occult_ep_budget2").spec()
    assert (
        not Contender.from_name("occult_ep_per_expert").ours
        and Contender.from_name("occult_ep_capacity").ours
    )


@pytest.mark.parametrize(
    "name, message",
    [
        ("occult_epx", "unknown contender 'occult_epx'"),
        ("occult_ep_budget", "_budget needs a number"),
        ("occult_ep_chunks2_chunks4", "sets its chunks twice"),
        ("occult_ep_per_expert_two_stage", "sets its exchange twice"),
        ("occult_ep_budget0", "budget=0 must be at least 1"),
        ("occult_ep_chunks0", "chunks=0 must be at least 1"),
    ],
)
def test_contender_name_errors_are_one_line(name, message):
    with pytest.raises(ValueError, match=message):
        Contender.from_name(name)


def test_an_overlap_contender_needs_an_exact_one_stage_exchange():
    settings = StepSettings(**{**TINY, "devices": 2, "nodes": 2})
    assert Contender.from_name("occult_ep_per_expert_overlap").check(settings).overlap
    for name in ("occult_ep_two_stage_overlap", "occult_ep_overlap_capacity"):
        with pytest.raises(ValueError, match=f"{name}: _overlap runs the exact flat and per_expert"):
            Contender.from_name(name).check(settings)


def test_a_shared_contender_needs_a_shared_mlp_and_an_exact_one_stage_exchange():
    shared = StepSettings(**{**TINY, "devices": 2, "nodes": 2, "shared_experts": 8})
    spec = contender_spec("occult_ep_budget1_shared", shared)
    assert spec["overlap_shared"] is True and spec["max_devices_per_token"] == 1
    assert "overlap_shared" not in contender_spec("occult_ep", shared)
    with pytest.raises(ValueError, match="the model has none: pass --shared-experts N"):
        contender_spec("occult_ep_shared", StepSettings(**TINY, devices=2))
    for name in ("occult_ep_two_stage_shared", "occult_ep_shared_capacity"):
        with pytest.raises(ValueError, match=f"{name}: _shared runs the exact flat and per_expert"):
            contender_spec(name, shared)
    for name in ("hf_native_ep", "deepspeed_moe"):  # built for the OLMoE block
        with pytest.raises(ValueError, match=f"{name} is built for the OLMoE block"):
            contender_spec(name, shared)
    assert contender_spec("data_parallel", shared)["kind"] == "data_parallel"


def test_contender_fields_are_checked():
    with pytest.raises(ValueError, match="kind='tutel'"):
        Contender(kind="tutel")
    with pytest.raises(
        ValueError,
        match="deepspeed_moe takes no exchange, budget, chunks, overlap, shared, capacity, embedding_ddp or balancing",
    ):
        Contender(kind="deepspeed_moe", budget=2)
    # `_embedding_ddp`: the input embedding's gradient left to DDP (the default reduces it apart)
    spec = contender_spec("occult_ep_budget2_embedding_ddp", StepSettings(**TINY, devices=2))
    assert spec["embedding_gradient_overlap"] is False and spec["max_devices_per_token"] == 2
    assert "embedding_gradient_overlap" not in contender_spec("occult_ep", StepSettings(**TINY, devices=2))
    assert Contender.from_name("occult_ep_embedding_ddp_budget2").name == "occult_ep_embedding_ddp_budget2"
    assert Contender(budget=2, embedding_ddp=True).name == "occult_ep_budget2_embedding_ddp"
    with pytest.raises(ValueError, match="the device bias balances a budget; add _budget2"):
        Contender.from_name("occult_ep_balanced")
    with pytest.raises(ValueError, match="exchange='ring'"):
        Contender(exchange="ring")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(devices=3), "devices=3 must divide the 8 experts"),
        (dict(micro_batch_tokens=48), "micro_batch_tokens=48 must be a multiple of devices x seq_len = 32"),
        (dict(heads=3), "heads=3 must divide hidden=32"),
        (dict(top_k=9), "top_k=9 exceeds experts=8"),
        (dict(devices=1), "devices=1 must be at least 2"),
        (dict(shared_experts=-1), "shared_experts=-1 must be a count >= 0"),
        (
            dict(shared_experts=8, model="embedded"),
            "shared_experts=8 shapes the random model; the embedded model",
        ),
    ],
)
def test_settings_errors_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        StepSettings(**{**TINY, "devices": 2, **overrides})


def _run(seconds_by_rank, phases, losses, peak=100.0):
    """A fake launch: per rank, per step records."""
    ranks = []
    for r, seconds in enumerate(seconds_by_rank):
        records = [{"seconds": s, "phases": phases} for s in seconds]
        ranks.append({"records": records, "losses": losses, "peak_mb": peak + r, "syncs": 1.0})
    return {"ranks": ranks}


def test_summary_takes_the_slowest_rank_per_step_and_the_median_over_rounds():
    s = StepSettings(**TINY, devices=2, warmup=1, steps=2, grad_accum=3)
    phases = {"forward": 0.4, "moe_block": 0.25, "router": 0.05, "exchange_fwd": 0.1, "optimizer": 0.1}
    # round 1: steps (warm-up 9.0), 1.0, 2.0 on rank 0 and 1.5, 1.0 on rank 1 -> slowest 1.5, 2.0
    # round 2: 3.0, 1.0 / 1.0, 1.2 -> 3.0, 1.2; median of [1.5, 2.0, 3.0, 1.2] = 1.75
    runs = [
        _run([[9.0, 1.0, 2.0], [9.0, 1.5, 1.0]], phases, [5.0, 4.0, 3.0]),
        _run([[9.0, 3.0, 1.0], [9.0, 1.0, 1.2]], phases, [5.0, 4.0, 3.0]),
    ]
    row = summarise_contender("occult_ep", runs, s.warmup, s.tokens_per_step)
    # an optimizer step trains 3 micro-batches of 64 tokens
    assert row["step_s"] == pytest.approx(1.75) and row["tokens_per_s"] == pytest.approx(3 * 64 / 1.75)
    assert row["step_s_runs"] == [1.5, 2.0, 3.0, 1.2]
    p = row["phases_ms"]
    assert p["attention_dense"] == pytest.approx(150.0)  # forward 400 - MoE blocks 250
    assert p["local_experts_fwd"] == pytest.approx(100.0)  # 250 - router 50 - exchange 100
    # backward + rest = step - forward - optimizer, mean over the 8 (rank, step) records
    mean_step = (1.0 + 2.0 + 1.5 + 1.0 + 3.0 + 1.0 + 1.0 + 1.2) / 8
    assert p["backward_rest"] == pytest.approx(1000.0 * (mean_step - 0.5))
    assert row["peak_mb"] == 101.0  # the larger of the ranks


def test_summary_keeps_the_logged_routing_of_the_timed_steps_only():
    s = StepSettings(**TINY, devices=2, warmup=1, steps=2, grad_accum=1)
    runs = [_run([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], {}, [5.0, 4.0, 3.0]) for _ in range(2)]
    for run, values in zip(runs, ([9.0, 1.2, 1.4], [9.0, 1.6, 1.8])):  # 9.0: the warm-up step
        for record, value in zip(run["ranks"][0]["records"], values):
            record["routing"] = {"load_imbalance": value, "comm_complexity": value + 1}
    row = summarise_contender("occult_ep", runs, s.warmup, s.tokens_per_step)
    assert row["load_imbalance"] == pytest.approx(1.5) and row["comm_complexity"] == pytest.approx(2.5)
    assert "load_imbalance" not in summarise_contender(
        "data_parallel", [_run([[1.0, 1.0]], {}, [5.0])], s.warmup, s.tokens_per_step
    )

    # one step, two ranks, world group: collective 0 issued at t=1.0 (rank 0) and t=1.5 (rank 1);
    # rank 0 blocked 1.0-1.7 -> waited 0.5 (until 1.5), transfer 0.2; rank 1 blocked 1.5-1.7 -> 0.
    # collective 1 is asynchronous: rank 0 issued at 2.0 and waited on its handle over 2.4-2.6; rank 1
    # issued at 2.5 -> rank 0 waited 0.1 of its 0.2 blocked (2.4-2.5); rank 1 blocked 3.0-3.1 -> 0.
    # a node group "0" of rank 0 alone never waits for anyone.
    rank0 = [
        ["world", 0, 1.0, [[1.0, 1.7]]],
        ["world", 1, 2.0, [[2.0, 2.0], [2.4, 2.6]]],
        ["0", 0, 4.0, [[4.0, 4.3]]],
    ]
    rank1 = [["world", 0, 1.5, [[1.5, 1.7]]], ["world", 1, 2.5, [[2.5, 2.5], [3.0, 3.1]]]]
    assert waiting_by_rank([rank0, rank1]) == pytest.approx([0.6, 0.0])


def test_the_step_split_adds_up_to_the_step():
    s = StepSettings(**TINY, devices=2, warmup=0, steps=1, grad_accum=1)
    phases = {"exchange_fwd": 0.3, "exchange_bwd": 0.2, "dense_allreduce": 0.15, "other_collectives": 0.05}
    events = [["world", 0, 0.0, [[0.0, 0.3]]]]
    late = [["world", 0, 0.1, [[0.1, 0.3]]]]  # rank 1 issued 0.1 s later: rank 0 waited 0.1 s
    runs = [
        {
            "ranks": [
                {
                    "records": [{"seconds": 2.0, "phases": phases, "events": ev}],
                    "losses": [1.0],
                    "peak_mb": 1.0,
                    "syncs": 1.0,
                }
                for ev in (events, late)
            ]
        }
    ]
    row = summarise_contender("occult_ep", runs, s.warmup, s.tokens_per_step)
    split = row["split_ms"]
    # blocked 500 ms per rank; rank 0 waited 100 -> mean waiting 50, exposed 450
    assert split["waiting"] == pytest.approx(50.0) and split["exposed_exchange"] == pytest.approx(450.0)
    assert split["dense_allreduce"] == pytest.approx(150.0) and split["other_collectives"] == pytest.approx(
        50.0
    )
    assert split["compute"] == pytest.approx(2000.0 - 700.0) and sum(split.values()) == pytest.approx(2000.0)
    assert row["exchange_share"] == pytest.approx(0.25)  # (450 + 50) / 2000


def test_comparison_with_the_best_other_contender_and_data_parallel():
    rows = [
        {
            "contender": "data_parallel",
            "measured": True,
            "ours": False,
            "tokens_per_s": 100.0,
            "peak_mb": 200.0,
            "losses": [5.0, 4.0],
        },
        {
            "contender": "deepspeed_moe",
            "measured": True,
            "ours": False,
            "tokens_per_s": 120.0,
            "peak_mb": 100.0,
            "losses": [5.0, 4.1],
        },
        {
            "contender": "occult_ep",
            "measured": True,
            "ours": True,
            "tokens_per_s": 150.0,
            "peak_mb": 50.0,
            "losses": [5.0, 4.0],
        },
        {"contender": "hf_native_ep", "measured": False, "ours": False, "reason": "x"},
    ]
    compare_contenders(rows)
    assert rows[2]["vs_best_other"] == pytest.approx(1.25) and rows[2]["best_other"] == "deepspeed_moe"
    assert rows[2]["peak_vs_dp"] == pytest.approx(0.25)
    assert rows[1]["loss_vs_dp"]["max"] == pytest.approx(0.1) and rows[1]["loss_vs_dp"]["first_step"] == 0.0


def test_cost_model_prices_the_step_from_the_routing():
    s = StepSettings(**{**TINY, "experts": 32, "top_k": 4}, devices=2)
    gen = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(64 * 16, 32, generator=gen), -1)
    routing = [(scores, scores.topk(4, -1).indices)] * 2  # two layers
    shape = get_cluster("4x8-ib")
    out = _cost_model(routing, s, ["4x8-ib"])["clusters"][0]
    got = out["same_global_batch"]["exchange_ms_per_step"]
    dev_E = torch.arange(32)  # 32 experts on 32 devices: one each
    for kind, dedup in (("per_expert", False), ("dedup", True)):
        rows = rows_matrix(routing[0][1][:64], dev_E, 32, dedup=dedup)
        # two layers, forward and backward each
        assert got[kind] == pytest.approx(2 * 2 * predict_exchange_ms(rows, 4 * 32, shape))
    assert got["dedup"] <= got["per_expert"] and "two_stage" in got
    # 1 expert per device holds no top-4 under a budget below 4 devices: only budgets 4 and 8 are priced
    assert {k for k in got if "budget" in k} == {"dedup_budget4", "dedup_budget8"}
    assert out["same_tokens_per_device"]["tokens"] == 64 * 16  # 32 devices x 32 tokens each


def test_the_report_reads_as_a_table_and_draws(tmp_path):
    s = StepSettings(**TINY, devices=2, warmup=0, steps=1)
    phases = {"forward": 0.4, "moe_block": 0.2, "optimizer": 0.1}
    rows = [
        {
            **summarise_contender(
                "data_parallel", [_run([[1.0], [1.0]], phases, [5.0])], s.warmup, s.tokens_per_step
            ),
            "measured": True,
            "ours": False,
        },
        {
            **summarise_contender(
                "occult_ep", [_run([[0.5], [0.5]], phases, [5.0])], s.warmup, s.tokens_per_step
            ),
            "measured": True,
            "ours": True,
        },
        {"contender": "hf_native_ep", "measured": False, "reason": "ImportError: no", "ours": False},
    ]
    compare_contenders(rows)
    report = {
        "settings": vars(s) | {"hidden": 32},
        "device": "cpu",
        "tokens_per_step": s.tokens_per_step,
        "contenders": rows,
        "cost_model": {"clusters": [{"name": "4x8-ib", "skipped": "too small"}]},
        "notes": ["a note"],
    }
    text = format_step_report(report)
    assert "occult_ep" in text and "2.00x" in text and "not measured: ImportError: no" in text
    # without data parallel (e.g. `--contenders occult_ep,occult_ep_chunks2`) there is no loss to compare
    alone = [
        {
            **summarise_contender(n, [_run([[0.5], [0.5]], phases, [5.0])], s.warmup, s.tokens_per_step),
            "measured": True,
            "ours": True,
        }
        for n in ("occult_ep", "occult_ep_chunks2")
    ]
    compare_contenders(alone)
    text = format_step_report(report | {"contenders": alone})
    assert "occult_ep_chunks2" in text and "e-" not in text.split("phases")[0]
    from occult_ft.plots import plot_train_step

    plot_train_step(report, tmp_path / "step.png")
    assert (tmp_path / "step.png").stat().st_size > 0


def test_cli_train_refuses_a_model():
    assert main(["bench", "--train", "some/model", "--devices", "2"]) == 2


def _log_tails(reasons) -> str:
    """The last lines of the logs a failure reason points at ("... (log PATH)"), for the assertion."""
    tails = []
    for reason in reasons:
        m = re.search(r"\(logs? (?:in )?(\S+?)\)$", reason)
        if m and os.path.isfile(m.group(1)):
            with open(m.group(1), errors="replace") as f:
                tails.append(f"--- {m.group(1)}\n" + "".join(f.readlines()[-40:]))
    return "\n".join(tails)


@pytest.mark.parametrize(
    "log, want",
    [
        ("[rank1]: Traceback\n[rank1]:   x\n[rank1]: ValueError: bad rows\ntorch...ChildFailedError: y\n===\n",
         "ValueError: bad rows"),
        ("ok\n  exitcode  : -9 (pid: 12)\n  traceback : Signal 9 (SIGKILL) received by PID 12\n======\n",
         "a rank died: Signal 9 (SIGKILL) received by PID 12"),
        ("ok\n  exitcode  : 3 (pid: 12)\n  traceback : To enable traceback see: ...\n======\n",
         "a rank exited with status 3"),
        ("just a line\n", "just a line"),
    ],
)  # fmt: skip
def test_a_failed_launch_says_why(tmp_path, log, want):
    (tmp_path / "log.txt").write_text(log)
    assert failure_reason(str(tmp_path)) == want


def test_a_failed_launch_without_logs_gives_the_fallback(tmp_path):
    assert failure_reason(str(tmp_path), "nothing written") == "nothing written"


@pytest.mark.slow
def test_every_contender_trains_and_ep_reproduces_data_parallel(tmp_path):
    # two micro-batches per step: every contender accumulates them the same way
    s = StepSettings(**TINY, devices=2, warmup=0, steps=2, rounds=1, device="cpu", grad_accum=2)
    names = [
        "data_parallel",
        "occult_ep",
        "occult_ep_per_expert",
        "occult_ep_chunks2",
        "occult_ep_budget1_balanced",
        "hf_native_ep",
        "deepspeed_moe",
    ]
    report = run_train_step(s, names, clusters=(), workdir=str(tmp_path))
    rows = {r["contender"]: r for r in report["contenders"]}
    failed = {n: r["reason"] for n, r in rows.items() if not r["measured"]}
    assert not failed, (failed, _log_tails(failed.values()))
    # same weights, data and gate convention: every expert-parallel contender trains data parallel's steps
    for name in ("occult_ep", "occult_ep_per_expert", "occult_ep_chunks2", "hf_native_ep", "deepspeed_moe"):
        got, want = rows[name]["losses"], rows["data_parallel"]["losses"]
        assert rows[name]["loss_vs_dp"]["max"] < 1e-5, (name, got, want)
    assert rows["occult_ep"]["syncs_per_layer"] == 1.0  # the count exchange, nothing else
    # the routing OccultTrainer logged: one device per token at budget 1, more without a budget
    balanced = rows["occult_ep_budget1_balanced"]
    assert balanced["comm_complexity"] == pytest.approx(1.0) and balanced["load_imbalance"] >= 1.0
    assert rows["occult_ep"]["comm_complexity"] > 1.0 and "load_imbalance" not in rows["hf_native_ep"]
    for row in rows.values():
        assert len(row["step_s_runs"]) == 2 and row["tokens_per_s"] > 0 and row["peak_mb"] > 0


@pytest.mark.slow
def test_the_shared_mlp_model_trains_alike_with_the_overlap(tmp_path):
    """`--shared-experts`: the DeepSeek-V3-shaped random model; occult_ep with its shared MLP beside the
    combine trains the steps of occult_ep without (two launches; against one process in
    tests/test_shared_beside.py)."""
    s = StepSettings(
        **TINY, shared_experts=1, devices=2, warmup=0, steps=2, rounds=1, device="cpu", grad_accum=2
    )
    report = run_train_step(s, ["occult_ep", "occult_ep_shared"], clusters=(), workdir=str(tmp_path))
    rows = {r["contender"]: r for r in report["contenders"]}
    failed = {n: r["reason"] for n, r in rows.items() if not r["measured"]}
    assert not failed, (failed, _log_tails(failed.values()))
    assert rows["occult_ep_shared"]["losses"] == pytest.approx(rows["occult_ep"]["losses"], rel=1e-5)
    assert len(rows["occult_ep"]["losses"]) >= s.steps and rows["occult_ep"]["ours"]


def _clock_worker(rank: int, world: int) -> dict:
    import time

    import torch.distributed as dist

    from occult_ft.bench.step_worker import PhaseClock

    clock = PhaseClock(torch.nn.Linear(2, 2))
    try:
        if rank == 1:
            time.sleep(0.5)  # rank 0 issues the exchange 0.5 s earlier and waits for rank 1
        out = torch.empty(4)
        dist.all_to_all_single(out, torch.ones(4))

        def backward():  # a gradient reduction inside backward, asynchronous like DDP's buckets
            work = dist.all_reduce(torch.ones(3), async_op=True)
            time.sleep(0.05)
            work.wait()

        clock.timed_backward(backward)()
        dist.all_reduce(torch.ones(1))  # outside backward: another collective
        return {"times": clock.snapshot(), "events": clock.events()}
    finally:
        clock.close()


@pytest.mark.slow
def test_the_clock_tells_waiting_dense_reductions_and_other_collectives_apart():
    from dist_utils import run_distributed

    got = run_distributed(_clock_worker, 2)
    waited = waiting_by_rank([g["events"] for g in got])
    assert waited[0] > 0.3 and waited[1] < 0.1  # rank 0 sat in the all-to-all while rank 1 slept
    for g in got:
        (event,) = g["events"]
        assert event[0] == "world" and event[1] == 0
        assert g["times"]["exchange_fwd"] >= waited[0] * (g is got[0])
        assert g["times"]["dense_allreduce"] > 0 and g["times"]["other_collectives"] > 0


def test_a_contender_named_twice_is_refused_before_any_launch():
    s = StepSettings(**TINY, devices=2)
    with pytest.raises(ValueError, match="contender 'occult_ep' is named twice"):
        run_train_step(s, ["occult_ep", Contender()])


def test_the_random_model_and_rows_are_the_seeds():
    """`random_model` / `random_rows` (what `--train` saves, and benchmarks/per_batch_balance.py rebuilds):
    the same settings give the same weights and tokens, another seed other ones."""
    from occult_ft.bench.step import random_model, random_rows

    settings = StepSettings(**{**TINY, "seed": 3})
    a, b = random_model(settings).state_dict(), random_model(settings).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = random_model(StepSettings(**{**TINY, "seed": 4})).state_dict()
    assert not all(torch.equal(a[k], other[k]) for k in a)
    shared = random_model(StepSettings(**{**TINY, "shared_experts": 2}))  # DeepSeek-V3-shaped
    assert shared.config.model_type == "deepseek_v3" and shared.config.first_k_dense_replace == 0
    # two shared experts of the routed ones' width, as one MLP
    assert shared.model.layers[0].mlp.shared_experts.gate_proj.out_features == 2 * TINY["expert_width"]
    rows = random_rows(settings, 5)
    assert rows.shape == (5, settings.seq_len) and torch.equal(rows, random_rows(settings, 5))
    assert int(rows.min()) >= 2 and int(rows.max()) < settings.vocab  # 0 and 1 are pad and eos
