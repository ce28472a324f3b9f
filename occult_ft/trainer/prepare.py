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

import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from ..apply import apply_occult, placed_similarity, resolve_placement
from ..checkpoint import block_placement, model_block, read_block, read_similarity
from ..checkpoint.load import describe_budget
from ..checkpoint.sharded import place_sharded
from ..data.batching import profile_batches  # the batching lives in occult_ft.data
from ..fileio import read_json_object
from ..integrations.peft import apply_lora, is_peft_model
from ..metrics import contiguous_expert_device
from ..models.registry import find_moe_layers, unwrap_model
from ..placement import PRUNING_CRITERIA, Placement, compute_placement, merge_placements
from ..profiling import profile_model
from ..routing import PruningConfig, pruned_routers, router_device_bias, router_similarity, set_recording
from .checkpointing import check_checkpoint_model
from .config import OccultArguments

logger = logging.get_logger(__name__)

__all__ = [
    "OccultSetup",
    "prepare_model",
    "profile_batches",
    "resolve_checkpoint",
    "checkpoint_is_complete",
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
def checkpoint_is_complete(path: str) -> bool:
    """Trainer writes `trainer_state.json` last in a `checkpoint-N` folder: a folder without a readable
    one was interrupted (killed, full disk) and must not be resumed from."""

    try:
        read_json_object(os.path.join(path, "trainer_state.json"))
    except (OSError, ValueError):
        return False
    return True


def resolve_checkpoint(resume, output_dir: str | None) -> str | None:
    """A checkpoint directory from a `resume_from_checkpoint` value (path, True/"true"/"last" = newest
    complete `checkpoint-N` under `output_dir`, None/False = none). Interrupted checkpoints (no readable
    `trainer_state.json`) are skipped with a warning, or refused when named explicitly."""
    if resume is None or resume is False or resume == "":
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "last")):
        return _newest_complete_checkpoint(output_dir)
    path = str(resume)
    if not os.path.isdir(path):
        raise ValueError(
            f"resume_from_checkpoint={path!r} is not a checkpoint directory; pass a checkpoint-N directory or true"
        )
    if not checkpoint_is_complete(path):
        raise ValueError(
            f"resume_from_checkpoint={path!r} was not written completely (no readable trainer_state.json); "
            "resume from an earlier checkpoint-N or pass true to pick the newest complete one"
        )
    return path


def _newest_complete_checkpoint(output_dir: str | None) -> str | None:
    """The complete `checkpoint-N` of highest N under `output_dir` (interrupted ones skipped with a
    warning); None when there is none."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    found = []
    for name in os.listdir(output_dir):
        step = name.removeprefix("checkpoint-")
        if (
            name.startswith("checkpoint-")
            and step.isdigit()
            and os.path.isdir(os.path.join(output_dir, name))
        ):
            found.append((int(step), os.path.join(output_dir, name)))
    for _, path in sorted(found, reverse=True):
        if checkpoint_is_complete(path):
            return path
        logger.warning(f"skipping {path}: its write was interrupted (no readable trainer_state.json)")
    return None


# ---- profiling -------------------------------------------------------------------------------------
def _profile(model, dataset, collate, args: OccultArguments, name: str):
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


def _distributed() -> bool:
    """A process group of more than one process is running."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def _broadcast(obj):
    """Rank 0's object on every process (profiling on GPUs may differ in the last bit between ranks)."""
    if _distributed():
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src=0)
        return holder[0]
    return obj


def place_across_ranks(profile: Any, *args: Any, **kwargs: Any) -> Placement:
    """`compute_placement` with the layers shared out over the processes (layer i on rank i % world) and
    the shares gathered, so every rank applies the same placement and start-up takes 1/world of the time
    one process would. A rank whose share fails raises on every rank (no rank is left waiting)."""
    if not _distributed():
        return compute_placement(profile, *args, **kwargs)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = sorted(profile.layers)[rank::world]
    share: object = None
    try:
        if mine:
            share = compute_placement(profile, *args, layers=mine, **kwargs)
    except Exception as err:  # noqa: BLE001 - sent to every rank, raised there
        try:
            pickle.dumps(err)
            share = err
        except Exception:  # noqa: BLE001 - an error that cannot travel still stops every rank
            share = RuntimeError(f"rank {rank}: {type(err).__name__}: {err}")
    shares: list = [None] * world
    torch.distributed.all_gather_object(shares, share)
    for failed in shares:
        if isinstance(failed, Exception):
            raise failed
    return merge_placements(s for s in shares if s is not None)


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
            for p in layer.moe_parameters():
                p.requires_grad_(True)
    else:
        raise ValueError(
            f"train_mode={mode!r}: set_train_mode handles 'full' and 'moe' (lora goes through PEFT)"
        )


