"""The registry's entries: one `MoEArch` per supported model type, one line per refused one.

Entries are grouped by router convention (`MoEArch.convention`); within a group they differ only in
the few fields that differ in the model's router. Every value here was read off the router code of the
installed transformers and is proven against it by the self-check (`occult_ft.models.selfcheck`) on a
tiny model of each type (`tests/test_family.py`). A refused type lists what is missing for it, which is
also the error users see before any weight loads.

To add a type: copy the entry of a type with the same convention, change what differs, add its tiny
config to `tiny.py`, and run `pytest tests/test_family.py -k <type>`.
"""

from __future__ import annotations

from typing import Any

from .arch import MoEArch

__all__ = ["CORE_MODEL_TYPES", "ENTRIES", "REFUSED"]

#: the types the component tests (dispatch, routing, placement, PEFT, sharded loading) run on; the
#: whole family runs through tests/test_family.py
CORE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")


def _softmax(model_type: str, renormalize: bool | str = "norm_topk_prob", **fields) -> MoEArch:
    """Softmax over all experts, top-k, optional renormalisation (Mixtral, Qwen, OLMoE)."""
    return MoEArch(model_type, router_attr=fields.pop("router_attr", "gate"), scoring="softmax",
                   renormalize=renormalize, **fields)  # fmt: skip


def _v3(model_type: str, **fields) -> MoEArch:
    """DeepSeek-V3's router: sigmoid scores, a selection-only correction bias, group-limited top-k
    (`n_group` groups ranked by their top-2 sum, `topk_group` kept), `norm_topk_prob`,
    `routed_scaling_factor`."""
    base: dict[str, Any] = dict(
        router_attr="gate",
        scoring="sigmoid",
        renormalize="norm_topk_prob",
        scaling_attr="routed_scaling_factor",
        correction_bias_attr="e_score_correction_bias",
        shared_attrs=("shared_experts",),
        router_params=("weight", "e_score_correction_bias"),
        native_group_routing="topk_sum",
        group_score_topn=2,
    )
    base.update(fields)
    return MoEArch(model_type, **base)


def _v2(model_type: str, **fields) -> MoEArch:
    """DeepSeek-V2's router: softmax, no renormalisation, `routed_scaling_factor`, optional
    `group_limited_greedy` (groups ranked by their best score)."""
    base = dict(
        shared_attrs=("shared_experts",), scaling_attr="routed_scaling_factor", native_group_routing="max"
    )
    base.update(fields)
    return _softmax(model_type, renormalize=False, **base)


def _logits(model_type: str, **fields) -> MoEArch:
    """Top-k on the raw logits, gate weights a softmax over the k selected logits (GPT-OSS)."""
    return MoEArch(model_type, router_attr=fields.pop("router_attr", "router"), scoring="logits",
                   renormalize=True, **fields)  # fmt: skip


def _sigmoid_bias(model_type: str, **fields) -> MoEArch:
    """Sigmoid scores, a selection-only correction bias, top-k, renormalised (MiniMax-M2)."""
    base: dict[str, Any] = dict(
        router_attr="gate",
        scoring="sigmoid",
        renormalize=True,
        correction_bias_attr="e_score_correction_bias",
    )
    base.update(fields)
    return MoEArch(model_type, **base)


_BIAS_ROUTER = ("weight", "e_score_correction_bias")

