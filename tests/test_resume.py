"""Resume is exact at every layout: same step count, same losses, same final weights.

Two real gloo processes under torchrun, data parallel (expert_parallel_size 1) and expert parallel
(expert_parallel_size 2), run 13 steps over 10-step epochs (so the run crosses an epoch boundary) with
checkpoints at 6, 12 and 13. Two resumed runs, each in a fresh output directory, must end where the
uninterrupted one ends: one from checkpoint-6 (mid-epoch, mid-run) and one from checkpoint-13, the
checkpoint at max_steps that a job killed before its final save leaves behind; from it, Trainer itself
would take a 14th step and write checkpoint-14 (a run of 60 steps resumed at 60 logged "step 61 of 60").

The workers are `tests/test_expert_parallel.py`'s (`launch`, `train_case`)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

try:
    from .test_expert_parallel import launch, torchrun
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from test_expert_parallel import launch, torchrun

MAX_STEPS = 13  # NUM_ROWS / GLOBAL_BATCH = 10 steps per epoch: the run ends 3 steps into epoch 2
SAVE = dict(save_strategy="steps", save_steps=6)


def _runs(tiny_olmoe_dir, tmp, ep: int) -> dict:
    straight = tmp / "straight"
    common = dict(expert_parallel_size=ep, max_steps=MAX_STEPS, **SAVE)
    cases = [
        dict(name="straight", overrides=common, save=str(tmp / "final-straight")),
        dict(
            name="mid", overrides=common, resume=str(straight / "checkpoint-6"), save=str(tmp / "final-mid")
        ),
        dict(
            name="end",
            overrides=common,
            resume=str(straight / f"checkpoint-{MAX_STEPS}"),
            save=str(tmp / "final-end"),
        ),
    ]
    results = launch(torchrun(2), dict(model=tiny_olmoe_dir, out=str(tmp), world=2, cases=cases), tmp)
    for name in ("straight", "mid", "end"):
        assert "error" not in results[name], results[name].get("trace")
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=["data-parallel", "expert-parallel-2"])
def runs(request, tiny_olmoe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"resume-ep{request.param}")
    return tmp, _runs(tiny_olmoe_dir, tmp, request.param)


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def _checkpoints(path) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(path) if n.startswith("checkpoint-"))


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_ends_at_the_same_step_losses_and_weights(runs):
    tmp, results = runs
    straight, mid = results["straight"], results["mid"]
    assert straight["steps"] == list(range(1, MAX_STEPS + 1))
    assert (
        mid["steps"][-(MAX_STEPS - 6) :] == list(range(7, MAX_STEPS + 1)) and max(mid["steps"]) == MAX_STEPS
    )
    assert mid["losses"][-(MAX_STEPS - 6) :] == pytest.approx(straight["losses"][6:], rel=1e-6)
    assert _checkpoints(tmp / "mid") == [12, MAX_STEPS]
    ours, theirs = _weights(tmp / "final-mid"), _weights(tmp / "final-straight")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_run_resumed_from_its_last_checkpoint_takes_no_step_past_max_steps(runs):
    tmp, results = runs
    end = results["end"]
    assert max(end["steps"]) == MAX_STEPS  # no step 14
    assert not (tmp / "end").exists() or _checkpoints(tmp / "end") == []  # no checkpoint-14
    ours, theirs = _weights(tmp / "final-end"), _weights(tmp / "final-straight")
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    state = json.loads((tmp / "straight" / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == MAX_STEPS
