"""The architecture registry, table-driven over every supported model type."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from occult_ft.models import (
    MoEArch,
    UnsupportedModelError,
    find_moe_layers,
    get_arch,
    register_arch,
    supported_model_types,
    tiny_config,
)

EXPECTED = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"}


def test_all_seven_architectures_are_registered():
    assert EXPECTED <= set(supported_model_types())


@pytest.mark.parametrize("model_type", supported_model_types())
def test_find_moe_layers_skips_dense_layers(model_type):
    cfg = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(cfg)
    layers = find_moe_layers(model)
    dense = getattr(cfg, "first_k_dense_replace", 0) or 0
    assert [layer.index for layer in layers] == list(range(dense, cfg.num_hidden_layers))
    for layer in layers:
        assert layer.num_experts == 8 and layer.top_k == 2
        assert layer.router is getattr(layer.block, layer.arch.router_attr)
        for name in layer.arch.expert_params:
            assert getattr(layer.experts, name).shape[0] == 8
        for name in layer.arch.router_params:
            assert getattr(layer.router, name).shape[0] == 8
        for name in layer.arch.shared_attrs:
            assert hasattr(layer.block, name)


@pytest.mark.parametrize("model_type", supported_model_types())
def test_selection_scores_reproduce_the_routers_choice(model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    layer = find_moe_layers(model)[-1]
    if layer.arch.correction_bias_attr:
        getattr(layer.router, layer.arch.correction_bias_attr).normal_()
    with torch.no_grad():
        logits, _, ids = layer.router(torch.randn(50, 64))
        scores = layer.arch.selection_scores(layer.router, logits)
    assert torch.equal(ids.sort(-1).values, scores.topk(2, dim=-1).indices.sort(-1).values)


def test_qwen_mlp_only_layers_are_skipped():
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", mlp_only_layers=[0]))
    assert [layer.index for layer in find_moe_layers(model)] == [1]


def test_unsupported_model_type_says_how_to_add_one():
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(
        UnsupportedModelError, match="model_type 'llama' is not supported.*register a MoEArch"
    ):
        find_moe_layers(model)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_arch(MoEArch("olmoe", router_attr="gate", scoring="softmax", renormalize=False))


def test_bad_scoring_is_rejected():
    with pytest.raises(ValueError, match="scoring='relu'"):
        MoEArch("x", router_attr="gate", scoring="relu", renormalize=False)


def test_get_arch_accepts_type_config_and_model():
    cfg = tiny_config("mixtral")
    assert get_arch("mixtral") is get_arch(cfg) is get_arch(AutoModelForCausalLM.from_config(cfg))
