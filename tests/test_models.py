"""The architecture registry: lookups, errors, the router maths of each convention, and the self-check.

The whole family (every discovered model type) runs through tests/test_family.py; this file checks the
registry's own behaviour: that a wrong entry is caught by the self-check with a line naming the field,
that refusals and unknown types fail with one line, and the config readers.
"""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from occult_ft.models import (
    CORE_MODEL_TYPES,
    MoEArch,
    RouterCheckError,
    UnsupportedModelError,
    check_layer_routing,
    config_num_experts,
    config_top_k,
    find_moe_layers,
    get_arch,
    lookup_arch,
    moe_layer_indices,
    refusal,
    refused_model_types,
    register_arch,
    representative_model_types,
    supported_model_types,
    tiny_config,
)


def _model(model_type, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def test_the_core_types_and_the_issue_s_headline_types_are_registered():
    assert set(CORE_MODEL_TYPES) <= set(supported_model_types())
    headline = {"glm4_moe", "deepseek_v32", "qwen3_next", "qwen3_5_moe", "minimax_m2", "mistral4", "dots1"}
    assert headline <= set(supported_model_types())


def test_aliases_resolve_to_their_entry():
    assert get_arch("qwen3_5_moe_text") is get_arch("qwen3_5_moe")
    assert get_arch("aria_text").model_type == "aria"


def test_find_moe_layers_skips_dense_layers_and_reads_the_config():
    model = _model("deepseek_v3")  # first_k_dense_replace=1 of 3 layers
    assert [layer.index for layer in find_moe_layers(model)] == [1, 2] == moe_layer_indices(model.config)
    model = _model("qwen3_moe", mlp_only_layers=[0])
    assert [layer.index for layer in find_moe_layers(model)] == [1] == moe_layer_indices(model.config)


@pytest.mark.parametrize(
    "fields, want",
    [
        (dict(num_hidden_layers=4, first_k_dense_replace=1), [1, 2, 3]),
        (dict(num_hidden_layers=4, decoder_sparse_step=2), [1, 3]),  # Qwen: (i + 1) % step == 0
        (dict(num_hidden_layers=4, mlp_only_layers=[2]), [0, 1, 3]),
        (
            dict(num_hidden_layers=6, moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=2),
            [1, 3],
        ),
        (
            dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=2),
            [1, 2],
        ),
        (dict(num_hidden_layers=2, layers_block_type=["attention", "mamba"], num_experts=8), [0, 1]),
        (dict(num_hidden_layers=2, layers_num_experts=[1, 8], num_experts=8), [1]),
        (dict(num_hidden_layers=3, num_dense_layers=2), [2]),
        (dict(num_hidden_layers=2, enable_moe_block=False), []),
        (dict(text_config=dict(num_hidden_layers=2, first_k_dense_replace=1, num_experts=8)), [1]),
    ],
)
def test_moe_layer_indices_rules(fields, want):
    config = {"num_experts": 8, **fields}
    assert moe_layer_indices(config) == want


def test_config_readers_look_through_text_config_and_the_family_s_field_names():
    assert config_num_experts({"text_config": {"n_routed_experts": 256}}) == 256
    assert config_top_k({"text_config": {"num_experts_per_tok": 8}}) == 8
    assert config_top_k({"num_experts_per_token": 6}) == 6  # Bailing
    assert config_num_experts({"num_experts": [8, 16]}) == 16  # Hunyuan's per-layer counts: the largest
    assert config_num_experts({"hidden_size": 64}) is None


def test_unknown_model_type_says_how_to_add_one():
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(
        UnsupportedModelError, match="model_type 'llama' is not supported.*register a MoEArch"
    ):
        find_moe_layers(model)


@pytest.mark.parametrize("model_type", sorted(refused_model_types()))
def test_a_refused_type_fails_with_one_line_naming_it(model_type):
    with pytest.raises(UnsupportedModelError) as err:
        get_arch(model_type)
    assert str(err.value) == refusal(model_type)
    assert str(err.value).startswith(f"{model_type}: ") and "\n" not in str(err.value)
    assert lookup_arch(model_type) is None


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_arch(MoEArch("olmoe", router_attr="gate", scoring="softmax", renormalize=False))
    with pytest.raises(ValueError, match="'aria_text' is already registered"):  # an alias counts too
        register_arch(
            MoEArch("x_new", router_attr="gate", scoring="softmax", renormalize=False, aliases=("aria_text",))
        )
    with pytest.raises(ValueError, match="'phimoe' is already registered"):  # so does a refusal
        register_arch(MoEArch("phimoe", router_attr="router", scoring="softmax", renormalize=False))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("scoring", "relu", "scoring='relu'"),
        ("bias_on", "weights", "bias_on='weights'"),
        ("router_input", "flat", "router_input='flat'"),
        ("native_group_routing", "sum", "native_group_routing='sum'"),
    ],
)
def test_bad_entry_fields_are_rejected(field, value, match):
    fields = dict(router_attr="gate", scoring="softmax", renormalize=False)
    fields[field] = value
    with pytest.raises(ValueError, match=match):
        MoEArch("x", **fields)


