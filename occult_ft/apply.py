"""Applying a placement and a budget to a model: the one place that turns a plain MoE into an Occult one.

Commands (`prune`, `analyze`, `bench`), the trainer, the demo and the checkpoint loader all call
these functions instead of permuting and pruning by hand:

    resolve_placement(spec, model, devices)    a `Placement` from a JSON path / 'sequential' / object,
                                               checked against the model and the device count
    profile_similarity(path, model)            a saved profile's similarity tables, checked against the model
    placed_similarity(similarity, placement)   the profile's (E, E) tables reordered into placed order
    apply_occult(model, placement, pruning,    permute the experts (placement), install the pruned
                 similarity)                   routers (budget) and record both in the model's
                                               config (`OccultBlock`): `model.save_pretrained` then
                                               writes a complete pruned checkpoint
    placed_copy(model, placement, pruning)     the same on a deep copy with its own routers
    permute_state_dict(model, state, placement, inverse=False)
                                               the same permutation on a state dict, PEFT LoRA factors
                                               of the fused experts and router copies included

Similarity tables come in one of two orders: the *original* expert order (a fresh profile) or the
*placed* order (saved beside a checkpoint). `apply_occult` takes `similarity_placed` to say which.
"""

from __future__ import annotations

import copy
import os
import re

import torch
from torch import nn

from .checkpoint.format import CheckpointError, OccultBlock, PlacementRecord, model_block
from .checkpoint.save import record_block
from .models.registry import find_moe_layers, get_arch, unwrap_model
from .placement import Placement, permute_experts, sequential_placement
from .profiling import Profile
from .routing import PruningConfig, apply_pruning, remove_pruning

__all__ = [
    "resolve_placement",
    "profile_similarity",
    "placed_similarity",
    "apply_occult",
    "placed_copy",
    "permute_state_dict",
]


def resolve_placement(spec, model: nn.Module, devices: int | None = None):
    """A `Placement` for `model` from a JSON path, `"sequential"` (needs `devices`) or a `Placement`.

    Raises:
        ValueError: the placement does not fit the model, or disagrees with `devices`.
    """

    layers = find_moe_layers(model)
    num_experts, indices = layers[0].num_experts, [layer.index for layer in layers]
    model_type = get_arch(unwrap_model(model)).model_type
    if isinstance(spec, str) and spec == "sequential":
        if devices is None:
            raise ValueError("placement 'sequential' needs the device count: pass --devices D")
        return sequential_placement(num_experts, devices, indices, model_type=model_type)
    placement = Placement.load(spec) if isinstance(spec, (str, os.PathLike)) else spec
    placement.check_model(num_experts, indices, model_type)
    if devices is not None and placement.num_devices != devices:
        raise ValueError(
            f"devices={devices} disagrees with the placement's {placement.num_devices} devices; "
            f"use {placement.num_devices} or make a placement for {devices}"
        )
    return placement


def profile_similarity(profile_path: str | None, model: nn.Module) -> dict[int, torch.Tensor]:
    """The similarity tables (original expert order) of a saved profile, checked against `model`."""

    if profile_path is None:
        raise ValueError(
            "criterion 'similarity' needs a profile: pass --profile PROFILE (from occult-ft profile)"
        )
    profile = Profile.load(profile_path)
    layers = find_moe_layers(model)
    profile.check_model(
        layers[0].num_experts, [layer.index for layer in layers], get_arch(unwrap_model(model)).model_type
    )
    return profile.similarity()


def placed_similarity(
    similarity: dict[int, torch.Tensor] | None, placement, inverse: bool = False
) -> dict[int, torch.Tensor] | None:
    """Reorder (E, E) similarity tables from the original expert order into `placement`'s placed order
    (`sim[order][:, order]`, order = original id of each placed slot; `inverse=True`: from the placed
    order back to the original one). None stays None."""
    if similarity is None or placement is None:
        return similarity
    out = {}
    for i, sim in similarity.items():
        order = placement.expert_order(i).to(sim.device)
        if inverse:
            order = torch.argsort(order)
        out[i] = sim.index_select(0, order).index_select(1, order)
    return out


