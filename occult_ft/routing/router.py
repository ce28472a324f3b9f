"""The pruned router: a subclass of the model's own router class whose forward applies a `PruningConfig`.

`prune_topk` applies the budget to one router output (the model-aware part: selection scores from the
registry, the router's own group limit, the model's gate-weight convention); `apply_pruning` swaps
every router of a model to its pruned subclass (state-dict names unchanged) and `unpruned_routing`
lifts the budget temporarily (the distillation teacher); `fit_router_device_bias` starts the device
bias balanced on one batch (`device_bias_init="first_batch"`). The rules themselves are the pure functions
of `occult_ft.routing.rules`.

Shape legend: T tokens, E experts, K top-k, D devices, N nodes, M = max_devices_per_token.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn

from ..metrics import contiguous_expert_device, device_counts
from ..models.registry import MoEArch, MoELayer, find_moe_layers
from .config import PruningConfig
from .rules import add_device_bias, fit_device_bias, limit_topk

__all__ = [
    "RouterRecord",
    "router_selectable",
    "prune_topk",
    "apply_pruning",
    "remove_pruning",
    "pruned_routers",
    "collect_routing",
    "set_recording",
    "unpruned_routing",
    "router_similarity",
    "router_device_bias",
    "fit_router_device_bias",
]


# ---- the model's own group limit and one router output ----------------------------------------
def router_selectable(arch: MoEArch, router: nn.Module, scores_TE: torch.Tensor) -> torch.Tensor | None:
    """(T, E) bool: the experts of the groups the model's own group-limited router allows each token
    (DeepSeek-V3 `n_group`/`topk_group`, DeepSeek-V2 `group_limited_greedy`), recomputed from the
    selection scores exactly as the router does (`MoEArch.selectable`); None when the router has no
    active group limit."""
    return arch.selectable(router, scores_TE)


def prune_topk(
    arch: MoEArch,
    router: nn.Module,
    logits_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    config: PruningConfig,
    expert_device_E: torch.Tensor,
    similarity_EE: torch.Tensor | None = None,
    inputs: tuple = (),
    device_bias_D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply `config` to one router output.

    Args:
        logits_TE: the router's first output (raw logits for most); topk_ids_TK / weights_TK: its
            unpruned choice.
        inputs: the router call's arguments after the hidden states (a bias the block passes).
        device_bias_D: optional (D,) selection bias per device (`add_device_bias`): it ranks the
            devices a token keeps (`limit_topk`'s ranking: the walk of the top-k of the biased scores,
            never more devices than the unbiased top-k reaches); the experts inside them and the gate
            weights come from the unbiased scores.
    Returns:
        (topk_ids_TK, weights_TK, changed_T) where weights keep the dtype of `weights_TK`.
    """
    # selection scores, not logits: what the model ranks experts by (the registry knows; DeepSeek-V3 adds
    # its correction bias to sigmoid scores); detached because pruning only chooses, it is not differentiated.
    scores = arch.selection_scores(router, logits_TE.detach(), inputs)
    topk_sum = config.criterion == "device_topk_sum"
    # device_topk_sum replaces the router's group limit by its own node/device ranking, so no group mask.
    selectable = None if topk_sum else router_selectable(arch, router, scores)
    ranked, ranked_ids = None, None
    if device_bias_D is not None:
        # the device ranking: the router's choice re-taken on the biased scores (its group limit included)
        ranked = add_device_bias(scores, expert_device_E, device_bias_D)
        ranked_ok = None if topk_sum else router_selectable(arch, router, ranked)
        masked = ranked if ranked_ok is None else ranked.masked_fill(~ranked_ok, arch.group_mask_fill)
        ranked_ids = masked.topk(topk_ids_TK.shape[1], dim=-1).indices
    new_ids = limit_topk(
        scores,
        topk_ids_TK,
        expert_device_E,
        config.num_devices,
        config.max_devices_per_token,
        config.criterion,
        similarity_EE,
        selectable,
        config.num_nodes,
        config.max_nodes_per_token,
        arch.group_score_topn,
        ranked,
        ranked_ids,
    )
    # compare as sets (sorted rows): the same experts in another slot order is not a change.
    changed_T = (new_ids.sort(dim=1).values != topk_ids_TK.sort(dim=1).values).any(dim=1)
    # gate weights from the unbiased logits (DeepSeek-V3 Sec. 2.1.2: the bias only selects, never weighs).
    new_w = arch.gate_weights(router, logits_TE, new_ids, inputs)
    # preserve_mass rescales the k weights to the sum the unpruned selection had; 1e-20 avoids 0/0
    # for a row whose new experts all have zero probability.
    if config.gate_weights == "preserve_mass":
        new_w = new_w * (weights_TK.float().sum(-1, keepdim=True) / (new_w.sum(-1, keepdim=True) + 1e-20))
    new_w = new_w.to(weights_TK.dtype)
    # tokens the budget did not touch keep the router's own output bit for bit (ids and weights), so an
    # unconstrained model routes exactly as before; device_topk_sum re-selects every token by design.
    if config.criterion != "device_topk_sum":
        keep = ~changed_T.unsqueeze(1)
        new_w = torch.where(keep, weights_TK, new_w)
        new_ids = torch.where(keep, topk_ids_TK, new_ids)
    return new_ids, new_w, changed_T


