"""Architecture knowledge: the registry of the transformers MoE family (`registry.py`, entries in
`entries.py`, router conventions in `arch.py`), the family itself as the installed transformers ships it
(`family.py`), the router self-check (`selfcheck.py`), tiny configs (`tiny.py`) and the fused experts
module behind PEFT wrappers (`experts.py`)."""

from .arch import MoEArch, UnsupportedModelError, config_num_experts, config_top_k, text_config
from .experts import base_experts, experts_state_key
from .family import auto_model_class, moe_family
from .registry import (
    CORE_MODEL_TYPES,
    MoELayer,
    find_moe_layers,
    get_arch,
    lookup_arch,
    moe_layer_indices,
    refusal,
    refused_model_types,
    register_arch,
    representative_model_types,
    supported_model_types,
    unwrap_model,
)
from .selfcheck import RouterCheckError, check_layer_routing
from .tiny import tiny_config

__all__ = [
    "auto_model_class",
    "base_experts",
    "experts_state_key",
    "MoEArch",
    "MoELayer",
    "UnsupportedModelError",
    "RouterCheckError",
    "CORE_MODEL_TYPES",
    "check_layer_routing",
    "config_num_experts",
    "config_top_k",
    "find_moe_layers",
    "get_arch",
    "lookup_arch",
    "moe_family",
    "moe_layer_indices",
    "refusal",
    "refused_model_types",
    "register_arch",
    "representative_model_types",
    "supported_model_types",
    "text_config",
    "tiny_config",
    "unwrap_model",
]
