"""Applying a placement to a model: `permute_experts` reorders every MoE layer's expert-indexed weights so
that device d holds the contiguous new ids [d*E/D, (d+1)*E/D); the model computes the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import find_moe_layers
from .core import PlacementError, shown
from .file import Placement

__all__ = ["permute_experts"]


def _check_group_routing(layer, order_E: torch.Tensor) -> None:
    """DeepSeek group-limited routing scores contiguous blocks of experts; a permutation that mixes them
    would change the model, so only block-preserving placements are allowed there."""
    size = layer.arch.routing_group_size(layer.router)
    if size == 1:
        return
    num_group = layer.num_experts // size
    blocks = {frozenset(range(g * size, (g + 1) * size)) for g in range(num_group)}
    # the new block j holds original experts order_E[j*size:(j+1)*size]: each must be one whole old block
    # (blocks may change places; the router's group scores then follow them)
    moved = {frozenset(order_E[j * size : (j + 1) * size].tolist()) for j in range(num_group)}
    if moved != blocks:
        raise PlacementError(
            f"layer {layer.index} routes within {num_group} expert groups of {size} (group-limited routing) and "
            "this placement mixes them, which would change the model; place from a profile of this model "
            "(placement then moves whole groups), or use placement 'sequential'"
        )


@torch.no_grad()
def permute_experts(model: nn.Module, placement: Placement) -> None:
    """Reorder every MoE layer's expert-indexed tensors in place so that device d holds the contiguous new
    ids [d*E/D, (d+1)*E/D). The model computes the same function (same outputs) afterwards.

    Args:
        model: a supported transformers MoE model (PEFT/DDP wrappers are unwrapped).
        placement: a `Placement` matching the model (`check_model` is called first).
    """
    if not isinstance(placement, Placement):
        raise PlacementError(
            f"placement is a {type(placement).__name__} ({shown(placement)}); pass a Placement "
            "(Placement.load(PATH) of `occult-ft place`'s file, or compute_placement's result)"
        )
    layers = find_moe_layers(model)
    placement.check_model(layers[0].num_experts, [layer.index for layer in layers], layers[0].arch.model_type)
    for layer in layers:
        order_E = placement.expert_order(layer.index)
        _check_group_routing(layer, order_E)
        for _, path, dim in layer.expert_tensors():
            tensor = layer.tensor(path)
            if tensor.shape[dim] != placement.num_experts:
                raise PlacementError(
                    f"layer {layer.index} {path} has {tensor.shape[dim]} rows on dim {dim}, expected "
                    f"{placement.num_experts} experts; is this model sharded already?"
                )
            # new expert j = original order_E[j] along the expert dim (the router's rows included, so each
            # token still picks the same experts under their new ids); index_select copies first, so the
            # in-place write reads no row it already overwrote
            tensor.copy_(tensor.index_select(dim, order_E.to(tensor.device)))
