"""Expert-parallel training inside `OccultTrainer`: groups, sharding, gradient reduction, clipping, checkpoints.

How the groups are laid out, why the gradients equal a single process's, and what a checkpoint holds:
docs/expert-parallel.md, "Groups, gradients and checkpoints".

    ExpertParallelGroups / expert_parallel_groups   EP groups [g*D, (g+1)*D) and EDP groups (p, p + D, ...),
                                                    from DeepSpeed or `torch.distributed.new_group`
    setup_expert_parallel                           shard the experts (and expert LoRA), mark and broadcast;
                                                    leave the input embedding to `embedding_grad` when asked
    ExpertGradientReducer / reduce_expert_gradients   the shards' gradients summed over EDP, divided by W
                                                    (during the last backward; blocking reference)
    clip_expert_parallel_grad_norm                  the norm of the whole model: shards' squares over EP
    gathered_state_dict / shard_state_dict          full HF layout for saving, this rank's shards on resume
    save_expert_optimizer_state / load_expert_optimizer_state   an optimizer file per EP position (no DeepSpeed)
    load_expert_shards / load_expert_lora_shards / load_sharded_adapter   resuming each rank's own shards

Shape legend: W world size, D expert-parallel size, E experts of a layer, P = E / D.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging

from ..dispatch import (
    ExpertShard,
    configure_exchange,
    expert_shard_parameters,
    gather_experts_state_dict,
    shard_experts,
)
from ..dispatch.comm import group_cache
from ..integrations.deepspeed import (
    attach_moe_marker,
    check_deepspeed_config,
    deepspeed_expert_groups,
    mark_expert_parameters,
)
from ..integrations.peft import (
    adopt_local_expert_lora,
    expert_lora_wrappers,
    gather_expert_lora,
    is_peft_model,
    shard_adapter_weights,
    shard_expert_lora,
)
from ..models import base_experts, experts_state_key
from ..models.registry import find_moe_layers, unwrap_model
from .config import OccultArguments
from .embedding_grad import reducible_embedding

__all__ = [
    "ExpertParallelGroups",
    "check_expert_parallel_size",
    "expert_parallel_groups",
    "setup_expert_parallel",
    "reduce_expert_gradients",
    "ExpertGradientReducer",
    "replicated_bucket_cap_mb",
    "clip_expert_parallel_grad_norm",
    "gathered_state_dict",
    "shard_state_dict",
    "expert_optimizer_file",
    "save_expert_optimizer_state",
    "load_expert_optimizer_state",
    "load_expert_shards",
    "load_expert_lora_shards",
    "load_sharded_adapter",
]

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class ExpertParallelGroups:
    """The process groups of one expert-parallel layout, seen from one rank.

    Attributes:
        size: D, ranks per EP group.
        world_size: W.
        rank: this process's global rank.
        ep_group / ep_ranks: this rank's EP group and its global ranks (consecutive).
        edp_group / edp_ranks: this rank's EDP group (the W / D replicas of its shard) and its ranks.
        source: "deepspeed" (from `deepspeed.utils.groups`) or "torch" (`torch.distributed.new_group`).
    """

    size: int
    world_size: int
    rank: int
    ep_group: dist.ProcessGroup
    ep_ranks: tuple[int, ...]
    edp_group: dist.ProcessGroup
    edp_ranks: tuple[int, ...]
    source: str

    @property
    def replicas(self) -> int:
        """W / D: copies of each expert shard (the EDP group size)."""
        return self.world_size // self.size


def check_expert_parallel_size(size: int, world_size: int, num_experts: int | None = None) -> None:
    """Raise a one-line ValueError when D does not divide W or the experts of a layer."""
    if size < 1:
        raise ValueError(f"expert_parallel_size={size} must be a positive integer")
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"expert_parallel_size={size} does not divide the world size {world_size}; launch a multiple of {size} "
            f"processes or set --expert_parallel_size to a divisor of {world_size} ({', '.join(map(str, divisors))})"
        )
    if num_experts is not None and num_experts % size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"expert_parallel_size={size} does not divide the {num_experts} experts of each MoE layer; "
            f"use one of {', '.join(map(str, divisors))}"
        )


_TORCH_GROUPS: dict[tuple, ExpertParallelGroups] = group_cache()  # emptied by close_process_group


def _torch_groups(size: int) -> ExpertParallelGroups:
    """The EP/EDP layout built with `torch.distributed.new_group`, in DeepSpeed's order (EDP groups, then
    EP groups); cached per default group and D, since every rank must create every group exactly once."""
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (id(dist.group.WORLD), world, size)
    if key in _TORCH_GROUPS:
        return _TORCH_GROUPS[key]
    edp = ep = None
    for position in range(size):
        ranks = tuple(range(position, world, size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            edp = (group, ranks)
    for index in range(world // size):
        ranks = tuple(range(index * size, (index + 1) * size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            ep = (group, ranks)
    assert ep is not None and edp is not None  # every rank is in one EP and one EDP group
    groups = ExpertParallelGroups(size, world, rank, ep[0], ep[1], edp[0], edp[1], "torch")
    _TORCH_GROUPS[key] = groups
    return groups


def expert_parallel_groups(size: int, use_deepspeed: bool = False) -> ExpertParallelGroups:
    """This rank's EP and EDP groups for D = `size` (collective on first use: call it on every rank).

    Args:
        size: D, must divide the world size.
        use_deepspeed: take the groups from `deepspeed.utils.groups` (needed when a DeepSpeed engine
            reduces the gradients: it looks its EDP groups up by name).

    Raises:
        RuntimeError: when torch.distributed is not initialised.
        ValueError: when D does not divide the world size.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"expert_parallel_size={size} needs several processes; launch with torchrun, accelerate launch or deepspeed"
        )
    check_expert_parallel_size(size, dist.get_world_size())
    if not use_deepspeed:
        return _torch_groups(size)

    ep_group, ep_ranks, edp_group, edp_ranks = deepspeed_expert_groups(size)
    return ExpertParallelGroups(
        size,
        dist.get_world_size(),
        dist.get_rank(),
        ep_group,
        tuple(ep_ranks),
        edp_group,
        tuple(edp_ranks),
        "deepspeed",
    )


