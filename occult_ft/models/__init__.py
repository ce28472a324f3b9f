"""Architecture knowledge: the registry of supported HF MoE model types (`registry.py`) and the fused
experts module behind PEFT wrappers (`experts.py`)."""

from .experts import base_experts, experts_state_key
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
    "base_experts",
    "experts_state_key",
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