def _disable_model_aux_loss(base: nn.Module) -> None:
    """The model's own balance loss ignores pruning: turn it off (the trainer adds the pruning-aware one)."""
    if hasattr(base, "router_aux_loss_coef"):
        base.router_aux_loss_coef = 0.0  # type: ignore[assignment]


# ---- the whole preparation ------------------------------------------------------------------------------
def _start_bias(
    base: nn.Module, args, pruning: PruningConfig, ckpt_block, indices: list[int]
) -> dict[int, torch.Tensor] | None:
    """The device bias the run starts from: the block's of a resumed checkpoint (else of the loaded
    model: a shard-wise load restores no router), else the one the loaded model's routers hold, zeros
    where none is held and `device_bias_rate` > 0; None keeps the routers as they are."""
    held = router_device_bias(base) or {}
    if (
        ckpt_block is not None
        and ckpt_block.device_bias is not None
        and ckpt_block.num_devices == args.devices
    ):
        held = ckpt_block.device_bias_tensors() or {}
    if args.device_bias_rate > 0 and pruning.active:
        return {i: held.get(i, torch.zeros(args.devices)) for i in indices}
    return held or None


def prepare_model(
    model: nn.Module,
    args,
    train_dataset=None,
    collate=None,
    placement=None,
    checkpoint: str | None = None,
    peft_config=None,
) -> tuple[nn.Module, OccultSetup]:
    """Place, prune and set up training of `model` as `args` (an `OccultConfig`) says.

    Args:
        model: a supported transformers MoE model, a pruned occult_ft checkpoint, or an occult_ft LoRA model.
        args: the run's `OccultConfig`.
        train_dataset: tokenized training rows, profiled for `placement="auto"` / similarity tables.
        collate: batches rows for profiling (`occult_ft.data.make_collator`).
        placement: a `Placement` object overriding `args.placement`.
        checkpoint: a checkpoint being resumed: its placement and similarity tables are used.
        peft_config: a `peft.PeftConfig` (TRL's `peft_config`) applied after placement and pruning,
            instead of the LoRA config `train_mode="lora"` builds from `lora_r` / `lora_alpha`.

    Returns:
        (model, setup): the model to train (a `PeftModel` for `train_mode="lora"`) and its `OccultSetup`.
    """

    base = unwrap_model(model)
    layers = find_moe_layers(base)
    num_experts = layers[0].num_experts
    block = model_block(base)  # the live model's (experts as in memory)
    adapter_block = getattr(model, "occult_adapter_block", None)  # how a loaded adapter is stored
    pruning = _run_pruning(base, block, args, num_experts, layers[0].top_k)
    peft_model = is_peft_model(model)
    lora = args.train_mode == "lora" or peft_config is not None
    _check_lora_inputs(args, peft_model, lora, peft_config)
    name = getattr(base.config, "_name_or_path", None) or getattr(base, "name_or_path", None)

    if checkpoint:
        check_checkpoint_model(model, checkpoint)  # before its placement is read for this model
    ckpt_block, ckpt_similarity = (
        (read_block(checkpoint), read_similarity(checkpoint)) if checkpoint else (None, None)
    )
    model_type = layers[0].arch.model_type
    if block is not None and block.placed:
        placement, similarity, name = _already_placed(base, block, args, placement, model_type, name)
    else:
        placement, similarity = _place(
            base, args, placement, ckpt_block, model_type, (train_dataset, collate, name)
        )
    if ckpt_similarity is not None:
        similarity = ckpt_similarity
    if pruning.criterion == "similarity" and pruning.active and similarity is None:
        similarity = _broadcast(_profile(base, train_dataset, collate, args, name or "model").similarity())

    bias = _start_bias(base, args, pruning, ckpt_block or block, [layer.index for layer in layers])
    apply_occult(base, pruning=pruning, similarity=similarity, similarity_placed=True, device_bias=bias)
    _disable_model_aux_loss(base)
    model = _set_what_trains(model, args, lora, peft_model, peft_config)
    set_recording(model, True, keep_graph=args.balance_loss_coef > 0)
    base_block = adapter_block or block
    setup = OccultSetup(
        pruning=pruning,
        placement=placement,
        similarity=similarity,
        expert_device=_expert_device(model, num_experts, args.devices, [layer.index for layer in layers]),
        base_placed=base_block.placed if base_block is not None else False,
        base_model=name,
    )
    return model, setup