def setup_expert_parallel(model: nn.Module, args: OccultArguments) -> ExpertParallelGroups:
    """Shard the experts of a placed, pruned model over the EP groups and prepare it for its trainer.

    Call on every rank after `prepare_model` and before the optimizer exists. It checks the layout,
    builds the groups, runs `shard_experts(model, ep_group)`, tells DDP to leave the shards alone (and the
    input embedding, marked `occult_reduced_apart`, under `embedding_gradient_overlap`) and,
    for a DeepSpeed run, marks them as DeepSpeed expert parameters and attaches the engine's MoE marker.

    A LoRA model's expert LoRA factors are broadcast from rank 0 and cut to the same expert block.

    Args:
        model: the prepared model (a transformers model or a PEFT LoRA model, not yet wrapped by DDP).
        args: the run's `OccultConfig` (`expert_parallel_size`, `deepspeed`, `world_size`).

    Returns:
        this rank's `ExpertParallelGroups`.

    Raises:
        ValueError: one line for a bad layout (D vs world size or experts) or a DeepSpeed config that
            cannot work (ZeRO-3, AutoEP).
    """

    size = int(args.expert_parallel_size)
    base = unwrap_model(model)
    layers = find_moe_layers(base)
    world = int(args.world_size)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != world:
        raise ValueError(
            f"torch.distributed has {dist.get_world_size()} processes but the trainer sees {world}; launch with "
            "torchrun, accelerate launch or deepspeed so that RANK/WORLD_SIZE are set"
        )
    check_expert_parallel_size(size, world, layers[0].num_experts)
    use_deepspeed = bool(args.deepspeed)
    if use_deepspeed:
        check_deepspeed_config(args.deepspeed, size, getattr(args, "max_grad_norm", None))
    groups = expert_parallel_groups(size, use_deepspeed=use_deepspeed)
    read_sharded = bool(expert_shard_parameters(base))  # `sharded_load` read only this rank's experts
    factors = [p for layer in layers for w in expert_lora_wrappers(layer.experts) for p in _lora_factors(w)]
    if factors and not read_sharded:  # one initialisation everywhere, as DDP makes it for replicated LoRA
        _broadcast_from_rank0(factors)
    exchange = getattr(args, "exchange", "flat")
    if not read_sharded:
        shard_experts(base, groups.ep_group, nodes=args.nodes if exchange == "two_stage" else 1)
    capacity = args.exchange_capacity_rows() if hasattr(args, "exchange_capacity_rows") else None
    overlap_local = getattr(args, "exchange_overlap_local", False)
    overlap_shared = getattr(args, "exchange_overlap_shared", False)
    configure_exchange(
        base, exchange, getattr(args, "exchange_chunks", 1), capacity, overlap_local, overlap_shared
    )
    if overlap_shared and not any(layer.arch.shared_mlp_attr for layer in layers):
        logger.warning(
            "exchange_overlap_shared: %s has no shared experts, so nothing runs beside the combine",
            type(base).__name__,
        )
    for layer in layers:
        if read_sharded:  # LoRA was applied to the local experts: its factors are already this block's
            adopt_local_expert_lora(layer.experts)
            continue
        shard = cast(ExpertShard, base_experts(layer.experts).occult_shard)
        shard_expert_lora(layer.experts, shard.rank * shard.experts_per_device, shard.experts_per_device)
    # DDP wraps `model` (the PEFT model under LoRA): name the shards as its named_parameters does
    top = unwrap_model(model, keep_peft=True)
    shards = [(n, p) for n, p in top.named_parameters() if getattr(p, "occult_expert_shard", False)]
    ignored = [n for n, _ in shards]
    for p in top.parameters():  # a mark left by an earlier trainer on this model decides nothing now
        if hasattr(p, "occult_reduced_apart"):
            del p.occult_reduced_apart
    embedding = None
    if not use_deepspeed and world > 1 and getattr(args, "embedding_gradient_overlap", False):
        embedding = reducible_embedding(top)
    if embedding is not None:  # `EmbeddingGradientReducer` reduces it (the trainer finds the mark)
        ignored.append(embedding[0])
        embedding[1].weight.occult_reduced_apart = True  # type: ignore[attr-defined]
        _broadcast_from_rank0([embedding[1].weight])  # what DDP's wrap would have done for it
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(top, ignored)
    if use_deepspeed:
        mark_expert_parameters((p for _, p in shards), size)
        attach_moe_marker(base, size, layers[0].num_experts)
    return groups


