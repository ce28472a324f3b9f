"""Expert parallelism under a DeepSpeed engine (ZeRO 0/1/2, CPU, gloo, fp32) against one process.

The worker, the data and the single-process oracle are those of `test_expert_parallel.py`; here the
runs carry a DeepSpeed config whose batch sizes, accumulation and clipping are "auto" (filled from the
OccultConfig by the HF integration). The engine reduces the expert shards over the expert-data-parallel
group and divides by W like every other gradient, which is exactly the single-process gradient, so
the losses and gradient norms of 10 steps must match the single process within 1e-3.

Launches (each runs all its cases in the same processes):
    W=2 `deepspeed` launcher, D=2: ZeRO-1 (saved); ZeRO-2 pruned; ZeRO-0 (unclipped: its clipping is
        DeepSpeed's mean of per-rank norms, not exact); ZeRO-2 with the optimizer
        built by DeepSpeed from its config; ZeRO-2 with 2 accumulated micro-batches; ZeRO-2 resume
        (4 steps + checkpoint, then 4 more)
    W=4 torchrun, D=2 (two replicas of each shard): ZeRO-1; ZeRO-2 pruned
    LoRA (expert LoRA factors sharded with the experts), W=2 `deepspeed` launcher, D=2, against
        single-process LoRA: ZeRO-1 (saved adapter); ZeRO-2 pruned; ZeRO-2 resume (4 + 4 steps)
The fast tests at the end check the config guards and the optimizer-group split without launching.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from test_expert_parallel import (  # noqa: E402
    LORA,
    PRUNING,
    assert_same_adapter,
    assert_same_trajectory,
    check_trajectory,
    deepspeed_launch,
    launch,
    lora_references,
    single_process_references,
    torchrun,
    train_case,
)

DS_AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


SHIPPED = Path(__file__).resolve().parents[1] / "recipes"


def ds_config(tmp_path, name: str, stage: int, optimizer: bool = False) -> str:
    """ZeRO-1/2 without an optimizer section are the configs shipped with the recipes, as the launch
    lines use them; the others are written here."""
    if stage in (1, 2) and not optimizer:
        return str(SHIPPED / f"ds_zero{stage}.json")
    config = {**DS_AUTO, "zero_optimization": {"stage": stage}}
    if optimizer:  # DeepSpeed builds it (torch AdamW on CPU) and splits the MoE groups itself
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": "auto",
                "betas": "auto",
                "eps": "auto",
                "weight_decay": "auto",
                "torch_adam": True,
            },
        }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_olmoe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    results = single_process_references(tiny_olmoe_dir, out, devices=(2,))
    results["unclipped"] = train_case(
        tiny_olmoe_dir, str(out / "unclipped"), 1, {"devices": 2, "max_grad_norm": 0.0}
    )
    return results


@pytest.fixture(scope="module")
def ds_world2(tiny_olmoe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds2")
    ckpt = str(tmp / "first" / "checkpoint-4")
    z0, z1, z2 = (ds_config(tmp, f"zero{s}", s) for s in (0, 1, 2))
    cases = [
        dict(name="zero1", overrides=dict(expert_parallel_size=2, deepspeed=z1), save=str(tmp / "final")),
        dict(name="zero2-pruned", overrides=dict(expert_parallel_size=2, deepspeed=z2, **PRUNING["pruned"])),
        # stage 0 clips by DeepSpeed's mean of per-rank norms (documented, warned): run it unclipped
        dict(name="zero0", overrides=dict(expert_parallel_size=2, deepspeed=z0, max_grad_norm=0.0)),
        dict(
            name="zero2-ds-optimizer",
            overrides=dict(expert_parallel_size=2, deepspeed=ds_config(tmp, "zero2opt", 2, optimizer=True)),
        ),
        dict(
            name="zero2-accumulated",
            overrides=dict(
                expert_parallel_size=2,
                deepspeed=z2,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=2,
            ),
        ),
        dict(
            name="first",
            overrides=dict(
                expert_parallel_size=2, deepspeed=z2, max_steps=4, save_strategy="steps", save_steps=4
            ),
        ),
        dict(name="resumed", overrides=dict(expert_parallel_size=2, deepspeed=z2, max_steps=8), resume=ckpt),
    ]
    results = launch(deepspeed_launch(2), dict(model=tiny_olmoe_dir, out=str(tmp), world=2, cases=cases), tmp)
    return {**results, "final": str(tmp / "final"), "checkpoint": ckpt}


@pytest.fixture(scope="module")
def ds_world4(tiny_olmoe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds4")
    cases = [
        dict(name="zero1", overrides=dict(expert_parallel_size=2, deepspeed=ds_config(tmp, "zero1", 1))),
        dict(
            name="zero2-pruned",
            overrides=dict(expert_parallel_size=2, deepspeed=ds_config(tmp, "zero2", 2), **PRUNING["pruned"]),
        ),
    ]
    return launch(torchrun(4), dict(model=tiny_olmoe_dir, out=str(tmp), world=4, cases=cases), tmp)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["zero1", "zero2-pruned", "zero0", "zero2-ds-optimizer", "zero2-accumulated"]
)
def test_deepspeed_on_two_processes_reproduces_the_single_process_run(ds_world2, reference, name):
    result = ds_world2[name]
    if name == "zero0":  # run unclipped; the engine reports no gradient norm without ZeRO: losses only
        assert_same_trajectory(result, reference["unclipped"], f"W=2 D=2 {name}")
    else:
        check_trajectory(result, reference[("pruned" if "pruned" in name else "plain", 2)], f"W=2 D=2 {name}")
    assert result["groups"] == {"ep": [0, 1], "edp": [0], "source": "deepspeed"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero1", "zero2-pruned"])
def test_deepspeed_with_two_replicas_of_each_shard_reproduces_the_single_process_run(
    ds_world4, reference, name
):
    result = ds_world4[name]
    check_trajectory(result, reference[("pruned" if "pruned" in name else "plain", 2)], f"W=4 D=2 {name}")
    assert result["groups"] == {"ep": [0, 1], "edp": [0, 2], "source": "deepspeed"}


@pytest.mark.slow
def test_deepspeed_checkpoint_is_a_standard_hf_checkpoint_equal_to_the_single_process_model(
    ds_world2, reference
):
    from transformers import AutoModelForCausalLM

    import occult_ft

    final = ds_world2["final"]
    assert json.load(open(os.path.join(final, "config.json")))["occult"]["num_devices"] == 2
    single = AutoModelForCausalLM.from_pretrained(reference["final"])
    plain = AutoModelForCausalLM.from_pretrained(final)
    assert plain.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    assert set(plain.state_dict()) == set(single.state_dict())  # no trace of the engine's MoE marker
    for key, value in single.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-3, atol=1e-4, msg=key)
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = single.eval()(input_ids=ids).logits
        for model in (plain, occult_ft.from_pretrained(final)):
            torch.testing.assert_close(model.eval()(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_deepspeed_resume_continues_like_the_uninterrupted_run(ds_world2, reference):
    """The engine's model-state file holds rank 0's shards only; every rank's own come from the HF weights."""
    first, resumed, straight = ds_world2["first"], ds_world2["resumed"], reference[("plain", 2)]
    assert "error" not in resumed, resumed.get("trace")
    files = os.listdir(ds_world2["checkpoint"])
    assert "model.safetensors" in files and "global_step4" in files  # HF weights + the engine's ZeRO state
    assert first["losses"] == pytest.approx(straight["losses"][:4], rel=1e-5)
    assert resumed["steps"][-4:] == [5, 6, 7, 8]
    assert resumed["losses"][-4:] == pytest.approx(straight["losses"][4:8], rel=1e-5)
    assert resumed["grad_norm"][-4:] == pytest.approx(straight["grad_norm"][4:8], rel=1e-5)


