"""Turn a plain MoE model into the model an Occult run trains: placed, pruned, recording, trainable.

`prepare_model(model, args, ...)` runs, in order:

1. **placement** (skipped when the model is already placed: a pruned checkpoint whose `occult` block
   says `placed: true`, or an occult_ft LoRA model): `auto` profiles the training data and calls
   `compute_placement`; a JSON path is loaded and checked; `sequential` keeps the expert order. A
   checkpoint being resumed dictates the placement instead, so a resumed run never re-profiles into a
   different expert order. `permute_experts` then makes each device's experts contiguous.
2. **similarity tables** for `criterion="similarity"`: the profile's cosine table permuted into the
   placed order (`sim[order][:, order]`), read from the resumed checkpoint, kept from an already pruned
   model, or profiled on the placed model.
3. **pruning**: `apply_pruning` is always called, so routing metrics exist for unpruned runs too
   (budget None = the router only records). The model's own auxiliary loss is switched off.
4. **what trains**: `full`, `moe` (MoE blocks only) or `lora` (`occult_ft.integrations.peft`).

The returned `OccultSetup` is what the trainer needs later: placement provenance for checkpoints, the
pruning config, the similarity tables and each layer's expert -> device map.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from ..checkpoint import ADAPTER_OCCULT_FILE, OCCULT_KEY, SIMILARITY_FILE
from ..data.batching import profile_batches  # the batching lives in occult_ft.data
from ..metrics import contiguous_expert_device
from ..models.registry import find_moe_layers, get_arch, unwrap_model
from ..routing import PruningConfig, apply_pruning, pruned_routers, set_recording

logger = logging.get_logger(__name__)

__all__ = [
    "OccultSetup",
    "prepare_model",
    "profile_batches",
    "read_checkpoint_setup",
    "placement_from_block",
    "resolve_checkpoint",
    "set_train_mode",
]


@dataclass
class OccultSetup:
    """What `prepare_model` did to a model.

    Args:
        pruning: the pruning config installed on every router.
        placement: the placement applied (original expert ids per device), None when unknown (a placed
            checkpoint without provenance).
        similarity: layer index -> (E, E) similarity in placed order, or None.
        expert_device: layer index -> (E,) device of each (placed) expert: contiguous blocks.
        base_placed: whether the base weights on disk are already placed (LoRA adapters then must not
            permute the base again when loaded).
        base_model: name or path of the base model (informational).
    """

    pruning: PruningConfig
    placement: object | None
    similarity: dict[int, torch.Tensor] | None
    expert_device: dict[int, torch.Tensor]
    base_placed: bool
    base_model: str | None = None


# ---- checkpoints ---------------------------------------------------------------------------------
def resolve_checkpoint(resume, output_dir: str | None) -> str | None:
    """A checkpoint directory from a `resume_from_checkpoint` value (path, True/"true"/"last" = newest
    `checkpoint-N` under `output_dir`, None/False = none)."""
    if resume is None or resume is False or resume == "":
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "last")):
        from transformers.trainer_utils import get_last_checkpoint

        if not output_dir or not os.path.isdir(output_dir):
            return None
        return get_last_checkpoint(output_dir)
    path = str(resume)
    if not os.path.isdir(path):
        raise ValueError(
            f"resume_from_checkpoint={path!r} is not a checkpoint directory; pass a checkpoint-N directory or true"
        )
    return path


def read_checkpoint_setup(path: str) -> tuple[dict, dict[int, torch.Tensor] | None]:
    """The `occult` block and the similarity tables of a checkpoint or LoRA adapter directory."""
    block = {}
    occult_file = os.path.join(path, ADAPTER_OCCULT_FILE)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(occult_file):
        with open(occult_file) as f:
            block = json.load(f)
    elif os.path.isfile(config_file):
        with open(config_file) as f:
            block = json.load(f).get(OCCULT_KEY) or {}
    similarity = None
    sim_file = os.path.join(path, SIMILARITY_FILE)
    if os.path.isfile(sim_file):
        from safetensors.torch import load_file

        similarity = {int(k.split(".")[1]): v for k, v in load_file(sim_file).items()}
    return block, similarity


def placement_from_block(block: dict | None, model: nn.Module):
    """The `Placement` recorded in an `occult` block (None when it records none)."""
    if not block or not block.get("placement"):
        return None
    from ..placement import Placement

    layers = {int(k): v for k, v in block["placement"]["layers"].items()}
    first = next(iter(layers.values()))
    return Placement(
        model=block.get("base_model"),
        model_type=get_arch(unwrap_model(model)).model_type,
        num_experts=sum(len(g) for g in first),
        num_devices=len(first),
        num_nodes=int(block.get("num_nodes", 1)),
        algorithm=block["placement"].get("algorithm", "unknown"),
        groups=layers,
        metrics={},
    )


# ---- profiling -------------------------------------------------------------------------------------
def _profile(model, dataset, collate, args, name: str):
    from ..profiling import profile_model

    if dataset is None:
        raise ValueError(
            "placement='auto' and criterion='similarity' profile the training data, but no train_dataset was "
            "given; pass one, a placement file, or placement='sequential' with criterion='score'"
        )
    was_training = model.training
    batches = profile_batches(dataset, collate, max(1, int(args.per_device_train_batch_size)))
    profile = profile_model(
        model, batches, model_name=name, max_tokens=args.profile_tokens, progress=not args.disable_tqdm
    )
    model.train(was_training)
    return profile


def _broadcast(obj):
    """Rank 0's object on every process (profiling on GPUs may differ in the last bit between ranks)."""
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src=0)
        return holder[0]
    return obj