def replicated_bucket_cap_mb(model: nn.Module) -> int:
    """DDP's bucket size (MiB) for an expert-parallel model: the trainable replicated parameters of its
    largest decoder layer, rounded up (at least 1).

    DDP starts a bucket's all-reduce when every gradient in it is ready. Without the experts, the
    replicated parameters of a decoder layer (attention, norms, router) are small, so DDP's default 25
    MiB bucket can span several layers plus the embedding, and then nothing is reduced before the end
    of backward. One layer per bucket starts each layer's all-reduce when its backward is done, hidden
    behind the backward of the layers below it; only the embedding's stays exposed.
    """
    base = unwrap_model(model)
    largest = 0
    for layer in find_moe_layers(base):
        decoder = base.get_submodule(layer.name.rsplit(".", 1)[0]) if "." in layer.name else layer.block
        size = sum(
            p.numel() * p.element_size()
            for p in decoder.parameters()
            if p.requires_grad and not getattr(p, "occult_expert_shard", False)
        )
        largest = max(largest, size)
    return max(1, math.ceil(largest / 2**20))


def _lora_factors(wrapper: Any) -> list[nn.Parameter]:  # a PEFT ParamWrapper
    return [getattr(wrapper, w)[a].weight for a in wrapper.lora_A.keys() for w in ("lora_A", "lora_B")]