# ---- LoRA under DeepSpeed -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_reference(tiny_olmoe_dir, tmp_path_factory):
    return lora_references(tiny_olmoe_dir, tmp_path_factory.mktemp("lora-single"))


@pytest.fixture(scope="module")
def lora_ds_world2(tiny_olmoe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-ds2")
    ckpt = str(tmp / "first" / "checkpoint-4")
    z1, z2 = (ds_config(tmp, f"zero{s}", s) for s in (1, 2))
    ep = dict(expert_parallel_size=2, **LORA)
    cases = [
        dict(name="zero1", overrides=dict(**ep, deepspeed=z1), save=str(tmp / "final")),
        dict(name="zero2-pruned", overrides=dict(**ep, deepspeed=z2, **PRUNING["pruned"])),
        dict(
            name="first",
            overrides=dict(**ep, deepspeed=z2, max_steps=4, save_strategy="steps", save_steps=4),
        ),
        dict(name="resumed", overrides=dict(**ep, deepspeed=z2, max_steps=8), resume=ckpt),
    ]
    results = launch(deepspeed_launch(2), dict(model=tiny_olmoe_dir, out=str(tmp), world=2, cases=cases), tmp)
    return {**results, "final": str(tmp / "final"), "checkpoint": ckpt}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero1", "zero2-pruned"])
def test_lora_under_deepspeed_reproduces_the_single_process_lora_run(lora_ds_world2, lora_reference, name):
    result = lora_ds_world2[name]
    reference = lora_reference[("pruned" if "pruned" in name else "plain", 2)]
    worst = check_trajectory(result, reference, f"LoRA W=2 D=2 {name}")
    print(f"LoRA W=2 D=2 DeepSpeed {name}: largest per-step relative loss difference {worst:.2e}")
    assert result["groups"] == {"ep": [0, 1], "edp": [0], "source": "deepspeed"}


@pytest.mark.slow
def test_lora_adapter_saved_under_deepspeed_is_the_single_process_adapter(lora_ds_world2, lora_reference):
    import occult_ft

    assert_same_adapter(lora_ds_world2["final"], lora_reference["final"])
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = occult_ft.from_pretrained(lora_reference["final"]).eval()(input_ids=ids).logits
        got = occult_ft.from_pretrained(lora_ds_world2["final"]).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_lora_resume_under_deepspeed_continues_like_the_uninterrupted_run(lora_ds_world2, lora_reference):
    """The engine's model-state file holds rank 0's expert LoRA shards; every rank's own come from the adapter."""
    first, resumed, straight = (
        lora_ds_world2["first"],
        lora_ds_world2["resumed"],
        lora_reference[("plain", 2)],
    )
    assert "error" not in resumed, resumed.get("trace")
    assert "adapter_model.safetensors" in os.listdir(lora_ds_world2["checkpoint"])
    assert first["losses"] == pytest.approx(straight["losses"][:4], rel=1e-5)
    assert resumed["steps"][-4:] == [5, 6, 7, 8]
    assert resumed["losses"][-4:] == pytest.approx(straight["losses"][4:8], rel=1e-5)
    assert resumed["grad_norm"][-4:] == pytest.approx(straight["grad_norm"][4:8], rel=1e-5)


# ---- fast checks, no launch -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"zero_optimization": {"stage": 3}},
            "expert_parallel_size=2 works with DeepSpeed ZeRO stages 0-2, not stage 3",
        ),
        (
            {"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "preset": "mixtral"}},
            'the DeepSpeed config enables AutoEP ("expert_parallel") and expert_parallel_size=2 also shards the experts',
        ),
    ],
)
def test_configs_that_cannot_work_are_one_line_errors(config, message):
    from occult_ft.integrations.deepspeed import check_deepspeed_config

    with pytest.raises(ValueError) as err:
        check_deepspeed_config(config, 2)
    assert str(err.value).startswith(message) and len(str(err.value).splitlines()) == 1
    if config["zero_optimization"]["stage"] == 3:  # ZeRO-3 partitions the weights placement permutes
        with pytest.raises(ValueError, match="ZeRO stage 3 partitions every weight"):
            check_deepspeed_config(config, 1)
    else:
        check_deepspeed_config(config, 1)  # AutoEP alone is DeepSpeed's business without our EP