# ---- the pruned router ---------------------------------------------------------------------------
@dataclass
class RouterRecord:
    """What a pruned router saw in its last forward (for metrics and the balance loss).

    Args:
        topk_ids: (T, K) the selection actually used (detached).
        probs: (T, E) fp32 router probabilities, attached to the graph when `keep_graph` is on.
        removed_mass: (T,) share of the unpruned selection's probability mass that pruning removed.
    """

    topk_ids: torch.Tensor
    probs: torch.Tensor | None
    removed_mass: torch.Tensor


if TYPE_CHECKING:

    class PrunedRouter(nn.Module):
        """The static view of a router after `apply_pruning` (its class is then a subclass of the model's
        router class made by `_pruned_class`): the attributes it sets."""

        occult_arch: MoEArch
        occult_config: PruningConfig
        occult_recording: bool
        occult_keep_graph: bool
        occult_record: RouterRecord | None
        occult_expert_device: torch.Tensor  # (E,) buffer


_PRUNED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
_Router = TypeVar("_Router", bound=nn.Module)


def _pruned_class(base: type[_Router]) -> type[_Router]:
    """A subclass of the model's own router class whose forward prunes; parameters keep their names."""
    # already pruned (apply_pruning called twice): subclassing again would stack two pruning forwards.
    if getattr(base, "_occult_pruned", False):
        return base
    if base not in _PRUNED_CLASSES:

        def forward(self, hidden_states, *args, **kwargs):
            # the HF routers return (router_logits, routing_weights, selected_experts); the wrapper keeps that contract.
            logits, weights, ids = base.forward(self, hidden_states, *args, **kwargs)
            cfg: PruningConfig = self.occult_config
            ids_in = ids
            # with no budget (cfg.active False) the forward is the model's own; only the recording below runs.
            if cfg.active:
                inputs = self.occult_arch.call_inputs(args, kwargs)
                capture = getattr(self, "occult_capture", None)  # `capture_router_calls`, while it runs
                if capture is not None:
                    capture.append((logits.detach(), ids.detach(), weights.detach(), inputs))
                ids, weights, _ = prune_topk(
                    self.occult_arch,
                    self,
                    logits,
                    ids,
                    weights,
                    cfg,
                    self.occult_expert_device,
                    getattr(self, "occult_similarity", None),
                    inputs,
                    self._buffers.get("occult_device_bias"),  # device balancing (under a budget only)
                )
            if self.occult_recording:
                probs = self.occult_arch.probabilities(self, logits)
                # removed mass = the share of the unpruned top-k probability that the pruned top-k lost, in [0, 1];
                # clamp_min(0): the pruned experts can hold more probability than the unpruned ones when the
                # selection scores are not the probabilities (a correction bias or a device bias).
                p = probs.detach()
                before = p.gather(1, ids_in).sum(-1)
                after = p.gather(1, ids).sum(-1)
                removed = ((before - after) / before.clamp_min(1e-20)).clamp_min(0.0)
                self.occult_record = RouterRecord(
                    ids.detach(), probs if self.occult_keep_graph else None, removed
                )
            return logits, weights, ids

        # one subclass per router class, cached: every layer of a model (and every later call) shares it.
        _PRUNED_CLASSES[base] = type(
            f"Occult{base.__name__}",
            (base,),
            {"forward": forward, "_occult_pruned": True, "__module__": __name__},
        )
    return cast("type[_Router]", _PRUNED_CLASSES[base])  # made from `base`, so a subclass of it


