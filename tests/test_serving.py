"""`occult_ft.serving.ServedRouting`: a checkpoint's pruned routing from router logits alone (what the
vLLM plugin applies) equals the pruned routers of `occult_ft.from_pretrained(DIR)`, for every core
model type and criterion; checkpoints without an active budget are left to the engine's own routing.
Runs without vLLM (tests/test_vllm.py serves the same routing in vLLM)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from occult_ft.apply import apply_occult
from occult_ft.checkpoint import CheckpointError, describe_checkpoint
from occult_ft.checkpoint.load import from_pretrained
from occult_ft.checkpoint.remote_code import remote_class_name
from occult_ft.models import CORE_MODEL_TYPES, find_moe_layers, tiny_config
from occult_ft.routing import CRITERIA, PruningConfig
from occult_ft.serving.routing import STATS_ENV, ServedRouting
from occult_ft.serving.vllm_plugin import SERVED, unserved_refusal


def _similarity(model):
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in find_moe_layers(model):
        x = torch.rand(layer.num_experts, layer.num_experts, generator=g)
        out[layer.index] = (x + x.T) / 2
    return out


def _saved(path, model_type, pruning):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    tables = _similarity(model) if pruning is not None and pruning.criterion == "similarity" else None
    apply_occult(model, None, pruning, tables)
    model.save_pretrained(path)
    return str(path)


def test_the_plugin_serves_the_core_model_types():
    assert set(CORE_MODEL_TYPES) <= set(SERVED)


def test_a_pruned_type_the_plugin_does_not_serve_is_refused_in_one_line():
    message = unserved_refusal(remote_class_name("glm4_moe"))
    assert message is not None and "\n" not in message
    assert message.startswith("OccultGlm4MoeForCausalLM: ") and "model type 'glm4_moe'" in message
    assert "olmoe" in message and "occult_ft.from_pretrained" in message  # what it serves, and the fix
    # served types, and names of no pruned checkpoint, are vLLM's to resolve
    assert unserved_refusal(remote_class_name("olmoe")) is None
    assert unserved_refusal("OlmoeForCausalLM") is None and unserved_refusal("LlamaForCausalLM") is None


@pytest.mark.parametrize("model_type", CORE_MODEL_TYPES)
@pytest.mark.parametrize("criterion", CRITERIA)
def test_served_routing_equals_the_pruned_routers_of_from_pretrained(tmp_path, model_type, criterion):
    path = _saved(tmp_path, model_type, PruningConfig(4, 1, criterion))
    served = ServedRouting.from_checkpoint(path)
    reference = from_pretrained(path)
    changed = 0
    for layer in find_moe_layers(reference):
        if served.arch.correction_bias_attr:  # the engine's loaded tensor (DeepSeek-V3's selection bias)
            bias = getattr(layer.router, served.arch.correction_bias_attr)
            served.set_router_tensor(layer.index, served.arch.correction_bias_attr, bias.detach() + 0.01)
            setattr(layer.router, served.arch.correction_bias_attr, torch.nn.Parameter(bias.detach() + 0.01))
        x = torch.randn(
            64, reference.config.hidden_size, generator=torch.Generator().manual_seed(layer.index)
        )
        with torch.no_grad():
            logits, weights, ids = layer.router(x)
            unpruned_ids = served.arch.route(served.routers[layer.index], logits)[0]
        got_weights, got_ids = served.route(layer.index, logits)
        want, have = ids.sort(dim=1), got_ids.sort(dim=1)
        assert torch.equal(want.values, have.values)
        torch.testing.assert_close(
            got_weights.gather(1, have.indices), weights.float().gather(1, want.indices)
        )
        changed += int((unpruned_ids.sort(dim=1).values != have.values).any(dim=1).sum())
    if not describe_checkpoint(path).native_routing:  # native group fields: the stock routing is pruned
        assert changed > 0  # the budget changed some tokens' experts: the comparison can fail


@pytest.mark.parametrize("model_type", CORE_MODEL_TYPES)
def test_served_routing_honours_the_saved_device_bias(tmp_path, model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    pruning = PruningConfig(4, 1, "score")
    bias = {layer.index: torch.tensor([0.3, -0.1, -0.1, -0.1]) for layer in find_moe_layers(model)}
    apply_occult(model, None, pruning, device_bias=bias)
    model.save_pretrained(tmp_path)
    served = ServedRouting.from_checkpoint(str(tmp_path))
    unbiased = ServedRouting(served_config(tmp_path), pruning)
    reference = from_pretrained(str(tmp_path))
    moved = 0
    for layer in find_moe_layers(reference):
        attr = served.arch.correction_bias_attr
        if attr:  # the engine's loaded tensor (DeepSeek-V3's selection bias)
            for routing in (served, unbiased):
                routing.set_router_tensor(layer.index, attr, getattr(layer.router, attr).detach())
        x = torch.randn(
            64, reference.config.hidden_size, generator=torch.Generator().manual_seed(layer.index)
        )
        with torch.no_grad():
            logits, weights, ids = layer.router(x)
        got_weights, got_ids = served.route(layer.index, logits)
        want, have = ids.sort(dim=1), got_ids.sort(dim=1)
        assert torch.equal(want.values, have.values)
        torch.testing.assert_close(
            got_weights.gather(1, have.indices), weights.float().gather(1, want.indices)
        )
        plain = unbiased.route(layer.index, logits)[1].sort(dim=1).values
        moved += int((plain != have.values).any(dim=1).sum())
    assert moved > 0  # the bias moved some tokens to device 0: ignoring it would fail the comparison


def served_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=False)


@pytest.mark.parametrize("pruning", [None, PruningConfig(4, 4, "score")])
def test_a_checkpoint_without_an_active_budget_keeps_the_engine_s_routing(tmp_path, pruning):
    assert ServedRouting.from_checkpoint(_saved(tmp_path, "olmoe", pruning)) is None


def test_similarity_without_its_tables_is_refused_in_one_line(tmp_path):
    path = _saved(tmp_path, "olmoe", PruningConfig(4, 1, "similarity"))
    os.remove(os.path.join(path, "occult_similarity.tables"))
    with pytest.raises(
        CheckpointError, match=r"criterion 'similarity' needs occult_similarity.tables"
    ) as err:
        ServedRouting.from_checkpoint(path)
    assert "\n" not in str(err.value)


def test_routing_counts_the_devices_each_token_reaches(tmp_path, monkeypatch):
    path = _saved(tmp_path / "ckpt", "qwen3_moe", PruningConfig(4, 2, "score"))
    stats = tmp_path / "stats.json"
    monkeypatch.setenv(STATS_ENV, str(stats))
    served = ServedRouting.from_checkpoint(path)
    layer = min(served.routers)
    # 8 experts on 4 devices (2 each): tokens picking experts {0, 1} reach 1 device, {0, 2} reach 2
    logits = torch.full((3, 8), -10.0)
    logits[0, [0, 1]] = 5.0
    logits[1, [0, 2]] = 5.0
    logits[2, [0, 7]] = 5.0
    weights, ids = served.route(layer, logits)
    assert not stats.exists()  # written by `record`, which the engine calls after `route`
    inputs = torch.randn(3, 5)
    served.record(layer, inputs, weights, ids)
    written = json.loads(stats.read_text())
    assert written["layers"][str(layer)] == {"tokens": 3, "max_devices": 2, "histogram": [0, 1, 2, 0, 0]}
    kept = written["tokens"][str(layer)]
    assert kept["ids"] == ids.tolist() and torch.equal(torch.tensor(kept["inputs"]), inputs)
    torch.testing.assert_close(torch.tensor(kept["weights"]), weights)