def test_get_arch_accepts_type_config_dict_and_model():
    cfg = tiny_config("mixtral")
    assert get_arch("mixtral") is get_arch(cfg) is get_arch(cfg.to_dict()) is get_arch(_model("mixtral"))


def test_representatives_cover_every_convention_once():
    reps = representative_model_types()
    conventions = {get_arch(t).convention for t in supported_model_types()}
    assert set(reps) == conventions
    assert all(get_arch(t).convention == c for c, t in reps.items())


# ---- the self-check catches a wrong entry, naming the field ---------------------------------------------
def _first_layer(model_type, **fields):
    layer = find_moe_layers(_model(model_type), check=False)[0]
    return dataclasses.replace(layer, arch=dataclasses.replace(layer.arch, **fields))


@pytest.mark.parametrize(
    "model_type, fields, message",
    [
        ("mixtral", dict(renormalize=False), "gate weights disagree.*check renormalize"),
        ("qwen3_moe", dict(renormalize=False), "gate weights disagree.*check renormalize"),
        (
            "deepseek_v3",
            dict(scaling_attr=None),
            r"gate weights disagree \(the model's are 2\.5x.*scaling_attr",
        ),
        ("deepseek_v3", dict(correction_bias_attr=None), "selected experts disagree"),
        ("ernie4_5_moe", dict(correction_bias_attr=None), "selected experts disagree"),
        ("kolibri1", dict(bias_on="scores"), "selected experts disagree"),
        ("gpt_oss", dict(scoring="sigmoid"), "disagree"),
        ("minimax_m2", dict(router_args=()), "calling the router as the entry says"),
        ("gemma4_text", dict(expert_scale_attr=None), "gate weights disagree"),
        ("mixtral", dict(top_k_attr="num_experts"), "top-8"),
    ],
)
def test_self_check_names_the_model_type_and_the_field_that_disagrees(model_type, fields, message):
    layer = _first_layer(model_type, **fields)
    with pytest.raises(RouterCheckError, match=message) as err:
        check_layer_routing(layer)
    assert str(err.value).startswith(f"{get_arch(model_type).model_type} router self-check failed")
    assert "\n" not in str(err.value)


def test_self_check_runs_once_per_model_when_layers_are_first_found(monkeypatch):
    from occult_ft.models import selfcheck

    calls = []
    monkeypatch.setattr(selfcheck, "check_layer_routing", lambda layer, seed=0: calls.append(layer.index))
    model = _model("olmoe")
    find_moe_layers(model)
    find_moe_layers(model)
    assert calls == [0]


def test_self_check_stops_a_changed_router_when_layers_are_found(monkeypatch):
    """A transformers release whose router changed: find_moe_layers (what load, profile, prune and train
    all call first) refuses the model."""
    model = _model("mixtral")
    router_class = type(find_moe_layers(model, check=False)[0].router)

    def changed(self, hidden_states):  # renormalisation dropped
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return logits, weights, ids

    monkeypatch.setattr(router_class, "forward", changed)
    with pytest.raises(RouterCheckError, match="mixtral router self-check failed on MoE layer 0"):
        find_moe_layers(model)


def test_self_check_skips_meta_weights_until_they_are_real():
    from occult_ft.models.selfcheck import check_model_routing

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    layers = find_moe_layers(model)  # no error, nothing checked
    assert check_model_routing(model, layers) is False


def test_selection_scores_reproduce_the_routers_choice_with_a_group_limit():
    """DeepSeek-V3 with its group limit on (4 groups of 2, 2 kept): `MoEArch.route` is the router."""
    model = _model("deepseek_v3", n_group=4, topk_group=2)
    layer = find_moe_layers(model, check=False)[-1]
    assert layer.arch.routing_group_size(layer.router) == 2
    with torch.no_grad():
        layer.router.weight.normal_()
        layer.router.e_score_correction_bias.normal_()
        logits, weights, ids = layer.router(torch.randn(50, 64))
        pred_ids, pred_w, _ = layer.arch.route(layer.router, logits)
    assert torch.equal(ids.sort(-1).values, pred_ids.sort(-1).values)
    check_layer_routing(layer)
