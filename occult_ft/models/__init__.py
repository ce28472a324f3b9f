"""Architecture adapters: the registry of supported HF MoE model types (see `registry.py`)."""

from .registry import (
    MoEArch,
    MoELayer,
    UnsupportedModelError,
    find_moe_layers,
    get_arch,
    register_arch,
    supported_model_types,
    tiny_config,
    unwrap_model,
)

__all__ = [
    "MoEArch",
    "MoELayer",
    "UnsupportedModelError",
    "find_moe_layers",
    "get_arch",
    "register_arch",
    "supported_model_types",
    "tiny_config",
    "unwrap_model",
]