def apply_pruning(
    model: nn.Module,
    config: PruningConfig,
    similarity: dict[int, torch.Tensor] | None = None,
    expert_device: dict[int, torch.Tensor] | None = None,
    device_bias: dict[int, torch.Tensor] | None = None,
) -> list[MoELayer]:
    """Make every router of `model` prune (or, with no budget, just record) its routing, in place.

    The router keeps its class's parameters and state-dict names (its class becomes a subclass), so
    checkpoints, PEFT `modules_to_save` and optimizers are unaffected. Call it before the first
    forward that records router logits and before `get_peft_model`.

    Args:
        config: the budget and criterion.
        similarity: layer index -> (E, E) expert similarity (needed for `criterion="similarity"`).
        expert_device: layer index -> (E,) device of each expert; default contiguous blocks (a placed
            model, see `occult_ft.placement.permute_experts`).
        device_bias: layer index -> (D,) selection bias per device (`rules.add_device_bias`), applied
            while a budget is active; None keeps the routers' current bias (none at first), {} removes it.
    Returns:
        The model's MoE layers.
    """
    layers = find_moe_layers(model)
    # every layer is checked before any router changes: a bad budget leaves the model untouched
    for layer in layers:
        config.check(layer.num_experts, layer.top_k)
    if config.active and config.criterion == "similarity":
        missing = [layer.index for layer in layers if not similarity or layer.index not in similarity]
        if missing:
            raise ValueError(
                f"criterion='similarity' needs a similarity table for MoE layers {missing}; "
                "profile the model (occult-ft profile) or choose criterion='score'"
            )
    for layer in layers:
        router = cast("PrunedRouter", layer.router)
        # swapping __class__ keeps the instance, so parameters, hooks and state-dict names stay untouched.
        router.__class__ = _pruned_class(type(router))
        router.occult_arch = layer.arch
        router.occult_config = config
        router.occult_recording = getattr(router, "occult_recording", False)
        router.occult_keep_graph = getattr(router, "occult_keep_graph", False)
        router.occult_record = None
        # any parameter or buffer gives the router's device (the buffers below must live beside the weights).
        ref = next(iter([*router.parameters(), *router.buffers()]))
        mapping = (
            expert_device[layer.index]
            if expert_device is not None
            else contiguous_expert_device(layer.num_experts, config.num_devices)
        )
        _set_buffer(router, "occult_expert_device", mapping.to(ref.device, torch.long))
        if similarity is not None and layer.index in similarity:
            _set_buffer(router, "occult_similarity", similarity[layer.index].to(ref.device, torch.float32))
        _set_device_bias(router, layer.index, config.num_devices, device_bias, ref.device)
    return layers


