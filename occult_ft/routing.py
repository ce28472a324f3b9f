"""Collaboration pruning: device-limited top-k routing criteria and the pruned router.

Each token normally picks its top-k experts wherever they live; collaboration pruning restricts the
choice to experts on at most `max_devices_per_token` (M) devices, so a de-duplicated all-to-all sends
it at most M rows. The criteria (pure functions below, fast and vectorised over tokens):

- `score` (the paper's router-score rule): walk the token's top-k experts in descending score and
  admit each one's device until M devices are admitted; then re-select the top-k among all experts on
  the admitted devices. The first M distinct devices of that walk are exactly the M devices with the
  highest *best* expert score (a device that hosts a top-k expert has a higher maximum than any
  device that hosts none), so the rule is computed as "rank devices by their best expert".
- `device_max` (DeepSeek-V2 device-limited routing): rank devices by their best expert, keep M, top-k
  inside. The same rule as `score`, reached from the DeepSeek side; both names are kept because users
  come from both (tests check both against a literal walk of the paper's rule).
- `device_topk_sum` (DeepSeek-V3 node-limited routing): rank devices by the sum of their top
  max(1, k // M) scores (for DeepSeek-V3 models their router's own top-2), keep M, top-k inside. Applied to every token, verbatim as DeepSeek-V3 does,
  so that the native `n_group`/`topk_group` fields reproduce it; unlike the others it may move a token
  whose top-k already fits.
- `similarity` (the paper's expert-similarity rule): admit devices as `score` does, keep the selected
  experts that live there, and replace each one outside (in descending score order) by the most similar
  expert on the admitted devices that is not selected yet. Similarity is the cosine between experts'
  router-probability profiles, measured by `occult_ft.profiling`.

For `score`, `similarity` and `device_max` a token whose top-k already fits in M devices keeps its
routing and weights bit for bit.

Gate weights (the paper leaves them open; `gate_weights=`):
- `model` (default): the model's own convention applied to the new selection (softmax probabilities
  gathered and renormalised if the model renormalises, times `routed_scaling_factor`; GPT-OSS's
  softmax over the selected logits; DeepSeek-V3's unbiased sigmoid scores).
- `preserve_mass`: as `model`, then rescaled so that each pruned token's weights sum to what its
  unpruned weights summed to (keeps the output scale of models that do not renormalise, e.g. OLMoE).

Shape legend: T tokens, E experts, K top-k, D devices, M = max_devices_per_token.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from .metrics import contiguous_expert_device
from .models.registry import MoEArch, MoELayer, find_moe_layers

__all__ = [
    "CRITERIA",
    "GATE_WEIGHT_POLICIES",
    "PruningConfig",
    "RouterRecord",
    "device_scores",
    "limit_devices",
    "replace_by_similarity",
    "prune_topk",
    "apply_pruning",
    "remove_pruning",
    "pruned_routers",
    "collect_routing",
    "set_recording",
    "unpruned_routing",
]

CRITERIA = ("score", "similarity", "device_max", "device_topk_sum")
GATE_WEIGHT_POLICIES = ("model", "preserve_mass")


@dataclass(frozen=True)
class PruningConfig:
    """What the pruned router does.

    Args:
        num_devices: D, the expert-parallel size the budget refers to.
        max_devices_per_token: M, at most this many devices per token; None = no pruning (the router
            only records its routing).
        criterion: one of `CRITERIA`.
        gate_weights: one of `GATE_WEIGHT_POLICIES`.
    """

    num_devices: int
    max_devices_per_token: int | None = None
    criterion: str = "score"
    gate_weights: str = "model"

    def __post_init__(self):
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"devices={self.num_devices!r} must be a positive integer, e.g. devices=4")
        m = self.max_devices_per_token
        if m is not None and (not isinstance(m, int) or not 1 <= m <= self.num_devices):
            raise ValueError(
                f"max_devices_per_token={m!r} must be between 1 and devices={self.num_devices}; "
                "omit it (or pass none) for no pruning"
            )
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion={self.criterion!r} is unknown; choose one of {', '.join(CRITERIA)}")
        if self.gate_weights not in GATE_WEIGHT_POLICIES:
            raise ValueError(
                f"gate_weights={self.gate_weights!r} is unknown; choose one of {', '.join(GATE_WEIGHT_POLICIES)}"
            )

    @property
    def active(self) -> bool:
        return self.max_devices_per_token is not None and self.max_devices_per_token < self.num_devices

    def check(self, num_experts: int, top_k: int) -> None:
        """Raise ValueError when the budget cannot hold k experts or D does not divide E."""
        if num_experts % self.num_devices:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ValueError(
                f"devices={self.num_devices} does not divide the {num_experts} experts; use one of {divisors}"
            )
        m = self.max_devices_per_token
        if m is not None and m * (num_experts // self.num_devices) < top_k:
            need = -(-top_k * self.num_devices // num_experts)
            raise ValueError(
                f"max_devices_per_token={m} holds only {m * (num_experts // self.num_devices)} experts "
                f"({num_experts // self.num_devices} per device) but tokens pick top-{top_k}; use at least {need}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


# ---- pure routing maths ------------------------------------------------------------------------
def _grouped_by_device(x_TE: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int):
    """(T, D, E/D) view of per-expert values grouped by device, and the (E,) order used."""
    order_E = torch.argsort(expert_device_E, stable=True)
    return x_TE[:, order_E].reshape(x_TE.shape[0], num_devices, -1), order_E


def device_scores(
    scores_TE: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int, rank: str = "max", n: int = 1
) -> torch.Tensor:
    """(T, D) device ranking scores: best expert (`max`) or sum of the top-n experts (`topk_sum`)."""
    grouped_TDX, _ = _grouped_by_device(scores_TE, expert_device_E, num_devices)
    if rank == "max":
        return grouped_TDX.max(dim=-1).values
    if rank == "topk_sum":
        return grouped_TDX.topk(min(n, grouped_TDX.shape[-1]), dim=-1).values.sum(dim=-1)
    raise ValueError(f"rank={rank!r}: use 'max' or 'topk_sum'")


def _admitted_expert_mask(device_mask_TD: torch.Tensor, expert_device_E: torch.Tensor) -> torch.Tensor:
    return device_mask_TD[:, expert_device_E.to(device_mask_TD.device)]


def limit_devices(
    scores_TE: torch.Tensor,
    top_k: int,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int,
    rank: str = "max",
    n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the best `max_devices` devices of each token.

    Args:
        rank: `max` (devices ranked by their best expert) or `topk_sum` (by the sum of their top `n`
            scores; default n = max(1, k // max_devices)).
    Returns:
        topk_ids_TK (long, sorted by descending score) and device_mask_TD (bool, admitted devices).
    """
    n = n or max(1, top_k // max_devices)
    dev_TD = device_scores(scores_TE, expert_device_E, num_devices, rank, n)
    keep = dev_TD.topk(max_devices, dim=-1).indices
    device_mask_TD = torch.zeros_like(dev_TD, dtype=torch.bool).scatter_(1, keep, True)
    allowed_TE = _admitted_expert_mask(device_mask_TD, expert_device_E)
    masked = scores_TE.masked_fill(~allowed_TE, float("-inf"))
    return masked.topk(top_k, dim=-1).indices, device_mask_TD


def replace_by_similarity(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int,
    similarity_EE: torch.Tensor,
) -> torch.Tensor:
    """The paper's similarity criterion (see the module docstring); returns the new topk_ids_TK.

    Slots are processed in descending score order; a slot whose expert sits outside the admitted
    devices takes the most similar admitted, not yet selected expert.
    """
    n_tok, k = topk_ids_TK.shape
    dev_TD = device_scores(scores_TE, expert_device_E, num_devices, "max")
    keep = dev_TD.topk(max_devices, dim=-1).indices
    device_mask_TD = torch.zeros_like(dev_TD, dtype=torch.bool).scatter_(1, keep, True)
    allowed_TE = _admitted_expert_mask(device_mask_TD, expert_device_E)
    # process slots by descending score
    slot_scores = scores_TE.gather(1, topk_ids_TK)
    ids_TK = topk_ids_TK.gather(1, slot_scores.argsort(dim=1, descending=True)).clone()
    ok_TK = allowed_TE.gather(1, ids_TK)
    taken_TE = torch.zeros_like(allowed_TE)
    rows = torch.arange(n_tok, device=ids_TK.device)
    taken_TE[rows.unsqueeze(1).expand_as(ids_TK)[ok_TK], ids_TK[ok_TK]] = True
    sim = similarity_EE.to(scores_TE.device, torch.float32)
    for j in range(k):
        bad = ~ok_TK[:, j]
        if not bad.any():
            continue
        t = rows[bad]
        cand = sim[ids_TK[t, j]].masked_fill(~allowed_TE[t] | taken_TE[t], float("-inf"))
        new = cand.argmax(dim=-1)
        ids_TK[t, j] = new
        taken_TE[t, new] = True
    return ids_TK


def prune_topk(
    arch: MoEArch,
    router: nn.Module,
    logits_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    config: PruningConfig,
    expert_device_E: torch.Tensor,
    similarity_EE: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply `config` to one router output.

    Args:
        logits_TE: the router's raw logits; topk_ids_TK / weights_TK: its unpruned choice.
    Returns:
        (topk_ids_TK, weights_TK, changed_T) where weights keep the dtype of `weights_TK`.
    """
    m, d, k = config.max_devices_per_token, config.num_devices, topk_ids_TK.shape[1]
    counts = torch.zeros(topk_ids_TK.shape[0], d, dtype=torch.long, device=topk_ids_TK.device)
    counts.scatter_add_(1, expert_device_E[topk_ids_TK], torch.ones_like(topk_ids_TK))
    fits_T = (counts > 0).sum(dim=1) <= m
    scores = arch.selection_scores(router, logits_TE.detach())
    if config.criterion in ("score", "device_max"):
        new_ids, _ = limit_devices(scores, k, expert_device_E, d, m, "max")
    elif config.criterion == "device_topk_sum":
        new_ids, _ = limit_devices(scores, k, expert_device_E, d, m, "topk_sum", arch.group_score_topn)
    else:
        if similarity_EE is None:
            raise ValueError(
                "criterion='similarity' needs an expert similarity table; profile the model first "
                "(occult-ft profile) or choose criterion='score'"
            )
        new_ids = replace_by_similarity(scores, topk_ids_TK, expert_device_E, d, m, similarity_EE)
    if config.criterion != "device_topk_sum":
        new_ids = torch.where(fits_T.unsqueeze(1), topk_ids_TK, new_ids)
    changed_T = (new_ids.sort(dim=1).values != topk_ids_TK.sort(dim=1).values).any(dim=1)
    new_w = arch.gate_weights(router, logits_TE, new_ids)
    if config.gate_weights == "preserve_mass":
        new_w = new_w * (weights_TK.float().sum(-1, keepdim=True) / (new_w.sum(-1, keepdim=True) + 1e-20))
    new_w = new_w.to(weights_TK.dtype)
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


_PRUNED_CLASSES: dict[type, type] = {}


def _pruned_class(base: type) -> type:
    """A subclass of the model's own router class whose forward prunes; parameters keep their names."""
    if getattr(base, "_occult_pruned", False):
        return base
    if base not in _PRUNED_CLASSES:

        def forward(self, hidden_states):
            logits, weights, ids = base.forward(self, hidden_states)
            cfg: PruningConfig = self.occult_config
            ids_in = ids
            if cfg.active:
                ids, weights, _ = prune_topk(
                    self.occult_arch,
                    self,
                    logits,
                    ids,
                    weights,
                    cfg,
                    self.occult_expert_device,
                    getattr(self, "occult_similarity", None),
                )
            if self.occult_recording:
                probs = self.occult_arch.probabilities(self, logits)
                p = probs.detach()
                before = p.gather(1, ids_in).sum(-1)
                after = p.gather(1, ids).sum(-1)
                removed = ((before - after) / before.clamp_min(1e-20)).clamp_min(0.0)
                self.occult_record = RouterRecord(
                    ids.detach(), probs if self.occult_keep_graph else None, removed
                )
            return logits, weights, ids

        _PRUNED_CLASSES[base] = type(
            f"Occult{base.__name__}",
            (base,),
            {"forward": forward, "_occult_pruned": True, "__module__": __name__},
        )
    return _PRUNED_CLASSES[base]


def apply_pruning(
    model: nn.Module,
    config: PruningConfig,
    similarity: dict[int, torch.Tensor] | None = None,
    expert_device: dict[int, torch.Tensor] | None = None,
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
    Returns:
        The model's MoE layers.
    """
    layers = find_moe_layers(model)
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
        router = layer.router
        router.__class__ = _pruned_class(type(router))
        router.occult_arch = layer.arch
        router.occult_config = config
        router.occult_recording = getattr(router, "occult_recording", False)
        router.occult_keep_graph = getattr(router, "occult_keep_graph", False)
        router.occult_record = None
        ref = router.weight
        mapping = (
            expert_device[layer.index]
            if expert_device is not None
            else contiguous_expert_device(layer.num_experts, config.num_devices)
        )
        _set_buffer(router, "occult_expert_device", mapping.to(ref.device, torch.long))
        if similarity is not None and layer.index in similarity:
            _set_buffer(router, "occult_similarity", similarity[layer.index].to(ref.device, torch.float32))
    return layers


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._buffers:
        module._buffers[name] = value
    else:
        module.register_buffer(name, value, persistent=False)


def pruned_routers(model: nn.Module) -> list[tuple[MoELayer, nn.Module]]:
    """(layer, router) for every router that `apply_pruning` prepared."""
    return [
        (layer, layer.router)
        for layer in find_moe_layers(model)
        if getattr(layer.router, "_occult_pruned", False)
    ]


def remove_pruning(model: nn.Module) -> None:
    """Give every router its original class back (the model routes as before `apply_pruning`)."""
    for layer in find_moe_layers(model):
        router = layer.router
        if getattr(router, "_occult_pruned", False):
            router.__class__ = router.__class__.__mro__[1]
            for name in ("occult_expert_device", "occult_similarity"):
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
        saved.append((router, router.occult_config, router.occult_recording, router.occult_record))
        router.occult_config = replace(router.occult_config, max_devices_per_token=None)
        router.occult_recording = router.occult_recording and record
    try:
        yield model
    finally:
        for router, config, recording, last in saved:
            router.occult_config, router.occult_recording, router.occult_record = config, recording, last
