"""The transformers MoE family: every model type whose experts module takes the standard call.

transformers 5.x marks each fused experts class with `@use_experts_implementation`; such a module is
called as `experts(hidden_states, top_k_index, top_k_weights)` and can run any registered experts
kernel, occult_ft's expert-parallel "occult_ep" included. `moe_family()` finds those model types in the
installed transformers by reading the source of `transformers.models.*` (nothing is imported, so it
takes well under a second and is cached): the modeling files that use the decorator, and the model
types their configuration files declare that load as a causal or image-text-to-text language model
(plus the folder's own model type, so that a type loading otherwise is listed, and refused, too).

The registry (`occult_ft.models.registry`) must say, for every one of them, either how it routes (a
`MoEArch` entry) or why it is refused; `tests/test_family.py` holds it to that.
"""

from __future__ import annotations

import functools
import os
import re

from .arch import UnsupportedModelError

__all__ = [
    "PUBLISHED_AS",
    "moe_family",
    "loads_as",
    "auto_model_class",
    "architecture_model_type",
    "VLLM_SERVED",
]

#: the model types whose pruned routing occult_ft's vLLM plugin serves (`occult_ft.serving`), with
#: vLLM's (and transformers') causal-LM class of each; the model card offers vLLM for these only
VLLM_SERVED = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

_DECORATOR = re.compile(r"^@use_experts_implementation\b", re.MULTILINE)
_MODEL_TYPE = re.compile(r'^\s+model_type(?:\s*:\s*str)?\s*=\s*"([^"]+)"', re.MULTILINE)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=1)
def _scan() -> dict[str, str]:
    """model type -> its transformers.models folder, for every folder with standard experts."""
    import transformers.models
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out: dict[str, str] = {}
    root = os.path.dirname(transformers.models.__file__)
    for folder in sorted(os.listdir(root)):
        modeling = os.path.join(root, folder, f"modeling_{folder}.py")
        if not os.path.isfile(modeling) or not _DECORATOR.search(_read(modeling)):
            continue
        configuration = os.path.join(root, folder, f"configuration_{folder}.py")
        declared = _MODEL_TYPE.findall(_read(configuration)) if os.path.isfile(configuration) else []
        types = [t for t in declared if loads_as(t) is not None]
        if folder in CONFIG_MAPPING_NAMES and folder not in types:
            types.append(folder)
        for model_type in types:
            out.setdefault(model_type, folder)
    return out


def moe_family() -> list[str]:
    """Sorted model types of the installed transformers with `@use_experts_implementation` experts."""
    return sorted(_scan())


def loads_as(model_type: str) -> str | None:
    """`"causal_lm"` when `AutoModelForCausalLM` builds `model_type`, `"image_text_to_text"` when only
    `AutoModelForImageTextToText` does, else None."""
    from transformers.models.auto import modeling_auto

    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal_lm"
    if model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return "image_text_to_text"
    return None


def auto_model_class(config_or_type):
    """The transformers auto class that builds a model type's language model with its head:
    `AutoModelForCausalLM`, or `AutoModelForImageTextToText` for a multimodal type that only it loads
    (Qwen3-VL-MoE, GLM-4.5V, Mistral Large 3, ...). Accepts a config, a config.json dict or a type."""
    import transformers

    model_type: str | None
    if isinstance(config_or_type, str):
        model_type = config_or_type
    elif isinstance(config_or_type, dict):
        model_type = config_or_type.get("model_type")
    else:
        model_type = getattr(config_or_type, "model_type", None)
    if model_type and loads_as(model_type) == "image_text_to_text":
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


#: Model types that transformers does not know, published with the config of a transformers architecture,
#: read as that architecture without remote code (Kimi-K2's config.json says `kimi_k2` and names
#: `DeepseekV3ForCausalLM`). Any other type transformers does not know is refused: add a type here only
#: when its config and weights are exactly the named architecture's.
PUBLISHED_AS = {"kimi_k2": "deepseek_v3"}


def architecture_model_type(config: dict, source: str = "config.json") -> str | None:
    """The transformers model type a config.json (dict) is read as when its own `model_type` is not one
    transformers knows: a `PUBLISHED_AS` type's architecture (`kimi_k2` -> `deepseek_v3`). None when the
    config's own type is a transformers type. `source` names the file in messages.

    Raises:
        UnsupportedModelError: one line naming a `model_type` that is missing, not a string or neither a
            transformers type nor in `PUBLISHED_AS` (nothing is read or copied from such a config).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES:
        return None
    if isinstance(model_type, str) and model_type in PUBLISHED_AS:
        return PUBLISHED_AS[model_type]
    if model_type is None:
        raise UnsupportedModelError(
            f'{source} has no model_type; it must name the model\'s transformers type, e.g. "olmoe"'
        )
    shown = repr(model_type)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise UnsupportedModelError(
        f"{source}: model_type {shown} is not a model type transformers knows (nor one occult_ft reads "
        f"as one: {', '.join(sorted(PUBLISHED_AS))}); set model_type in config.json to the model's "
        'transformers type, e.g. "olmoe" (occult_ft.models.supported_model_types() lists the types occult_ft supports)'
    )
