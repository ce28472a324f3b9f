"""The exchange settings of a training run: `exchange` (flat, two_stage, per_expert), `exchange_chunks`
(pipelined chunks), `exchange_overlap_local` (own rows computed beside the exchange) and
`exchange_capacity` (capacity-bounded receive buffers), checked as config fields and, on 2 gloo
processes under torchrun, as training runs that must reproduce the single-process run step for step
(losses and gradient norms within 1e-3, the harness of tests/test_expert_parallel.py).

Shape legend: W processes, D expert-parallel size.
"""

from __future__ import annotations

import pytest
from test_expert_parallel import (  # tests/ is not a package: pytest puts it on sys.path
    PRUNING,
    check_trajectory,
    launch,
    run_config,
    single_process_references,
    torchrun,
)


# ---- the config fields ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(exchange="per-expert"), "exchange='per-expert' is unknown (did you mean 'per_expert'?)"),
        (dict(exchange="two_stage"), "exchange='two_stage' needs nodes > 1"),
        (dict(exchange_chunks=0), "exchange_chunks=0 must be a positive integer"),
        (dict(exchange="two_stage", nodes=2, exchange_chunks=2), "use 1 with two_stage"),
        (dict(exchange="per_expert", exchange_capacity="auto"), "exchange='per_expert' is exact only"),
        (
            dict(exchange_capacity="lots"),
            "exchange_capacity='lots' must be a number of rows per device or 'auto'",
        ),
        (dict(exchange_capacity=0), "exchange_capacity=0 must be a positive number of rows"),
        (dict(exchange_capacity=64, exchange_chunks=2), "use exchange_chunks=1"),
        (
            dict(exchange="two_stage", nodes=2, exchange_overlap_local=True),
            "exchange='two_stage', capacity=None); use overlap_local=False",
        ),
        (dict(exchange_capacity=64, exchange_overlap_local=True), "capacity=64); use overlap_local=False"),
    ],
)
def test_exchange_settings_the_kernel_cannot_run_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError) as err:
        run_config(str(tmp_path), 1, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_auto_capacity_is_the_most_tokens_a_rank_routes(tmp_path):
    cfg = run_config(
        str(tmp_path),
        1,
        exchange_capacity="auto",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=6,
    )
    assert cfg.exchange_capacity_rows() == 6 * cfg.seq_len  # the eval batch is the larger one
    assert run_config(str(tmp_path), 1, exchange_capacity="200").exchange_capacity_rows() == 200
    assert run_config(str(tmp_path), 1).exchange_capacity_rows() is None


@pytest.mark.parametrize(
    "overrides, chunks",
    [
        (dict(nodes=2), 2),  # the flat exact exchange across nodes pipelines by default
        (dict(), 1),  # inside one node it does not
        (dict(nodes=2, max_devices_per_token=1), 1),  # nor under a budget
        (dict(nodes=2, max_nodes_per_token=1), 1),
        (dict(exchange="per_expert", nodes=2), 1),  # the others' way: one all-to-all per layer
        (dict(exchange="two_stage", nodes=2), 1),
        (dict(nodes=2, exchange_capacity="auto"), 1),
        (dict(nodes=2, exchange_capacity=128), 1),
        (dict(nodes=2, exchange_chunks=1), 1),  # a value given is kept
        (dict(exchange_chunks=3), 3),
    ],
)
def test_unset_exchange_chunks_pipeline_the_flat_exchange_across_nodes_without_a_budget_only(
    tmp_path, overrides, chunks
):
    from occult_ft.dispatch import PIPELINE_CHUNKS, default_exchange_chunks

    assert run_config(str(tmp_path), 1, **overrides).exchange_chunks == chunks
    assert default_exchange_chunks("flat", 4, None, budget=False) == PIPELINE_CHUNKS == 2


def test_a_capacity_below_the_tokens_a_rank_routes_is_refused_whatever_the_layout(tmp_path, capsys):
    """exchange_capacity C must reach the tokens a rank routes in one forward, max(train batch, eval
    batch) x seq_len (the bound `auto` takes): checked when the config is built, with expert parallelism
    off too, so a recipe that passes on one process does not fail at the first step of a launch."""
    from occult_ft.cli import main

    # run_config: one process, train batch 8, eval batch 8 (default), seq_len 16: 8 x 16 = 128 tokens
    for overrides in (dict(), dict(expert_parallel_size=1, devices=4)):
        with pytest.raises(
            ValueError, match="exchange_capacity=127 rows per device is below the 128 tokens"
        ) as err:
            run_config(str(tmp_path), 1, exchange_capacity=127, **overrides)
        assert "set it to at least 128, 'auto'" in str(err.value) and "\n" not in str(err.value)
    assert run_config(str(tmp_path), 1, exchange_capacity=128).exchange_capacity_rows() == 128
    # the larger of the two batch sizes counts: an eval batch of 16 raises the bound to 256
    with pytest.raises(ValueError, match="below the 256 tokens .*per_device_eval_batch_size=16"):
        run_config(str(tmp_path), 1, exchange_capacity=128, per_device_eval_batch_size=16)
    # through the CLI, as a user meets it: one line, before any model or data is read
    code = main(
        ["train", "--exchange_capacity", "1", "--dataset", "embedded", "--output_dir", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines()[-1].startswith(
        "occult-ft train: error: exchange_capacity=1 rows"
    ), err
    assert "loading" not in err and not (tmp_path / "o").exists()


# ---- training runs ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_olmoe_dir, tmp_path_factory):
    return single_process_references(tiny_olmoe_dir, tmp_path_factory.mktemp("single"), devices=(2,))


@pytest.fixture(scope="module")
def exchanges_world2(tiny_olmoe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exchanges")
    ep = dict(expert_parallel_size=2)
    pruned = PRUNING["pruned"]  # budget 1 and the device bias fitted on the first batch, as the reference
    cases = [
        dict(name="per_expert-plain", overrides=dict(ep, exchange="per_expert")),
        dict(name="per_expert-pruned", overrides=dict(ep, exchange="per_expert", **pruned)),
        dict(name="chunks-plain", overrides=dict(ep, exchange_chunks=3)),
        dict(
            name="chunks-pruned",
            overrides=dict(ep, exchange="per_expert", exchange_chunks=2, **pruned),
        ),
        dict(name="overlap-plain", overrides=dict(ep, exchange_overlap_local=True)),
        dict(
            name="overlap-pruned",
            overrides=dict(ep, exchange="per_expert", exchange_overlap_local=True, **pruned),
        ),
        dict(name="capacity-plain", overrides=dict(ep, exchange_capacity="auto")),
        dict(name="capacity-pruned", overrides=dict(ep, exchange_capacity="auto", **pruned)),
    ]
    return launch(
        torchrun(2), dict(model=tiny_olmoe_dir, out=str(tmp), world=2, cases=cases), tmp, timeout=600
    )


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["per_expert", "chunks", "overlap", "capacity"])
@pytest.mark.parametrize("pruning", ["plain", "pruned"])
def test_every_exchange_trains_like_the_single_process_run(exchanges_world2, reference, exchange, pruning):
    name = f"{exchange}-{pruning}"
    result = exchanges_world2[name]
    check_trajectory(result, reference[(pruning, 2)], name)
    kind, chunks, capacity = result["exchange"]  # what the kernel of the trained model ran
    pruned_per_expert = name in ("chunks-pruned", "overlap-pruned")
    assert kind == ("per_expert" if exchange == "per_expert" or pruned_per_expert else "flat")
    assert result["overlap_local"] == (exchange == "overlap")
    assert chunks == {"chunks-plain": 3, "chunks-pruned": 2}.get(name, 1)
    # auto: max(per-device train batch 4, eval batch 8 (the default)) x seq_len 16 tokens per rank
    assert capacity == (8 * 16 if exchange == "capacity" else None)