# ---- what trains ------------------------------------------------------------------------------------
def set_train_mode(model: nn.Module, mode: str) -> None:
    """`full`: every parameter trains; `moe`: only the MoE blocks (routers, routed and shared experts)."""
    base = unwrap_model(model)
    if mode == "full":
        for p in base.parameters():
            p.requires_grad_(True)
    elif mode == "moe":
        for p in base.parameters():
            p.requires_grad_(False)
        for layer in find_moe_layers(base):
            for p in layer.block.parameters():
                p.requires_grad_(True)
    else:
        raise ValueError(
            f"train_mode={mode!r}: set_train_mode handles 'full' and 'moe' (lora goes through PEFT)"
        )


def _disable_model_aux_loss(base: nn.Module) -> None:
    """The model's own balance loss ignores pruning: turn it off (the trainer adds the pruning-aware one)."""
    if hasattr(base, "router_aux_loss_coef"):
        base.router_aux_loss_coef = 0.0


# ---- the whole preparation ------------------------------------------------------------------------------
def prepare_model(
    model: nn.Module,
    args,
    train_dataset=None,
    collate=None,
    placement=None,
    checkpoint: str | None = None,
) -> tuple[nn.Module, OccultSetup]:
    """Place, prune and set up training of `model` as `args` (an `OccultConfig`) says.

    Args:
        model: a supported transformers MoE model, a pruned occult_ft checkpoint, or an occult_ft LoRA model.
        args: the run's `OccultConfig`.
        train_dataset: tokenized training rows, profiled for `placement="auto"` / similarity tables.
        collate: batches rows for profiling (`occult_ft.data.make_collator`).
        placement: a `Placement` object overriding `args.placement`.
        checkpoint: a checkpoint being resumed: its placement and similarity tables are used.

    Returns:
        (model, setup): the model to train (a `PeftModel` for `train_mode="lora"`) and its `OccultSetup`.
    """
    from ..integrations.peft import apply_lora, is_peft_model
    from ..placement import Placement, compute_placement, permute_experts, sequential_placement

    base = unwrap_model(model)
    arch = get_arch(base)
    layers = find_moe_layers(base)
    num_experts, top_k = layers[0].num_experts, layers[0].top_k
    indices = [layer.index for layer in layers]
    block = getattr(base.config, OCCULT_KEY, None) or {}
    if args.max_devices_per_token is None and block.get("max_devices_per_token") is not None:
        # continuing from a pruned checkpoint: its budget stays unless the run sets one
        args.max_devices_per_token = int(block["max_devices_per_token"])
        args.criterion = block.get("criterion", args.criterion)
        args.gate_weights = block.get("gate_weights", args.gate_weights)
        logger.warning(
            f"{getattr(base.config, '_name_or_path', 'the model')} is pruned to {args.max_devices_per_token} devices "
            f"per token ({args.criterion}); training keeps that budget (set max_devices_per_token to change it)"
        )
    pruning = PruningConfig(args.devices, args.max_devices_per_token, args.criterion, args.gate_weights)
    pruning.check(num_experts, top_k)
    peft_model = is_peft_model(model)
    if peft_model and args.train_mode != "lora":
        raise ValueError(
            f"train_mode={args.train_mode!r} but the model is a LoRA (PEFT) model; set train_mode='lora'"
        )
    name = getattr(base.config, "_name_or_path", None) or getattr(base, "name_or_path", None)

    ckpt_block, ckpt_similarity = read_checkpoint_setup(checkpoint) if checkpoint else ({}, None)
    already_placed = bool(block.get("placed")) or (peft_model and bool(block))
    similarity = None
    profile = None
    if already_placed:
        placed_devices = block.get("num_devices")
        if placed_devices is not None and int(placed_devices) != args.devices:
            raise ValueError(
                f"devices={args.devices} but this checkpoint is placed for {placed_devices} devices; set devices={placed_devices}"
            )
        if placement is not None:
            raise ValueError(
                "this model is already placed (its occult block says so); drop the placement argument"
            )
        placement = placement_from_block(block, base)
        existing = {layer.index: layer.router._buffers.get("occult_similarity") for layer in layers}
        if all(v is not None for v in existing.values()):
            similarity = {k: v.detach().float().cpu() for k, v in existing.items()}
        elif name and os.path.isdir(name):
            similarity = read_checkpoint_setup(name)[1]
        name = block.get("base_model") or name
    else:
        if ckpt_block.get("placement"):
            placement = placement_from_block(ckpt_block, base)
        elif placement is None:
            if args.placement == "sequential":
                placement = sequential_placement(
                    num_experts, args.devices, indices, model=name, model_type=arch.model_type
                )
            elif args.placement == "auto":
                profile = _profile(base, train_dataset, collate, args, name or "model")
                placement = _broadcast(
                    compute_placement(profile, args.devices, args.nodes, args.placement_algorithm)
                )
            else:
                placement = Placement.load(args.placement)
        if isinstance(placement, (str, os.PathLike)):
            placement = Placement.load(placement)
        placement.check_model(num_experts, indices, arch.model_type)
        if placement.num_devices != args.devices:
            raise ValueError(
                f"devices={args.devices} but the placement puts experts on {placement.num_devices} devices; "
                f"set devices={placement.num_devices} or make a placement for {args.devices}"
            )
        permute_experts(base, placement)
        if profile is not None:
            similarity = {
                i: s[placement.expert_order(i)][:, placement.expert_order(i)]
                for i, s in profile.similarity().items()
            }
    if ckpt_similarity is not None:
        similarity = ckpt_similarity
    if pruning.criterion == "similarity" and pruning.active and similarity is None:
        similarity = _broadcast(_profile(base, train_dataset, collate, args, name or "model").similarity())

    apply_pruning(base, pruning, similarity=similarity)
    _disable_model_aux_loss(base)
    if args.train_mode == "lora" and not peft_model:
        model = apply_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout)
    elif args.train_mode != "lora":
        set_train_mode(model, args.train_mode)
    set_recording(model, True, keep_graph=args.balance_loss_coef > 0)
    expert_device = {
        layer.index: router.occult_expert_device.detach().clone() for layer, router in pruned_routers(model)
    }
    setup = OccultSetup(
        pruning=pruning,
        placement=placement,
        similarity=similarity,
        expert_device=expert_device
        or {i: contiguous_expert_device(num_experts, args.devices) for i in indices},
        base_placed=bool(block.get("placed")),
        base_model=name,
    )
    return model, setup
