"""What the exchange benchmark replays: per MoE layer, every token's routing, and the volumes it implies.

A `Workload` holds, per MoE layer, the routing of T tokens (`topk_ids_TK`, gate weights and the router's
selection scores). It comes either from a real model run over data (`model_workload`: forward hooks on
the routers record exactly the routing the model uses) or from a synthetic OLMoE-shaped layer
(`synthetic_workload`: Gaussian router logits, so every token picks k experts uniformly at random;
for 64 experts, top-8 and 4 devices this gives C_T ~ 3.63, close to OLMoE's measured 3.68).

`routing_variants` derives what each backend replays on the D benchmark processes: the unpruned routing
(all peers and `occult_dedup`) and, per budget M, the routing after collaboration pruning with the
router-score criterion (`occult_dedup_prune{M}`), applied per layer to the router scores recorded in
the same pass; the two-stage exchange (`occult_two_stage[_prune{M}]`, with nodes > 1) replays the same
routings as its flat counterpart. Tokens are split evenly and contiguously over the D processes (`token_ranks`).

`layer_volumes` gives, from the routing alone, the (D, D) rows each backend's dispatch all-to-all
sends (the first, inter-node stage for two-stage backends; `costmodel.two_stage_rows` gives both
stages); the benchmark checks them against what its processes really sent.

Shape legend: T tokens, K experts per token, E experts, D devices, M = max_devices_per_token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..metrics import contiguous_expert_device, devices_per_token
from ..models.registry import find_moe_layers, unwrap_model
from .costmodel import capacity_rows_matrix, pruned_topk, rows_matrix, token_ranks, two_stage_rows

__all__ = [
    "PEERS",
    "OURS",
    "BACKENDS",
    "KINDS",
    "DEEPSPEED_MIN_CAPACITY",
    "TWO_STAGE",
    "CAPACITY",
    "token_capacity",
    "pruned_name",
    "two_stage_name",
    "LayerRouting",
    "Workload",
    "synthetic_workload",
    "model_workload",
    "routing_variants",
    "deepspeed_capacity",
    "layer_volumes",
    "mean_comm_complexity",
]

PEERS = ("deepspeed_classic", "deepspeed_classic_nodrop", "per_expert", "hf_native_ep")
"""Peers: DeepSpeed classic MoE (capacity factor, and drop-free), per-expert dispatch (one row per
(token, expert): what transformers native EP, DeepSpeed AutoEP, Tutel and MegaBlocks send) and
transformers' own `AllToAllEP`."""
CAPACITY = "occult_dedup_capacity"
"""The de-duplicated exchange with capacity-bounded receive buffers: C = ceil(T / D) rows to every process
(the proven bound: a token goes at most once to a device), no count exchange, no host synchronisation."""
OURS = ("occult_dedup", CAPACITY)
BACKENDS = PEERS + OURS
KINDS = {
    "deepspeed_classic": "capacity",
    "deepspeed_classic_nodrop": "capacity",
    "per_expert": "per_expert",
    "hf_native_ep": "per_expert",
    "occult_dedup": "dedup",
    CAPACITY: "dedup_capacity",
}
"""Dispatch family of each backend in `BACKENDS`, the `kind` field of the report: `capacity` (a dense
[E, C, H] buffer per process), `per_expert` (one row per (token, expert)) or `dedup` (one row per
(token, device)); `dedup_capacity` is the same exchange with padded, capacity-bounded buffers (C rows to
every process, like `capacity`, but no route dropped). The pruned variants `pruned_name(M)` are `dedup` too, with budget M; the node-aware
exchange `two_stage_name(M)` is `two_stage` (one row per (token, node) across nodes, then per device)."""
DEEPSPEED_MIN_CAPACITY = 4  # deepspeed.moe.layer.MoE(min_capacity=4), its default
TWO_STAGE = "occult_two_stage"
"""The two-stage (node-aware) de-duplicated exchange, measured when the processes span nodes > 1."""


def pruned_name(max_devices: int) -> str:
    """Backend name of de-duplicated dispatch with collaboration pruning to `max_devices` devices (a label:
    the report carries the budget itself as `max_devices_per_token`)."""
    return f"occult_dedup_prune{max_devices}"


