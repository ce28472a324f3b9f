"""Tiny random configs of every registered model type: for tests, docs and the recipes' tiny runs.

`tiny_config(model_type)` starts from the model type's own defaults and shrinks every size field the
config class has (hidden 64, 8 experts, top-2, a few layers, a 128-token vocabulary; a multimodal
model's vision/audio towers to one narrow layer), then applies the type's entry in `TINY` below: the
fields a generic shrink cannot guess (MLA ranks, per-layer type lists that must have one entry per
layer, the dense layers the architecture has, a group limit to exercise). Adding a model type to the
registry means adding its line here too; `tests/test_family.py` builds every one of them.
"""

from __future__ import annotations

from typing import Any

from .arch import EXPERT_COUNT_FIELDS, TOP_K_FIELDS

__all__ = ["DEFAULT", "TINY", "tiny_config", "tiny_kwargs"]

#: in a `TINY` entry: leave this field at the config class's default (do not shrink it)
DEFAULT = "<default>"

#: the size every tiny decoder shares (fields absent from a config class are left out)
_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
#: a vision / audio tower at the narrowest width that still builds (never run by the tests' text inputs)
_TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    depth=1,
    num_attention_heads=2,
    num_heads=2,
    num_key_value_heads=2,
    embed_dim=32,
    head_dim=16,
    out_hidden_size=64,
    encoder_layers=1,
    d_model=32,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    mlp_dim=64,
    vocab_size=128,
)
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)

# DeepSeek-V2/V3 at tiny width: MLA attention, one shared expert, the first layer dense
_TINY_DEEPSEEK = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_hidden_layers=3,
    num_key_value_heads=4,
    head_dim=DEFAULT,
    **_MLA,
)