ENTRIES: tuple[MoEArch, ...] = (
    # -- softmax top-k ---------------------------------------------------------------------------------
    _softmax("mixtral", renormalize=True),
    _softmax("minimax", renormalize=True),
    _softmax("qwen2_moe", shared_attrs=("shared_expert", "shared_expert_gate")),
    _softmax("qwen3_moe"),
    _softmax("olmoe"),
    _softmax("flex_olmo"),
    _softmax("mellum"),
    _softmax("lara_mini", shared_attrs=("shared_expert",)),
    _softmax("qwen3_next", shared_attrs=("shared_expert", "shared_expert_gate")),
    _softmax("qwen4_exp", shared_attrs=("shared_expert", "shared_expert_gate"), aliases=("qwen4_exp_text",)),
    _softmax(
        "qwen3_5_moe",
        renormalize=True,
        shared_attrs=("shared_expert", "shared_expert_gate"),
        aliases=("qwen3_5_moe_text",),
    ),
    _softmax("qwen3_vl_moe", renormalize=True),
    _softmax("qwen3_omni_moe_thinker"),
    _softmax("jamba", renormalize=False, router_attr="router", block_attr="feed_forward"),
    _softmax("hunyuan_v1_moe", renormalize=True, router_params=("wg.weight",), shared_attrs=("shared_mlp",)),
    # -- softmax + selection bias (ERNIE 4.5: the bias in `moe_statics`, the sum floored at norm_min) ----
    _softmax(
        "ernie4_5_moe",
        renormalize=True,
        correction_bias_attr="moe_statics.e_score_correction_bias",
        renorm_min_attr="norm_min",
        router_params=("weight", "moe_statics.e_score_correction_bias"),
        shared_attrs=("shared_experts",),
    ),
    # -- softmax, DeepSeek-V2 style (group_limited_greedy) --------------------------------------------
    _v2("deepseek_v2"),
    _v2("deepseek_ocr2"),
    _v2("unlimited_ocr"),
    # -- softmax, group-limited by top-2 sums (Mistral 4) ----------------------------------------------
    _v3(
        "mistral4",
        scoring="softmax",
        correction_bias_attr=None,
        router_params=("weight",),
        group_mask_fill=0.0,
    ),
    _v3(
        "mistral_large4",
        scoring="softmax",
        renormalize=True,
        correction_bias_attr=None,
        router_params=("weight",),
        group_mask_fill=0.0,
    ),
    # -- sigmoid + correction bias, group-limited (DeepSeek-V3 and its many relatives) ----------------
    _v3("deepseek_v3"),
    _v3("deepseek_v32"),
    _v3("glm4_moe"),
    _v3("glm4_moe_lite"),
    _v3("glm4v_moe"),
    _v3("glm5_next"),
    _v3("glm_moe_dsa"),
    _v3("dots1"),
    _v3("dots3_note", aliases=("dots3_note_text",)),
    _v3("exaone_moe"),
    _v3("kimi_linear"),
    _v3("hy_v4"),
    _v3("hy_v4_vl"),
    _v3("solar_open"),
    _v3("axk1"),
    _v3("axk2", group_mask_fill=0.0),
    _v3("bailing_hybrid"),
    _v3("mimo_v2_flash", shared_attrs=()),
    _v3("beam", scaling_attr=None, shared_attrs=()),  # the block scales after the experts
    _v3("nemotron_h", block_attr="mixer", expert_params=("up_proj", "down_proj")),
    # -- sigmoid + correction bias, no groups ----------------------------------------------------------
    _sigmoid_bias("minimax_m3_vl", router_params=_BIAS_ROUTER, aliases=("minimax_m3_vl_text",)),
    _sigmoid_bias("laguna", router_params=_BIAS_ROUTER, shared_attrs=("shared_experts",)),
    _sigmoid_bias(
        "muse_spark", router_params=_BIAS_ROUTER, renorm_eps=1e-15, scaling_attr="routed_scaling_factor"
    ),
    # the block holds the bias and passes it to its router
    _sigmoid_bias(
        "minimax_m2", router_args=("e_score_correction_bias",), block_params=("e_score_correction_bias",)
    ),
    _sigmoid_bias(
        "hy_v3",
        router_args=("e_score_correction_bias",),
        block_params=("e_score_correction_bias",),
        scaling_attr="router_scaling_factor",
        shared_attrs=("shared_experts",),
    ),
    _sigmoid_bias(
        "afmoe",
        router_attr="router",
        correction_bias_attr="expert_bias",
        router_args=("expert_bias",),
        block_params=("expert_bias",),
        router_input="batch",
        router_params=("gate.weight",),
        scaling_attr="route_scale",
        shared_attrs=("shared_experts",),
    ),
    _sigmoid_bias(
        "lfm2_moe",
        block_attr="feed_forward",
        correction_bias_attr="expert_bias",
        router_args=("expert_bias",),
        block_params=("expert_bias",),
        renormalize="norm_topk_prob",
        renorm_eps=1e-6,
        scaling_attr="routed_scaling_factor",
    ),
    # -- sigmoid top-k, no bias (Flint; Cohere2-MoE picks softmax-over-k or sigmoid per config) --------
    MoEArch(
        "flint",
        router_attr="gate",
        scoring="sigmoid",
        renormalize="norm_topk_prob",
        shared_attrs=("shared_expert",),
    ),
    MoEArch(
        "cohere2_moe",
        router_attr="gate",
        scoring="expert_selection_fn",
        scoring_values=(("softmax", "logits"), ("sigmoid", "sigmoid")),
        renormalize="norm_topk_prob",
        shared_attrs=("shared_experts",),
    ),
    # -- the bias on the raw logits, sigmoid weights (Kolibri) -----------------------------------------
    _sigmoid_bias(
        "kolibri1",
        bias_on="logits",
        renormalize="norm_topk_prob",
        router_params=_BIAS_ROUTER,
        shared_attrs=("shared_experts",),
    ),
    # -- the config's scoring_func + correction bias (Inkling 2) ---------------------------------------
    _sigmoid_bias(
        "inkling2",
        scoring="score_fn",
        router_params=_BIAS_ROUTER,
        scaling_attr="routed_scaling_factor",
        aliases=("inkling2_text",),
    ),
    _sigmoid_bias(
        "inkling2_loop",
        scoring="score_fn",
        router_params=_BIAS_ROUTER,
        scaling_attr="routed_scaling_factor",
        aliases=("inkling2_loop_text",),
    ),
    # -- top-k on logits, softmax over k ---------------------------------------------------------------
    _logits(
        "gpt_oss",
        router_params=("weight", "bias"),
        expert_params=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    ),
    _logits("aria", shared_attrs=("shared_experts",), aliases=("aria_text",)),
    _logits("granitemoe", block_attr="block_sparse_moe"),
    _logits("granitemoe_swa", block_attr="block_sparse_moe"),
    _logits("granitemoeshared", block_attr="block_sparse_moe"),
    _logits("granitemoehybrid", block_attr="block_sparse_moe"),
    # -- the router returns probabilities; a learned per-expert scale (Gemma 4) -------------------------
    MoEArch(
        "gemma4",
        router_attr="router",
        scoring="probs",
        renormalize=True,
        expert_scale_attr="per_expert_scale",
        num_experts_attr="proj.out_features",
        top_k_attr="config.top_k_experts",
        block_attr=None,
        router_params=("proj.weight", "per_expert_scale"),
        aliases=("gemma4_text",),
    ),
)