def apply_occult(
    model: nn.Module,
    placement=None,
    pruning: PruningConfig | None = None,
    similarity: dict[int, torch.Tensor] | None = None,
    *,
    similarity_placed: bool = False,
    expert_device: dict[int, torch.Tensor] | None = None,
    device_bias: dict[int, torch.Tensor] | None = None,
) -> nn.Module:
    """Permute `model`'s experts by `placement` and install pruned routers for `pruning`, in place, and
    record both in the model's config (an `OccultBlock`), so that `model.save_pretrained` /
    `push_to_hub` write a complete pruned checkpoint (weights, block, similarity tables, remote code,
    card) that `occult_ft.from_pretrained` loads with the same routing.

    Args:
        model: a supported transformers MoE model (PEFT/DDP wrappers are unwrapped).
        placement: a `Placement` (original ids per device) or None when the experts stay where they are.
        pruning: the budget; None leaves the routers alone (a placement-only model).
        similarity: layer -> (E, E) tables, in the original order unless `similarity_placed`.
        similarity_placed: the tables are already in placed order (read from a checkpoint).
        expert_device: layer -> (E,) device of each expert, default contiguous blocks.
        device_bias: layer -> (D,) selection bias per device of the pruned routers (a checkpoint's,
            or zeros to start device balancing); None keeps the routers' current bias, {} removes it.

    Returns:
        `model` (the same object).
    """

    base = unwrap_model(model)
    block = _block_after(base, placement, pruning, device_bias)
    if placement is not None:
        permute_experts(base, placement)
        if not similarity_placed:
            similarity = placed_similarity(similarity, placement)
    if pruning is not None:
        if pruning.active and pruning.criterion == "similarity":
            _check_tables(similarity, find_moe_layers(base)[0].num_experts)
        apply_pruning(
            base, pruning, similarity=similarity, expert_device=expert_device, device_bias=device_bias
        )
    if block is not None:
        record_block(base, block)
    return model


def _block_after(
    base: nn.Module, placement, pruning: PruningConfig | None, device_bias=None
) -> OccultBlock | None:
    """The model's block once `placement` and `pruning` are applied (None when neither is given).

    Raises:
        ValueError: a placement for a model whose block already records one (placements name original
            expert ids: place the original model), or a budget for another device count.
    """
    if placement is None and pruning is None:
        return None
    old = model_block(base)
    changes: dict = {}
    if placement is not None:
        if old is not None and old.placement is not None:
            raise ValueError(
                f"this model is already placed ({old.placement.algorithm} placement on {old.num_devices} "
                "devices, recorded in its occult block); a placement names original expert ids: apply it "
                f"to the original model ({old.base_model or 'its base model'})"
            )
        record = PlacementRecord.from_placement(placement)
        changes.update(
            placement=record, placed=True, num_devices=placement.num_devices, num_nodes=placement.num_nodes
        )
    if pruning is not None:
        budget = OccultBlock.build(pruning).pruning
        changes.update(pruning=budget, num_devices=pruning.num_devices, num_nodes=pruning.num_nodes)
        kept = old.device_bias if old is not None and old.num_devices == pruning.num_devices else None
        bias = OccultBlock.bias_values(device_bias) if device_bias is not None else kept
        changes["device_bias"] = bias if budget is not None else None
    try:
        if old is None:
            name = getattr(base.config, "_name_or_path", None) or None
            return OccultBlock(base_model=name, model_type=get_arch(base).model_type, **changes)
        return old.with_changes(**changes)
    except CheckpointError as err:
        placed_for = old.num_devices if old is not None else None
        raise ValueError(
            f"this model is placed for {placed_for} devices; apply a budget and placement for {placed_for} "
            f"devices ({err})"
        ) from None