def _set_what_trains(model: nn.Module, args, lora: bool, peft_model: bool, peft_config) -> nn.Module:
    """LoRA adapters added (a PEFT model keeps its own), or `args.train_mode` set; the model to train."""
    if lora and not peft_model:
        return apply_lora(
            model,
            r=args.lora_r,
            alpha=args.lora_alpha,
            dropout=args.lora_dropout,
            seed=args.seed,
            config=peft_config,
        )
    if not lora:
        set_train_mode(model, args.train_mode)
    return model


def _expert_device(model: nn.Module, num_experts: int, devices: int, indices: list[int]) -> dict:
    """Layer index -> (E,) device of each expert, as the pruned routers hold it (contiguous blocks when
    no router is pruned)."""
    held = {
        layer.index: router.occult_expert_device.detach().clone() for layer, router in pruned_routers(model)
    }
    return held or {i: contiguous_expert_device(num_experts, devices) for i in indices}


def _run_pruning(base: nn.Module, block, args, num_experts: int, top_k: int) -> PruningConfig:
    """The run's pruning: `args`' budget, or when it sets none a pruned checkpoint's (with a warning)."""
    budget, criterion, gate_weights = args.max_devices_per_token, args.criterion, args.gate_weights
    node_budget = getattr(args, "max_nodes_per_token", None)
    saved = block.pruning if block is not None else None
    if budget is None and node_budget is None and saved is not None:
        # continuing from a pruned checkpoint: its budget stays unless the run sets one
        budget, node_budget = saved.max_devices_per_token, saved.max_nodes_per_token
        criterion, gate_weights = saved.criterion, saved.gate_weights
        logger.warning(
            f"{getattr(base.config, '_name_or_path', 'the model')} is pruned to {describe_budget(saved)} "
            f"({criterion}); training keeps that budget (set max_devices_per_token to change it)"
        )
    pruning = PruningConfig(args.devices, budget, criterion, gate_weights, args.nodes, node_budget)
    pruning.check(num_experts, top_k)
    return pruning


def _check_lora_inputs(args, peft_model: bool, lora: bool, peft_config) -> None:
    """A PEFT model trains as LoRA, from its own adapters (no second peft_config)."""
    if peft_model and peft_config is not None:
        raise ValueError(
            "the model is already a LoRA (PEFT) model and a peft_config was given; pass the base model with "
            "peft_config, or the PEFT model without it"
        )
    if peft_model and not lora:
        raise ValueError(
            f"train_mode={args.train_mode!r} but the model is a LoRA (PEFT) model; set train_mode='lora'"
        )


def _already_placed(base: nn.Module, block, args, placement, model_type: str, name: str | None):
    """(placement, similarity, base model name) of a model its occult block says is placed."""
    placed_devices = block.num_devices
    if placed_devices is not None and int(placed_devices) != args.devices:
        raise ValueError(
            f"devices={args.devices} but this checkpoint is placed for {placed_devices} devices; "
            f"set devices={placed_devices}"
        )
    if placement is not None:
        raise ValueError(
            "this model is already placed (its occult block says so); drop the placement argument"
        )
    similarity = router_similarity(base)
    if similarity is None and name and os.path.isdir(name):
        similarity = read_similarity(name)
    return block_placement(block, model_type), similarity, block.base_model or name


def _place(base: nn.Module, args, placement, ckpt_block, model_type: str, data: tuple):
    """Place `base` (in place): the resumed checkpoint's placement, the given one, one computed from a
    profile of the training data (`placement="auto"`), or `args.placement`; returns (placement, the
    profile's similarity in placed order or None). `data`: (train_dataset, collate, model name)."""
    profile = None
    if ckpt_block is not None and ckpt_block.placement is not None:
        placement = block_placement(ckpt_block, model_type)
    elif placement is None and args.placement == "auto":
        train_dataset, collate, name = data
        profile = _profile(base, train_dataset, collate, args, name or "model")
        placement = place_across_ranks(
            profile,
            args.devices,
            args.nodes,
            args.placement_algorithm,
            max_load_imbalance=args.max_load_imbalance,
            **_placement_budget(args),
        )
    placement = resolve_placement(placement if placement is not None else args.placement, base, args.devices)
    if getattr(base, "occult_sharded_source", None) is not None:
        place_sharded(base, placement)  # read shard-wise: re-read the expert block in the new order
    else:
        apply_occult(base, placement)
    return placement, placed_similarity(profile.similarity(), placement) if profile is not None else None


def _placement_budget(args) -> dict:
    """Place for the pruned routing when the pruning's devices follow from the profile (a device budget,
    no node budget, a pruning criterion); {} places for the full routing."""
    if args.max_devices_per_token is not None and args.max_nodes_per_token is None:
        if args.criterion in PRUNING_CRITERIA:
            return dict(max_devices_per_token=args.max_devices_per_token, criterion=args.criterion)
    return {}