#: model type -> what is missing (the error is "<model_type>: <reason>")
REFUSED: dict[str, str] = {
    "phimoe": "sparsemixer routing (expert choice by a sampled, masked softmax) has no device-limited rule yet",
    "zaya": "its router is an MLP that carries state from layer to layer and may pick a compute-free skip "
    "expert; no device-limited rule for it yet",
    "inkling_text": "its router normalises the routed and the shared experts' gates together (shared_gammas), "
    "so pruning the routed experts changes the shared ones; no rule for that yet",
    "inkling_mm_model": "its language model routes like inkling_text (routed and shared gates normalised "
    "together); no rule for that yet",
    "deepseek_v4": "its hash-routed MoE layers (mlp_layer_types 'hash_moe') pick experts by token id from a "
    "fixed table; no device-limited rule for them yet",
    "ernie4_5_vl_moe": "each layer has separate text and vision expert sets routed by modality; occult_ft "
    "handles one expert set per layer",
    "diffusion_gemma": "a diffusion (denoising encoder-decoder) language model; occult_ft fine-tunes causal "
    "language models",
    "openai_privacy_filter": "a token-classification model, not a language model occult_ft can fine-tune",
    "qwen3_omni_moe": "a speech composite (thinker + talker) that no causal or image-text-to-text AutoModel "
    "loads; use its thinker, model type qwen3_omni_moe_thinker",
    # MoE models of transformers outside the standard experts family (no @use_experts_implementation)
    "llama4": "its experts take every token pre-scaled by its sigmoid router scores (no experts(hidden_states, "
    "top_k_index, top_k_weights) call), which occult_ft's exchange and pruning plug into",
    "llama4_text": "its experts take every token pre-scaled by its sigmoid router scores (no experts(hidden_states, "
    "top_k_index, top_k_weights) call), which occult_ft's exchange and pruning plug into",
    "dbrx": "its experts module is a per-expert loop over split v1/w1/w2 tensors, not the standard "
    "@use_experts_implementation interface occult_ft shards",
    "longcat_flash": "its routed set mixes real and zero-computation (identity) experts in a non-standard "
    "experts module; no device placement or budget for identity experts yet",
    "jetmoe": "mixture-of-attention heads and parallel experts outside the standard experts interface",
    "step3p7": "its experts module does not use the standard @use_experts_implementation interface",
    "doge": "its CDMoE retrieves expert rows by product keys, not a top-k routed experts module",
    "switch_transformers": "an encoder-decoder model with capacity-based top-1 routing; occult_ft fine-tunes "
    "causal language models with the standard experts interface",
    "nllb_moe": "an encoder-decoder translation model with capacity-based top-2 routing; occult_ft fine-tunes "
    "causal language models with the standard experts interface",
}