def test_stage_zero_with_clipping_warns_that_deepspeed_averages_per_rank_norms(recwarn):
    from occult_ft.integrations.deepspeed import check_deepspeed_config

    with pytest.warns(
        UserWarning, match="ZeRO stage 0 and gradient clipping 1.0: DeepSpeed clips by the mean"
    ):
        check_deepspeed_config(
            {"zero_optimization": {"stage": 0}, "gradient_clipping": "auto"}, 2, max_grad_norm=1.0
        )
    check_deepspeed_config(
        {"zero_optimization": {"stage": 0}, "gradient_clipping": "auto"}, 2, max_grad_norm=0.0
    )
    check_deepspeed_config({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}, 2)
    assert not recwarn.list


def test_expert_parameters_get_their_own_moe_param_groups():
    from deepspeed.moe.utils import is_moe_param

    from occult_ft.integrations.deepspeed import mark_expert_parameters, split_moe_param_groups

    dense, bias, expert_a, expert_b = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    mark_expert_parameters([expert_a, expert_b], 2)
    assert is_moe_param(expert_a) and expert_a.group_name == "ep_size_2" and not is_moe_param(dense)
    optimizer = torch.optim.AdamW(
        [
            {"params": [dense, expert_a], "weight_decay": 0.1},
            {"params": [bias, expert_b], "weight_decay": 0.0},
        ],
        lr=1e-3,
    )
    split_moe_param_groups(optimizer)
    groups = [
        (g["params"], g.get("moe", False), g["name"], g["weight_decay"]) for g in optimizer.param_groups
    ]
    # each original group keeps its dense parameters; its expert parameters move to a twin marked moe
    assert groups == [
        ([dense], False, "occult_group_0", 0.1),
        ([bias], False, "occult_group_1", 0.0),
        ([expert_a], True, "ep_size_2", 0.1),
        ([expert_b], True, "ep_size_2", 0.0),
    ]
    split_moe_param_groups(optimizer)  # idempotent
    assert len(optimizer.param_groups) == 4