def _set_device_bias(
    router: nn.Module,
    index: int,
    num_devices: int,
    device_bias: dict[int, torch.Tensor] | None,
    device: torch.device,
) -> None:
    """The router's device bias for MoE layer `index` (`apply_pruning`): None keeps the one it holds
    (dropped when learnt for another device count), a table sets or (no entry) removes it."""
    held = router._buffers.get("occult_device_bias")
    if device_bias is None:
        if held is not None and held.numel() != num_devices:
            router._buffers.pop("occult_device_bias")  # learnt for another device count: meaningless here
        return
    # {} or a table without this layer removes the layer's bias
    bias = device_bias.get(index)
    if bias is None:
        router._buffers.pop("occult_device_bias", None)
        return
    if tuple(bias.shape) != (num_devices,):
        raise ValueError(
            f"device bias of MoE layer {index} has shape {tuple(bias.shape)}, expected "
            f"({num_devices},) (one value per device); record it for devices={num_devices}"
        )
    _set_buffer(router, "occult_device_bias", bias.detach().to(device, torch.float32).clone())


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    # re-assigning a registered buffer keeps its non-persistent flag, so it stays out of the state dict.
    if name in module._buffers:
        module._buffers[name] = value
    else:
        module.register_buffer(name, value, persistent=False)


def pruned_routers(model: nn.Module) -> list[tuple[MoELayer, PrunedRouter]]:
    """(layer, router) for every router that `apply_pruning` prepared."""
    return [
        (layer, cast("PrunedRouter", layer.router))
        for layer in find_moe_layers(model)
        if getattr(layer.router, "_occult_pruned", False)
    ]


def remove_pruning(model: nn.Module) -> None:
    """Give every router its original class back (the model routes as before `apply_pruning`)."""
    for layer in find_moe_layers(model):
        router = layer.router
        if getattr(router, "_occult_pruned", False):
            # __mro__[1] is the model's own router class: the pruned class is a direct subclass of it.
            router.__class__ = router.__class__.__mro__[1]
            for name in ("occult_expert_device", "occult_similarity", "occult_device_bias"):
                router._buffers.pop(name, None)
            for name in (
                "occult_arch",
                "occult_config",
                "occult_recording",
                "occult_keep_graph",
                "occult_record",
            ):
                router.__dict__.pop(name, None)


def set_recording(model: nn.Module, on: bool = True, keep_graph: bool = False) -> None:
    """Turn router recording on/off (`keep_graph` keeps probabilities attached for a loss)."""
    for _, router in pruned_routers(model):
        router.occult_recording = on
        router.occult_keep_graph = keep_graph and on
        if not on:
            router.occult_record = None


def collect_routing(model: nn.Module) -> dict[int, RouterRecord]:
    """layer index -> the last `RouterRecord` of each recording router."""
    out = {}
    for layer, router in pruned_routers(model):
        record = getattr(router, "occult_record", None)
        if record is not None:
            out[layer.index] = record
    return out


@contextmanager
def unpruned_routing(model: nn.Module, record: bool = False):
    """Inside the block every pruned router of `model` routes as the unpruned model does (its budget is
    lifted) and, unless `record`, leaves its recording and last record alone; both are restored on exit.
    The teacher of distillation: the same weights with the unpruned routing."""
    saved = []
    for _, router in pruned_routers(model):
        # what the block changes, restored in `finally` even when the teacher's forward raises
        saved.append((router, router.occult_config, router.occult_recording, router.occult_record))
        # lifting both budgets makes cfg.active False: the forward returns the model's own routing.
        router.occult_config = replace(
            router.occult_config, max_devices_per_token=None, max_nodes_per_token=None
        )
        # recording stays on only when asked, so the teacher's forward does not overwrite the student's record.
        router.occult_recording = router.occult_recording and record
    try:
        yield model
    finally:
        for router, config, recording, last in saved:
            router.occult_config, router.occult_recording, router.occult_record = config, recording, last


def router_similarity(model: nn.Module) -> dict[int, torch.Tensor] | None:
    """The placed-order similarity tables held by `model`'s pruned routers (None when none holds one),
    detached on the CPU: what a checkpoint of the model must save beside its weights."""
    buffers = {
        layer.index: router._buffers.get("occult_similarity") for layer, router in pruned_routers(model)
    }
    # fp32 on the CPU: the checkpoint stores the table independent of the training dtype and device.
    tables = {i: t.detach().float().cpu() for i, t in buffers.items() if t is not None}
    return tables or None