@torch.no_grad()
def _broadcast_from_rank0(params: list[nn.Parameter] | list[torch.Tensor]) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """Sum the expert-shard gradients over the EDP group and divide by W, in place (collective).

    Call once per optimizer step, after the last backward of the step, on every rank; the shards
    are then averaged exactly as DDP averages the replicated parameters (docs/expert-parallel.md).
    Shards without a gradient (frozen experts) are skipped on every rank alike. `ExpertGradientReducer`
    does the same while backward runs (what `OccultTrainer` uses); this is its blocking reference.
    """
    grads = [p.grad for _, p in expert_shard_parameters(model) if p.grad is not None]
    if not grads:
        return
    scale = 1.0 / groups.world_size
    if groups.replicas == 1:
        torch._foreach_mul_(grads, scale)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        work, flat, _ = _start_sum(same, groups.edp_group)
        work.wait()
        _scatter_back(flat, same, scale)


def _start_sum(
    grads: list[torch.Tensor], group: dist.ProcessGroup
) -> tuple[Any, torch.Tensor, list[torch.Tensor]]:
    """An asynchronous all-reduce (sum) of `grads` (one dtype) packed into one flat buffer."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    return dist.all_reduce(flat, group=group, async_op=True), flat, grads


def _scatter_back(flat: torch.Tensor, grads: list[torch.Tensor], scale: float) -> None:
    flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class ExpertGradientReducer:
    """`reduce_expert_gradients` overlapped with the backward of an optimizer step's last micro-batch.

    One bucket per MoE layer (its expert-shard parameters, LoRA factors included; one flat buffer per
    dtype). After `arm()`, gradient hooks (`register_post_accumulate_grad_hook`) follow the backward:
    when a parameter of layer l receives its gradient, every layer above l has finished its backward
    (backward visits the layers from the last to the first, and a weight's gradient is accumulated as
    soon as it is ready), so their buckets' all-reduces over the EDP group are started then,
    asynchronously, from the last layer down: the same order on every rank, while the lower layers'
    backward still runs. `finish()`, after that backward, starts what is left (layer 0, and layers no
    hook saw) and waits for all, then divides by W: the same sums as `reduce_expert_gradients` (each
    element summed over the same ranks), so the same gradients to float rounding of the reduction
    order. A layer's expert gradient may be accumulated several times in one backward (the chunked
    pipeline runs one backward per chunk): only a later layer's hook closes it, never its own.
    Micro-batches before the last (gradient accumulation) run no hook work: nothing is reduced there.
    With one replica (W = D) there is nothing to sum: `finish()` only divides by W.
    """

    def __init__(self, model: nn.Module, groups: ExpertParallelGroups):
        self.groups = groups
        shard_ids = {id(p) for _, p in expert_shard_parameters(model)}
        self._layers: list[list[nn.Parameter]] = []
        for layer in find_moe_layers(unwrap_model(model)):
            params = [p for p in layer.experts.parameters() if id(p) in shard_ids and p.requires_grad]
            if params:
                self._layers.append(params)
        self._layer_of = {id(p): i for i, params in enumerate(self._layers) for p in params}
        self._armed = False
        self._next = len(self._layers) - 1
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._hooks = []
        if groups.replicas > 1:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._on_gradient)
                for params in self._layers
                for p in params
            ]

    def arm(self) -> None:
        """Call before the backward of an optimizer step's last micro-batch (every rank)."""
        self._armed, self._next, self._pending = True, len(self._layers) - 1, []

    @property
    def layers_started(self) -> int:
        """MoE layers whose all-reduce has started since `arm()` (during backward: the overlapped ones)."""
        return len(self._layers) - 1 - self._next if self._armed else 0

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        layer = self._layer_of[id(param)]
        while self._next > layer:
            self._start(self._next)
            self._next -= 1

    @torch.no_grad()
    def _start(self, layer: int) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._layers[layer]:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            self._pending.append(_start_sum(grads, self.groups.edp_group))

    @torch.no_grad()
    def finish(self) -> None:
        """After the last micro-batch's backward: the expert gradients summed over the EDP group / W."""
        scale = 1.0 / self.groups.world_size
        if self.groups.replicas == 1:
            grads = [p.grad for params in self._layers for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
            return
        if not self._armed:
            self.arm()
        while self._next >= 0:
            self._start(self._next)
            self._next -= 1
        for work, flat, grads in self._pending:
            work.wait()
            _scatter_back(flat, grads, scale)
        self._armed, self._pending = False, []

    def remove(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


@torch.no_grad()
def clip_expert_parallel_grad_norm(
    model: nn.Module, groups: ExpertParallelGroups, max_norm: float
) -> torch.Tensor:
    """Clip all gradients by the L2 norm of the whole (unsharded) model's gradient; returns that norm.

    Replicated gradients are identical on every rank (already averaged); each expert shard is counted
    once by summing the shards' squared norms over the EP group. `max_norm=inf` only measures.
    Collective over the EP group: call on every rank.
    """
    replicated: list[torch.Tensor] = []
    shards: list[torch.Tensor] = []
    for p in unwrap_model(model).parameters():
        if p.grad is None:
            continue
        (shards if getattr(p, "occult_expert_shard", False) else replicated).append(p.grad)
    device = (shards or replicated)[0].device if (shards or replicated) else torch.device("cpu")

    def squared(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).pow(2).sum()

    shard_sq = squared(shards)
    if groups.size > 1:
        dist.all_reduce(shard_sq, group=groups.ep_group)
    total = (squared(replicated) + shard_sq).sqrt()
    if max_norm != float("inf"):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        grads = replicated + shards
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


def gathered_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """`state_dict` (default: the model's) with every expert shard replaced by the full (E, ...) tensor.

    Collective: every rank of every EP group must call it. Save the result on one rank with
    `save_pretrained(..., state_dict=...)` to get the standard HF layout.

    For a LoRA model the keys are the PEFT model's (what `PeftModel.save_pretrained` filters) and the
    expert LoRA factors are gathered to the single-process layout; the frozen base expert shards are
    left as they are (the adapter file does not hold them).
    """

    if is_peft_model(model):
        top = unwrap_model(model, keep_peft=True)
        out = dict(state_dict) if state_dict is not None else dict(top.state_dict())
        names = {id(p): n for n, p in top.named_parameters()}
        for layer in find_moe_layers(top):
            shard = getattr(base_experts(layer.experts), "occult_shard", None)
            if shard is None:
                continue
            for param, value in gather_expert_lora(layer.experts, shard.group, shard.num_devices):
                if names[id(param)] in out:
                    out[names[id(param)]] = value
        return out
    full = gather_experts_state_dict(model)
    if state_dict is None:
        return full
    out = dict(state_dict)
    for name, _ in expert_shard_parameters(model):
        out[name] = full[name]
    return out


def shard_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict (experts (E, ...)) cut down to this rank's expert block (P, ...), for loading
    into a sharded model; keys that are not expert shards are returned unchanged."""
    base = unwrap_model(model)
    out = dict(state_dict)
    for layer in find_moe_layers(base):
        shard = getattr(base_experts(layer.experts), "occult_shard", None)
        if shard is None:
            continue
        start = shard.rank * shard.experts_per_device
        for name in shard.param_names:
            key = experts_state_key(layer, name)
            if key in out and out[key].shape[0] == shard.num_experts:
                out[key] = out[key][start : start + shard.experts_per_device]
    return out


def expert_optimizer_file(checkpoint: str, groups: ExpertParallelGroups, position: int | None = None) -> str:
    """Path of the optimizer state of EP position p (default: this rank's) in a checkpoint directory."""
    p = groups.ep_ranks.index(groups.rank) if position is None else position
    return os.path.join(checkpoint, f"optimizer_expert_shard_{p}_of_{groups.size}.pt")


def save_expert_optimizer_state(
    optimizer: torch.optim.Optimizer, groups: ExpertParallelGroups, checkpoint: str
) -> None:
    """Write this rank's optimizer state when it is the first replica of its EP position (ranks 0..D-1)."""
    if groups.rank < groups.size:
        os.makedirs(checkpoint, exist_ok=True)
        torch.save(optimizer.state_dict(), expert_optimizer_file(checkpoint, groups))


def load_expert_optimizer_state(
    optimizer: torch.optim.Optimizer, groups: ExpertParallelGroups, checkpoint: str
) -> bool:
    """Load the optimizer state of this rank's EP position, when the checkpoint has one; returns whether it did."""
    path = expert_optimizer_file(checkpoint, groups)
    if not os.path.isfile(path):
        return False
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    optimizer.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    return True


@torch.no_grad()
def load_expert_shards(model: nn.Module, checkpoint: str) -> None:
    """Copy this rank's expert shards, in place, from the standard HF weights of a checkpoint directory.

    Only the expert shards are touched (other parameters are left to whoever loaded the rest).
    Raises a one-line ValueError when the directory has no HF weights or they do not fit.
    """
    base = unwrap_model(model)
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ValueError(
            f"checkpoint {checkpoint!r} has no config.json with HF weights; it cannot restore the expert shards"
        )
    loaded = type(base).from_pretrained(checkpoint, dtype=next(base.parameters()).dtype)  # type: ignore[attr-defined]
    state = shard_state_dict(base, loaded.state_dict())
    del loaded
    for name, param in expert_shard_parameters(base):
        if name not in state or state[name].shape != param.shape:
            raise ValueError(
                f"checkpoint {checkpoint!r} has no expert tensor {name!r} of shape {tuple(param.shape)}"
            )
        param.copy_(state[name].to(param.device, param.dtype))


@torch.no_grad()
def load_expert_lora_shards(model: nn.Module, checkpoint: str) -> None:
    """Copy this rank's expert LoRA factors, in place, from the adapter file of a checkpoint directory.

    The adapter holds the factors of all E experts (as a single-process run saves them); each rank takes
    its own expert block. Other weights are left to whoever loaded the rest. Raises a one-line ValueError
    when the directory has no adapter or it does not fit.
    """
    from peft.utils import load_peft_weights

    if not os.path.isfile(os.path.join(checkpoint, "adapter_config.json")):
        raise ValueError(
            f"checkpoint {checkpoint!r} has no adapter_config.json; it cannot restore the expert LoRA shards"
        )
    top = unwrap_model(model, keep_peft=True)
    weights = shard_adapter_weights(top, load_peft_weights(checkpoint, device="cpu"))
    for name, param in top.named_parameters():
        if not getattr(param, "occult_expert_shard", False) or ".lora_" not in name:
            continue
        key = _adapter_key(name)
        if key not in weights or weights[key].shape != param.shape:
            raise ValueError(
                f"checkpoint {checkpoint!r} has no expert LoRA factor {key!r} of shape {tuple(param.shape)}"
            )
        param.copy_(weights[key].to(param.device, param.dtype))


def _adapter_key(name: str) -> str:
    """The key PEFT saves a LoRA factor under: `...lora_A.<adapter>.weight` -> `...lora_A.weight`."""
    head, _, tail = name.rpartition(".lora_")
    which, _, rest = tail.partition(".")  # "A", "<adapter>.weight"
    return f"{head}.lora_{which}.{rest.partition('.')[2]}"


def load_sharded_adapter(model: nn.Module, checkpoint: str) -> None:
    """Load a saved adapter (all E experts' factors) into a sharded LoRA model: every weight of the adapter
    file, the expert factors cut to this rank's block. For resuming without DeepSpeed, where Trainer's own
    `load_adapter` would refuse the full-E factors. Raises a one-line ValueError for a foreign adapter."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    top = unwrap_model(model, keep_peft=True)
    weights = shard_adapter_weights(top, load_peft_weights(checkpoint, device="cpu"))
    adapter = top.active_adapters[0] if getattr(top, "active_adapters", None) else "default"  # type: ignore[index]
    # load_state_dict's (missing_keys, unexpected_keys); PEFT annotates it as the `namedtuple` function
    result: Any = set_peft_model_state_dict(top, weights, adapter_name=adapter)
    if result.unexpected_keys:
        raise ValueError(
            f"checkpoint {checkpoint!r} has adapter weights this model lacks ({result.unexpected_keys[:4]}); "
            "resume with the model it was trained from"
        )