def test_only_experts_leave_no_empty_group_and_a_placeholder_optimizer_is_left_alone():
    from occult_ft.integrations.deepspeed import mark_expert_parameters, split_moe_param_groups

    expert = torch.nn.Parameter(torch.zeros(2))
    mark_expert_parameters([expert], 4)
    optimizer = torch.optim.SGD([expert], lr=0.1)
    split_moe_param_groups(optimizer)
    assert [(g["params"], g["moe"], g["name"]) for g in optimizer.param_groups] == [
        ([expert], True, "ep_size_4")
    ]

    class Placeholder:  # accelerate's DummyOptim has no param_groups: the engine builds the optimizer
        pass

    placeholder = Placeholder()
    assert split_moe_param_groups(placeholder) is placeholder


def test_the_engine_marker_is_a_parameter_free_deepspeed_moe():
    from deepspeed.moe.layer import MoE

    from occult_ft.integrations.deepspeed import MARKER_ATTRIBUTE, attach_moe_marker

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = set(model.state_dict())
    marker = attach_moe_marker(model, 2, 8)
    assert isinstance(marker, MoE) and getattr(model, MARKER_ATTRIBUTE) is marker
    assert attach_moe_marker(model, 2, 8) is marker  # idempotent
    assert set(model.state_dict()) == before and not list(marker.parameters())
    assert (marker.num_experts, marker.num_local_experts, marker.expert_group_name) == (8, 0, "ep_size_2")
    with pytest.raises(RuntimeError, match="has no forward"):
        marker(torch.zeros(1, 2))