ROUNDS = 3


@torch.no_grad()
def fit_router_device_bias(
    model: nn.Module,
    forward: Callable[[], object],
    rate: float,
    mask_T: torch.Tensor | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """Set every biased pruned router's device bias to the one that balances one batch (`fit_device_bias`).

    `forward()` runs the model once (every process together under expert parallelism); each router keeps
    its unpruned outputs of that call, and the rule is then iterated on them without running the model
    again: a candidate bias is scored by pruning the kept outputs under it (`prune_topk`, exactly as the
    router would) and counting the tokens each device receives.

    Args:
        forward: runs the model's forward on the batch (no gradients needed).
        rate: the run's `device_bias_rate` (the rule's final step scale).
        mask_T: optional (T,) mask of the batch's real tokens (1) and padding (0), flattened as the router
            sees them; padding counts towards no device.
        reduce: returns an (L, D) load summed over processes (called `FIT_ITERATIONS` + 1 times on every
            process, whatever the routing, so collectives inside it match up).
    Returns:
        layer index -> the bias set (empty when no router holds a bias).
    """
    routers = [
        (layer, r) for layer, r in pruned_routers(model) if r._buffers.get("occult_device_bias") is not None
    ]
    if not routers:
        return {}
    buffers = [cast(torch.Tensor, r._buffers["occult_device_bias"]) for _, r in routers]
    for _, router in routers:
        router.__dict__["occult_capture"] = []  # read by the pruned forward while it is set
    try:
        forward()
        calls = [router.__dict__.pop("occult_capture") for _, router in routers]
    finally:
        for _, router in routers:
            router.__dict__.pop("occult_capture", None)

    def loads_of(bias_LD: torch.Tensor) -> torch.Tensor:
        rows = []
        for row, ((layer, router), kept) in enumerate(zip(routers, calls, strict=True)):
            cfg: PruningConfig = router.occult_config
            dev_E = router.occult_expert_device
            load_D = torch.zeros(cfg.num_devices, dtype=torch.float32, device=dev_E.device)
            for logits, ids, weights, inputs in kept:
                new_ids, _, _ = prune_topk(
                    layer.arch,
                    router,
                    logits,
                    ids,
                    weights,
                    cfg,
                    dev_E,
                    getattr(router, "occult_similarity", None),
                    inputs,
                    bias_LD[row].to(dev_E.device),
                )
                reached_TD = (device_counts(new_ids, dev_E, cfg.num_devices) > 0).float()
                if mask_T is not None and mask_T.numel() == reached_TD.shape[0]:
                    reached_TD = reached_TD * mask_T.to(reached_TD.device, torch.float32)[:, None]
                load_D += reached_TD.sum(dim=0)
            rows.append(load_D)
        load_LD = torch.stack(rows)
        return reduce(load_LD) if reduce is not None else load_LD

    start_LD = torch.stack([b.detach().float() for b in buffers])
    fitted_LD = fit_device_bias(loads_of, start_LD, rate)
    for buffer, row in zip(buffers, fitted_LD, strict=True):
        buffer.copy_(row.to(buffer.device, buffer.dtype))
    return {layer.index: b.detach().clone() for (layer, _), b in zip(routers, buffers, strict=True)}


def router_device_bias(model: nn.Module) -> dict[int, torch.Tensor] | None:
    """layer index -> (D,) selection bias per device held by `model`'s pruned routers (None when none
    holds one), detached fp32 on the CPU: what a checkpoint of the model records in its block."""
    buffers = {
        layer.index: router._buffers.get("occult_device_bias") for layer, router in pruned_routers(model)
    }
    bias = {i: t.detach().float().cpu() for i, t in buffers.items() if t is not None}
    return bias or None