_MLA_DENSE_FIRST = dict(
    _MLA, num_hidden_layers=3, num_key_value_heads=4, head_dim=DEFAULT, first_k_dense_replace=1
)
_MLA_SPARSE = dict(
    _MLA,
    num_hidden_layers=3,
    num_key_value_heads=4,
    head_dim=DEFAULT,
    n_group=1,
    topk_group=1,
    mlp_layer_types=["dense", "sparse", "sparse"],
)
_DOTS3: dict[str, Any] = dict(
    _MLA,
    q_lora_rank=16,
    num_hidden_layers=3,
    num_key_value_heads=4,
    per_layer_config={},
    layer_types=["sliding_attention", "indexed_attention", "sliding_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    sliding_window=16,
)
_LINEAR = dict(  # Qwen3-Next / Qwen3.5: gated delta-net layers with one full-attention layer
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_QWEN4 = dict(
    _LINEAR,
    layer_types=["linear_attention", "indexed_attention"],
    indexer_budget=8,
    indexer_compress_ratio=2,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
)
_GEMMA4 = dict(  # MoE on every decoder layer, beside its dense MLP
    enable_moe_block=True,
    top_k_experts=2,
    num_experts=8,
    moe_intermediate_size=32,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=128,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    per_layer_config={},
)
_HY_V4 = dict(
    _MLA,
    q_lora_rank=16,
    num_key_value_heads=4,
    head_dim=DEFAULT,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
)
_MROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
}

#: per model type: what the generic shrink cannot know (merged over it; `text_config` for multimodal)
TINY: dict[str, dict] = {
    "mixtral": dict(head_dim=DEFAULT),
    "qwen2_moe": dict(norm_topk_prob=False, shared_expert_intermediate_size=64, head_dim=DEFAULT),
    "qwen3_moe": dict(norm_topk_prob=True, head_dim=16),
    "olmoe": dict(norm_topk_prob=False, head_dim=DEFAULT),
    "deepseek_v2": dict(
        _TINY_DEEPSEEK, routed_scaling_factor=1.5, topk_method="greedy", n_group=None, topk_group=None
    ),
    "deepseek_v3": dict(
        _TINY_DEEPSEEK, routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True
    ),
    "gpt_oss": dict(
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # generic shrink is enough for these (their dense layers, if any, come from the shrunk defaults)
    **{
        t: {}
        for t in (
            "afmoe",
            "aria",
            "aria_text",
            "cohere2_moe",
            "ernie4_5_moe",
            "exaone_moe",
            "flex_olmo",
            "glm4_moe",
            "granitemoe",
            "granitemoe_swa",
            "granitemoeshared",
            "hunyuan_v1_moe",
            "hy_v3",
            "kolibri1",
            "laguna",
            "lara_mini",
            "mellum",
            "mimo_v2_flash",
            "minimax",
            "minimax_m2",
            "minimax_m3_vl",
            "minimax_m3_vl_text",
            "qwen3_omni_moe_thinker",
            "qwen3_vl_moe",
            "solar_open",
            "unlimited_ocr",
        )
    },  # fmt: skip
    # MLA attention (DeepSeek-style latent ranks), the first layer dense
    "deepseek_v32": dict(
        _MLA_DENSE_FIRST,
        q_lora_rank=16,
        n_group=1,
        topk_group=1,
        index_topk=4,
        index_head_dim=16,
        index_n_heads=2,
    ),
    "glm_moe_dsa": dict(_MLA_DENSE_FIRST, q_lora_rank=16, index_topk=4, index_head_dim=16, index_n_heads=2),
    "glm4_moe_lite": dict(_MLA, num_hidden_layers=2, num_key_value_heads=4, head_dim=DEFAULT),
    "hy_v4": dict(_HY_V4),
    "hy_v4_vl": {"text_config": dict(_HY_V4, rope_parameters=dict(_MROPE, partial_rotary_factor=1.0))},
    "mistral4": dict(_MLA_DENSE_FIRST),
    "mistral_large4": {"text_config": dict(_MLA_DENSE_FIRST)},
    "axk1": dict(_MLA_SPARSE, q_lora_rank=16),
    "axk2": dict(_MLA_SPARSE, q_lora_rank=16),
    "kimi_linear": dict(
        _MLA_SPARSE,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_head_dim=16,
        linear_num_heads=4,
    ),
    "bailing_hybrid": dict(
        _MLA_SPARSE,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_head_dim=16,
        linear_num_heads=4,
        layer_group_size=3,
        num_nextn_predict_layers=0,
    ),
    "glm5_next": {
        "text_config": dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            layer_types=["linear_attention", "indexed_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            kv_lora_rank=16,
            q_lora_rank=16,
            v_head_dim=16,
            qk_nope_head_dim=16,
            linear_head_dim=16,
            linear_num_heads=4,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            index_kpool=2,
        )
    },
    "dots3_note_text": dict(_DOTS3),
    "dots3_note": {
        "text_config": dict(_DOTS3),
        # one vision MoE layer: find_moe_layers must leave the vision tower's experts alone
        "vision_config": dict(
            mlp_layer_types=["sparse"], moe_intermediate_size=32, adapter_in_dim=32, adapter_out_dim=64
        ),
        "audio_config": dict(adapter_input_size=32, adapter_out_dim=64, downsample_hidden_size=32),
    },
    "deepseek_ocr2": {"text_config": dict(first_k_dense_replace=1, mlp_layer_types=["dense", "sparse"])},
    # per-layer type lists (one entry per layer), a full-attention layer among linear ones
    "beam": dict(
        num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        n_group=1,
        topk_group=1,
        sliding_window=16,
    ),
    "flint": dict(num_hidden_layers=3, mlp_only_layers=[0], sliding_window=16),
    "dots1": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_shared_experts=1,
        sliding_window=16,
        max_window_layers=3,
    ),
    "lfm2_moe": dict(num_hidden_layers=3, num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    "jamba": dict(
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=0,
        use_mamba_kernels=False,
    ),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_chunk_size=16,
        mamba_n_groups=1,
        mamba_expand=2,
    ),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, chunk_size=16, n_groups=1),
    "qwen3_next": dict(_LINEAR),
    "qwen3_5_moe_text": dict(_LINEAR),
    "qwen3_5_moe": {"text_config": dict(_LINEAR)},
    "qwen4_exp_text": dict(_QWEN4),
    "qwen4_exp": {"text_config": dict(_QWEN4)},
    "gemma4_text": dict(_GEMMA4),
    "gemma4": {"text_config": dict(_GEMMA4)},
    "inkling2_text": dict(unpadded_vocab_size=128),
    "inkling2_loop_text": dict(unpadded_vocab_size=128),
    "inkling2": {"text_config": dict(unpadded_vocab_size=128), "vision_config": dict(text_hidden_size=64)},
    "inkling2_loop": {
        "text_config": dict(unpadded_vocab_size=128),
        "vision_config": dict(text_hidden_size=64),
    },
    "glm4v_moe": {"text_config": dict(first_k_dense_replace=1, rope_parameters=_MROPE)},
    "muse_spark": {
        "text_config": dict(
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"],
            layer_rope_theta=[500000.0, 0],
            moe_hidden_size=32,
            sliding_window=16,
        ),
        "vision_config": dict(layer_types=["full_attention"]),
        "audio_config": dict(num_hidden_layers=DEFAULT, hidden_sizes=(16, 16, 16, 16), depths=(1, 1, 1, 1)),
        "out_hidden_size": 32,
        "projector_hidden_size": 64,
    },
}


