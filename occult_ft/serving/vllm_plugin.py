"""occult_ft's vLLM plugin: `register`, the `vllm.general_plugins` entry point (pyproject.toml).

vLLM calls `register()` in every process it starts, before it reads a model; with occult_ft installed
in vLLM's environment, `vllm serve DIR` and `vllm.LLM(DIR)` then serve a pruned checkpoint with its
pruned routing and need nothing else. It registers, for each model type in `SERVED`, the class of
`vllm_models.py` under the name `Occult<Base>` (what a pruned checkpoint's config.json names, see
`occult_ft.checkpoint.remote_code.write_remote_code`) and under vLLM's own name `<Base>` (checkpoints of
earlier releases; a model without an active budget is served as stock vLLM serves it, OLMoE with its
tied embeddings honoured). Imports of vLLM happen when vLLM loads a class, not here.

A checkpoint whose type is not in `SERVED` keeps the `Occult<Base>` name stock vLLM refuses:
"Model architectures ['Occult...'] are not supported".
"""

from __future__ import annotations

__all__ = ["SERVED", "register"]

#: model type -> vLLM's (and transformers') causal-LM class name of the types the plugin serves
SERVED = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
_MODELS = "occult_ft.serving.vllm_models"


def register() -> None:
    """Register the served classes with vLLM's `ModelRegistry` (lazily: `module:Class` strings)."""
    from vllm import ModelRegistry

    for base in SERVED.values():
        for name in (f"Occult{base}", base):
            ModelRegistry.register_model(name, f"{_MODELS}:Occult{base}")
