"""The fused experts module of an MoE layer, seen through PEFT's wrappers.

PEFT's LoRA on fused expert tensors (`target_parameters`) wraps the transformers experts module in
`ParamWrapper`s (`experts.base_layer.base_layer` is then the transformers module). Code that shards,
gathers or names the fused tensors (`occult_ft.dispatch`, the trainer) works on the wrapped module.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from .registry import MoELayer, base_experts

__all__ = ["base_experts", "experts_state_key"]


def experts_state_key(layer: MoELayer, name: str) -> str:
    """Key of the fused tensor `name` of an MoE layer in the unwrapped model's state dict, e.g.
    `model.layers.0.mlp.experts.gate_up_proj`, or `...experts.base_layer.base_layer.gate_up_proj` under LoRA."""
    path, module = f"{layer.name}.experts", layer.experts
    while module is not base_experts(module):
        path, module = f"{path}.base_layer", cast(nn.Module, module.base_layer)
    return f"{path}.{name}"