def _fields(config_class) -> set[str]:
    """The fields a config class knows (its defaults' attributes)."""
    try:
        return set(vars(config_class()))
    except Exception:  # noqa: BLE001 - a class that cannot build without arguments: trust the table
        return set()


def _shrunk(config_class, base: dict) -> dict:
    known = _fields(config_class)
    out = {k: v for k, v in base.items() if k in known}
    out.update({k: 8 for k in EXPERT_COUNT_FIELDS if k in known})
    out.update({k: 2 for k in TOP_K_FIELDS if k in known})
    return out


def tiny_kwargs(model_type: str) -> dict:
    """The keyword arguments `tiny_config` passes to `AutoConfig.for_model(model_type, ...)`."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in TINY:
        raise KeyError(f"no tiny config for model_type {model_type!r}; add one to TINY in {__name__}")
    top = CONFIG_MAPPING[model_type]
    default = AutoConfig.for_model(model_type)
    extra = dict(TINY[model_type])
    text = getattr(default, "text_config", None)
    if text is None:
        kwargs = _shrunk(top, _BASE)
        kwargs.update(extra)
        return _drop_defaults(kwargs)
    kwargs = {}
    for name, sub in vars(default).items():  # vision / audio towers
        if name != "text_config" and _is_config(sub):
            kwargs[name] = _tower(sub, extra.pop(name, {}))
    text_kwargs = _shrunk(type(text), _BASE)
    text_kwargs.update(extra.pop("text_config", {}))
    kwargs["text_config"] = _drop_defaults(text_kwargs)
    kwargs.update(extra)
    return _drop_defaults(kwargs)


def _is_config(value) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _tower(config, extra: dict) -> dict:
    """A tower's shrunk kwargs, its own sub-configs (a SAM encoder inside a vision config) shrunk too."""
    out = _shrunk(type(config), _TOWER)
    for name, sub in vars(config).items():
        if _is_config(sub):
            out[name] = _tower(sub, {})
    out.update(extra)
    return _drop_defaults(out)


def _drop_defaults(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if not (isinstance(v, str) and v == DEFAULT)}


def tiny_config(model_type: str, **overrides):
    """A tiny random config of a registered type (hidden 64, 8 experts, top-2): for tests and docs.

    Overrides apply to the decoder's fields (inside `text_config` for a multimodal type)."""
    from transformers import AutoConfig

    kwargs = tiny_kwargs(model_type)
    target = kwargs["text_config"] if "text_config" in kwargs else kwargs
    target.update(overrides)
    if (
        "vocab_size" in overrides and "unpadded_vocab_size" in target
    ):  # Inkling 2's head follows the vocabulary
        target["unpadded_vocab_size"] = overrides["vocab_size"]
    return AutoConfig.for_model(model_type, **kwargs)