def two_stage_name(max_devices: int | None = None) -> str:
    """Backend name of the two-stage exchange, after pruning to `max_devices` devices per token if given."""
    return TWO_STAGE if max_devices is None else f"{TWO_STAGE}_prune{max_devices}"


@dataclass
class LayerRouting:
    """One MoE layer's routing of the workload's tokens.

    Args:
        layer: MoE layer index (decoder layer of the model; 0.. for synthetic layers).
        topk_ids_TK: (T, K) int64 selected experts (in the placed model's expert ids).
        weights_TK: (T, K) float32 gate weights.
        scores_TE: (T, E) float32 router selection scores (their top-k is the model's choice).
        gate: maps a new selection (T, K) to its gate weights (the model's own convention).
    """

    layer: int
    topk_ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    scores_TE: torch.Tensor
    gate: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)

    def gate_weights(self, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.gate(topk_ids_TK).float()
        picked_TK = self.scores_TE.gather(1, topk_ids_TK)
        return picked_TK / picked_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)


@dataclass
class Workload:
    """The routings the benchmark replays.

    Args:
        name: model id/path, or "synthetic".
        num_experts: E; top_k: K; hidden: H (width of the exchanged rows).
        layers: one `LayerRouting` per measured MoE layer, all over the same T tokens.
        placement: placement file applied to the model (None: the model's own expert order).
        notes: how the routing was obtained (reported with the results).
    """

    name: str
    num_experts: int
    top_k: int
    hidden: int
    layers: list[LayerRouting]
    placement: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.layers[0].topk_ids_TK.shape[0]) if self.layers else 0

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens of every layer (so that D processes get equal shares)."""
        for lr in self.layers:
            lr.topk_ids_TK, lr.weights_TK = lr.topk_ids_TK[:num_tokens], lr.weights_TK[:num_tokens]
            lr.scores_TE = lr.scores_TE[:num_tokens]


def synthetic_workload(
    num_experts: int = 64,
    top_k: int = 8,
    tokens: int = 8192,
    hidden: int = 2048,
    num_layers: int = 1,
    seed: int = 0,
) -> Workload:
    """An OLMoE-shaped layer without a model: N(0, 1) router logits, softmax scores, top-k.

    Every token's k experts are then a uniformly random k-subset of the E experts, the setting of the
    paper's "random placement, uniform routing" formula D * (1 - C(E - E/D, k) / C(E, k)).
    """
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds the {num_experts} experts; choose top_k <= experts")
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for index in range(num_layers):
        logits_TE = torch.randn(tokens, num_experts, generator=gen)
        scores_TE = torch.softmax(logits_TE, dim=-1)
        top_TK = scores_TE.topk(top_k, dim=-1)
        weights_TK = top_TK.values / top_TK.values.sum(dim=-1, keepdim=True)
        layers.append(LayerRouting(index, top_TK.indices, weights_TK, scores_TE))
    note = f"synthetic routing: N(0,1) router logits, softmax, top-{top_k} of {num_experts} (uniform), seed {seed}"
    return Workload("synthetic", num_experts, top_k, hidden, layers, notes=[note])


class _Capture:
    """Forward hooks on the routers: keep (scores, weights, ids) of non-padding tokens per layer."""

    def __init__(self, layers, max_tokens: int | None):
        self.layers, self.max_tokens = layers, max_tokens
        self.mask_T: torch.Tensor | None = None
        self.logits: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in layers}
        self.ids: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in layers}
        self.weights: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in layers}
        self.handles = [layer.router.register_forward_hook(self._hook(layer.index)) for layer in layers]

    def _hook(self, index: int):
        def hook(module, args, output):
            logits_TE, weights_TK, ids_TK = output
            keep_T = self.mask_T.to(ids_TK.device) if self.mask_T is not None else slice(None)
            self.logits[index].append(logits_TE.detach()[keep_T].float().cpu())
            self.weights[index].append(weights_TK.detach()[keep_T].float().cpu())
            self.ids[index].append(ids_TK.detach()[keep_T].long().cpu())

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def model_workload(
    model: nn.Module,
    batches: Iterable[dict],
    name: str = "model",
    max_tokens: int | None = None,
    hidden: int | None = None,
    layer_indices: Sequence[int] | None = None,
    placement: str | None = None,
) -> Workload:
    """Run `model` over `batches` and record every MoE layer's routing of the non-padding tokens.

    Args:
        model: a supported transformers MoE model (placed already, if a placement is wanted).
        batches: dicts with `input_ids` (B, S) and optional `attention_mask` (B, S).
        name: reported model name.
        max_tokens: stop after this many non-padding tokens.
        hidden: row width to exchange (default: the model config's `hidden_size`).
        layer_indices: MoE layers (decoder layer indices) to keep (default: all).
        placement: name of the placement applied (for the report).
    """

    layers = find_moe_layers(model)
    by_index = {layer.index: layer for layer in layers}
    if layer_indices is not None:
        unknown = [i for i in layer_indices if i not in by_index]
        if unknown:
            raise ValueError(
                f"--layers {unknown} are not MoE layers of this model; it has MoE layers {sorted(by_index)}"
            )
        layers = [by_index[i] for i in layer_indices]
    width = hidden or int(getattr(unwrap_model(model).config, "hidden_size", 0))
    if width < 1:
        raise ValueError("the model config has no hidden_size; pass --hidden H")
    model.eval()
    device = next(model.parameters()).device
    capture = _Capture(layers, max_tokens)
    seen = 0
    try:
        for batch in batches:
            if max_tokens is not None and seen >= max_tokens:
                break
            ids_BS = torch.as_tensor(batch["input_ids"]).to(device)
            mask_BS = batch.get("attention_mask")
            mask_BS = torch.ones_like(ids_BS) if mask_BS is None else torch.as_tensor(mask_BS).to(device)
            capture.mask_T = mask_BS.flatten().bool()
            model(input_ids=ids_BS, attention_mask=mask_BS)
            seen += int(capture.mask_T.sum())
    finally:
        capture.close()
    if seen == 0:
        raise ValueError("the data gave no tokens; check that it is not empty")
    out = []
    for layer in layers:
        i = layer.index
        logits_TE = torch.cat(capture.logits[i])[:max_tokens]
        scores_TE = (
            layer.arch.selection_scores(layer.router, logits_TE.to(layer.router.weight.device)).float().cpu()  # type: ignore[arg-type]
        )
        gate = _model_gate(layer, logits_TE)
        out.append(
            LayerRouting(
                i,
                torch.cat(capture.ids[i])[:max_tokens],
                torch.cat(capture.weights[i])[:max_tokens],
                scores_TE,
                gate,
            )
        )
    first = layers[0]
    note = f"routing recorded from {name} on the data ({seen if max_tokens is None else min(seen, max_tokens)} tokens)"
    return Workload(name, first.num_experts, first.top_k, width, out, placement, [note])


def _model_gate(layer, logits_TE: torch.Tensor):
    """The model's own gate weights for a new selection of the first T recorded tokens (pruned variants)."""
    router, arch = layer.router, layer.arch  # not the layer: the rest of the model may be freed
    device = router.weight.device

    def gate(ids_TK: torch.Tensor) -> torch.Tensor:
        rows_TE = logits_TE[: ids_TK.shape[0]].to(device)
        return arch.gate_weights(router, rows_TE, ids_TK.to(device)).float().cpu()

    return gate


def routing_variants(workload: Workload, num_devices: int, budgets: Sequence[int]) -> dict[str, list[tuple]]:
    """Per backend name, the (topk_ids_TK, weights_TK) of every layer that backend replays.

    Peers and `occult_dedup` replay the recorded routing; `occult_dedup_prune{M}` replays it after
    collaboration pruning to M devices (router-score criterion, tokens that fit keep their experts,
    gate weights recomputed by the model's convention for the new selection).
    """
    expert_device_E = contiguous_expert_device(workload.num_experts, num_devices)
    base = [(lr.topk_ids_TK.long(), lr.weights_TK.float()) for lr in workload.layers]
    out: dict[str, list[tuple]] = {name: base for name in (*BACKENDS, TWO_STAGE)}
    for m in budgets:
        pruned = []
        for lr in workload.layers:
            ids_TK = pruned_topk(lr.scores_TE, lr.topk_ids_TK, expert_device_E, num_devices, m)
            pruned.append((ids_TK, lr.gate_weights(ids_TK)))
        out[pruned_name(m)] = out[two_stage_name(m)] = pruned
    return out


def deepspeed_capacity(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    capacity_factor: float | None,
    min_capacity: int = DEEPSPEED_MIN_CAPACITY,
) -> tuple[int, int]:
    """(capacity C, dropped routes) of DeepSpeed's `topkgating` on D ranks holding T/D tokens each.

    With a capacity factor, C = max(ceil(T_r / E * capacity_factor * K), min_capacity) per rank
    (deepspeed.moe.sharded_moe `_capacity`, which multiplies the factor by K for top-k gating), and
    each (rank, expert) keeps at most C of its routes. `capacity_factor=None` is `drop_tokens=False`:
    C = the largest (rank, expert) route count over all ranks, nothing is dropped.
    """
    k = topk_ids_TK.shape[1]
    ranks_T = token_ranks(topk_ids_TK.shape[0], num_devices)
    counts_RE = torch.zeros(num_devices, num_experts, dtype=torch.long)
    counts_RE.index_put_(
        (ranks_T[:, None].expand_as(topk_ids_TK), topk_ids_TK.long()),
        torch.ones_like(topk_ids_TK, dtype=torch.long),
        accumulate=True,
    )
    if capacity_factor is None:
        return int(counts_RE.max()) if counts_RE.numel() else 0, 0
    tokens_per_rank = int(torch.bincount(ranks_T, minlength=num_devices).max()) if ranks_T.numel() else 0
    capacity = max(math.ceil(tokens_per_rank / num_experts * capacity_factor * k), min_capacity)
    return capacity, int((counts_RE - capacity).clamp_min(0).sum())


def layer_volumes(
    topk_ids_TK: torch.Tensor,
    backend: str,
    num_experts: int,
    num_devices: int,
    capacity_factor: float = 1.0,
    min_capacity: int = DEEPSPEED_MIN_CAPACITY,
    nodes: int = 1,
) -> tuple[torch.Tensor, int]:
    """((D, D) rows the backend's dispatch all-to-all sends, routes it drops) for one layer's routing;
    for the two-stage backends (over `nodes` nodes) the rows of its first, inter-node stage."""
    expert_device_E = contiguous_expert_device(num_experts, num_devices)
    if backend.startswith(TWO_STAGE):
        return two_stage_rows(topk_ids_TK, expert_device_E, num_devices, nodes)[0], 0
    if backend in ("deepspeed_classic", "deepspeed_classic_nodrop"):
        factor = capacity_factor if backend == "deepspeed_classic" else None
        capacity, dropped = deepspeed_capacity(topk_ids_TK, num_experts, num_devices, factor, min_capacity)
        return capacity_rows_matrix(num_devices, num_experts, capacity), dropped
    if backend == CAPACITY:
        capacity = token_capacity(topk_ids_TK.shape[0], num_devices)
        return torch.full((num_devices, num_devices), capacity, dtype=torch.long), 0
    dedup = backend.startswith("occult_dedup")
    return rows_matrix(topk_ids_TK, expert_device_E, num_devices, dedup=dedup), 0


def token_capacity(num_tokens: int, num_devices: int) -> int:
    """Rows per destination of the capacity-bounded exchange: the most tokens a process holds (T split
    as `token_ranks` splits it), which no routing can overflow."""
    return -(-num_tokens // num_devices)


def mean_comm_complexity(topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int) -> float:
    """Mean C_T of one layer's routing under contiguous placement."""
    dev_E = contiguous_expert_device(num_experts, num_devices)
    if topk_ids_TK.shape[0] == 0:
        return 0.0
    return (
        int(devices_per_token(topk_ids_TK, dev_E, num_devices).sum()) / topk_ids_TK.shape[0]
    )  # exact, not fp32
