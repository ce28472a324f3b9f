"""occult_ft's vLLM plugin: `register`, the `vllm.general_plugins` entry point (pyproject.toml).

vLLM calls `register()` in every process it starts, before it reads a model; with occult_ft installed
in vLLM's environment, `vllm serve DIR` and `vllm.LLM(DIR)` then serve a pruned checkpoint with its
pruned routing and need nothing else. It registers, for each model type in `SERVED`, the class of
`vllm_models.py` under the name `Occult<Base>` (what a pruned checkpoint's config.json names, see
`occult_ft.checkpoint.remote_code.write_remote_code`) and under vLLM's own name `<Base>` (checkpoints of
earlier releases; a model without an active budget is served as stock vLLM serves it, OLMoE with its
tied embeddings honoured). Imports of vLLM happen when vLLM loads a class, not here.

Refusals happen when vLLM reads the configuration (in the process that calls `LLM(...)` or
`vllm serve`, before any engine starts), each in one line:

- a checkpoint of a served type whose routing the plugin cannot build (an unknown criterion, the
  `similarity` criterion without its tables, a LoRA adapter in the base order, ...): `CheckpointError`
  from `ServedRouting.from_checkpoint`, checked by a per-architecture config hook (`_CheckedConfig`,
  vLLM's `MODELS_CONFIG_MAP`, chained to vLLM's own hook for the base class where it has one);
- a pruned checkpoint of a type the plugin does not serve (`Occult<Base>` with no served class):
  `unserved_refusal`, in place of vLLM's "not supported" message listing every architecture it knows.
"""

from __future__ import annotations

from ..checkpoint.remote_code import remote_class_name
from ..models.family import VLLM_SERVED
from ..models.registry import supported_model_types
from .routing import ServedRouting

__all__ = ["SERVED", "register", "unserved_refusal"]

#: model type -> vLLM's (and transformers') causal-LM class name of the types the plugin serves
SERVED = VLLM_SERVED
_MODELS = "occult_ft.serving.vllm_models"
_PREFIX = "Occult"


def unserved_refusal(architecture: str) -> str | None:
    """The one-line refusal of a pruned checkpoint naming `architecture` (`Occult<Base>`) that the
    plugin does not serve, or None for any other architecture name."""
    if not architecture.startswith(_PREFIX) or architecture[len(_PREFIX) :] in SERVED.values():
        return None
    types = [t for t in supported_model_types() if _remote_name(remote_class_name, t) == architecture]
    what = f"model type {types[0]!r}" if types else f"architecture {architecture!r}"
    return (
        f"{architecture}: occult_ft's vLLM plugin does not serve the pruned routing of {what} (it serves "
        f"{', '.join(SERVED)}); serve this checkpoint with occult_ft.from_pretrained(DIR) or transformers' "
        "trust_remote_code=True"
    )


def _remote_name(remote_class_name, model_type: str) -> str | None:
    try:
        return remote_class_name(model_type)
    except (KeyError, ValueError):  # a type without a causal-LM class
        return None


class _CheckedConfig:
    """vLLM's per-architecture config hooks (`MODELS_CONFIG_MAP`): refuse, while vLLM reads the model's
    config in the calling process, a checkpoint whose pruned routing cannot be built. `base` is vLLM's
    own hook for the stock class (run first), or None."""

    base = None

    @classmethod
    def verify_and_update_model_config(cls, model_config) -> None:
        if cls.base is not None:
            cls.base.verify_and_update_model_config(model_config)
        ServedRouting.from_checkpoint(model_config.model, model_config.hf_config, model_config.revision)

    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        if cls.base is not None:
            cls.base.verify_and_update_config(vllm_config)


def _refuse_unserved(registry) -> None:
    """Wrap the registry's "not supported" error so an `Occult<Base>` name gets `unserved_refusal`."""
    stock = registry._raise_for_unsupported
    if getattr(stock, "occult_ft", False):
        return

    def refuse(architectures):
        for arch in architectures:
            message = unserved_refusal(arch)
            if message is not None:
                raise ValueError(message)
        return stock(architectures)

    refuse.occult_ft = True  # type: ignore[attr-defined]
    registry._raise_for_unsupported = refuse


def register() -> None:
    """Register the served classes with vLLM's `ModelRegistry` (lazily: `module:Class` strings), their
    config hooks, and the one-line refusal of the pruned types it does not serve."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for base in SERVED.values():
        for name in (f"{_PREFIX}{base}", base):
            ModelRegistry.register_model(name, f"{_MODELS}:{_PREFIX}{base}")
            if getattr(MODELS_CONFIG_MAP.get(name), "occult_ft", False):
                continue
            MODELS_CONFIG_MAP[name] = type(
                f"Checked{base}", (_CheckedConfig,), {"base": MODELS_CONFIG_MAP.get(base), "occult_ft": True}
            )
    _refuse_unserved(ModelRegistry)