def _check_tables(similarity: dict[int, torch.Tensor] | None, num_experts: int) -> None:
    """Similarity tables must be finite (E, E) matrices: a NaN table would replace experts at random."""
    for i, table in (similarity or {}).items():
        if tuple(table.shape) != (num_experts, num_experts):
            raise ValueError(
                f"similarity table of MoE layer {i} has shape {tuple(table.shape)}, expected "
                f"({num_experts}, {num_experts}); re-profile this model (occult-ft profile)"
            )
        if not torch.isfinite(table).all():
            raise ValueError(
                f"similarity table of MoE layer {i} holds NaN or infinite values; re-profile the model "
                "(occult-ft profile) or use criterion='score'"
            )


def placed_copy(
    model: nn.Module,
    placement,
    pruning: PruningConfig | None = None,
    similarity: dict[int, torch.Tensor] | None = None,
    *,
    similarity_placed: bool = False,
) -> nn.Module:
    """A deep copy of `model` with its routers reset, then placed and pruned by `apply_occult`."""
    placed = copy.deepcopy(model)
    remove_pruning(placed)
    block = model_block(placed)
    if block is not None:
        record_block(placed, block.with_changes(pruning=None, device_bias=None))
    return apply_occult(placed, placement, pruning, similarity, similarity_placed=similarity_placed)


def permute_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], placement, inverse: bool = False
) -> dict[str, torch.Tensor]:
    """`state` (a state dict of `model`, possibly PEFT-wrapped) with every expert-indexed tensor reordered
    as `permute_experts` reorders the live model (`inverse=True`: back to the original order).

    Expert-indexed tensors, found under each MoE block's name (`...layers.3.mlp`):
      - the router's parameters and buffers named by the registry (`gate.weight`, DeepSeek-V3's
        `e_score_correction_bias`, GPT-OSS `router.bias`), also PEFT's `original_module` /
        `modules_to_save` copies of the router, and the block's own (MiniMax-M2's bias): the expert dim
        of `MoELayer.expert_tensors`;
      - the fused expert tensors (`experts.gate_up_proj`, ...), also under PEFT's `base_layer`: dim 0;
      - PEFT LoRA factors of the fused expert tensors (`target_parameters`): `lora_A.weight` is
        (r*E, in) with expert-major rows, reshaped (E, r, in); `lora_B.weight` is (out, r*E) with
        expert-minor columns, reshaped (out, r, E).
    Other tensors are returned as they are (the same objects).
    """
    layers = find_moe_layers(model)
    e = layers[0].num_experts
    out = dict(state)
    for layer in layers:
        order = placement.expert_order(layer.index)
        if inverse:
            order = torch.argsort(order)
        block = re.escape(layer.name.split("model.", 1)[-1] if "model." in layer.name else layer.name)
        router_attr = re.escape(layer.arch.router_attr)
        patterns = []  # (regex, expert dim) of every expert-indexed tensor of the layer
        for kind, path, dim in layer.expert_tensors():
            name = re.escape(path.split(".", 1)[1] if kind != "block" else path)
            if kind == "router":
                patterns.append((rf"(^|\.){block}\.{router_attr}\.(?:[\w.]*\.)?{name}$", dim))
            elif kind == "experts":
                patterns.append((rf"(^|\.){block}\.experts\.(?:base_layer\.)*{name}$", dim))
            else:
                patterns.append((rf"(^|\.){block}\.{name}$", dim))
        lora = rf"(^|\.){block}\.experts\.(?:base_layer\.)*lora_([AB])\.(?:[\w]+\.)?weight$"
        for key, tensor in state.items():
            expert_dim = next((d for pattern, d in patterns if re.search(pattern, key)), None)
            if expert_dim is not None:
                if tensor.shape[expert_dim] != e:
                    raise ValueError(
                        f"{key} has {tensor.shape[expert_dim]} rows, expected {e} experts; is it sharded?"
                    )
                out[key] = tensor.index_select(expert_dim, order.to(tensor.device))
                continue
            match = re.search(lora, key)
            if match is None:
                continue
            if match.group(2) == "A":
                rows = tensor.reshape(e, -1, tensor.shape[-1])
                out[key] = rows.index_select(0, order.to(tensor.device)).reshape(tensor.shape)
            else:
                cols = tensor.reshape(tensor.shape[0], -1, e)
                out[key] = cols.index_select(2, order.to(tensor.device)).reshape(tensor.shape)
    return out
