"""Communication metrics of a routing under an expert placement (pure functions, no model needed).

Vocabulary (see the Occult notes): a token's `comm_complexity` (the paper's C_T) is the number of
distinct devices that host its top-k experts; it is exactly how many rows a de-duplicated
all-to-all sends for the token, against k rows for per-expert dispatch. `intra_share` is the fraction
of co-selected expert pairs whose two experts live on the same device.

With the D devices laid out as N nodes of D/N consecutive devices (as launchers number ranks), a
token's `node_comm_complexity` (N_T) is the number of distinct nodes hosting its experts: the rows a
two-stage exchange (`occult_ft.dispatch.two_stage`) sends for it over the first stage, one per
destination node, against C_T rows for the flat de-duplicated exchange. N_T <= C_T <= K.

Shape legend: T tokens, K experts per token, E experts, D devices.
    topk_ids_TK      int, expert ids chosen per token (any order, no duplicates within a row)
    expert_device_E  int, device of each expert (values in [0, D))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .checks import divisors
from .layout import ExpertLayout
from .replicas import replica_devices

__all__ = [
    "contiguous_expert_device",
    "expert_device_from_groups",
    "device_counts",
    "devices_per_token",
    "comm_complexity",
    "expert_node",
    "nodes_per_token",
    "node_comm_complexity",
    "intra_share",
    "device_histogram",
    "device_load",
    "load_imbalance",
    "random_placement_comm_complexity",
    "comm_complexity_lower_bound",
    "LayerMetrics",
    "RoutingReport",
    "layer_metrics",
    "routing_report",
]


def contiguous_expert_device(num_experts: int, num_devices: int, device=None) -> torch.Tensor:
    """Device of each expert when device d holds experts [d*E/D, (d+1)*E/D) (every framework's default).

    Self-contained (torch and `occult_ft.checks` only, no `ExpertLayout`): `occult_ft.checkpoint.remote_code` copies this
    function's source into checkpoints; its check and message are `ExpertLayout`'s."""
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(
            f"devices={num_devices} must divide the {num_experts} experts; use one of {divisors(num_experts)}"
        )
    return torch.arange(num_experts, device=device) // (num_experts // num_devices)


def expert_device_from_groups(
    groups: Sequence[Sequence[int]], num_experts: int | None = None
) -> torch.Tensor:
    """Turn a placement (`groups[d]` = experts on device d) into `expert_device_E`."""
    num_experts = num_experts if num_experts is not None else sum(len(g) for g in groups)
    out = torch.full((num_experts,), -1, dtype=torch.long)
    for d, group in enumerate(groups):
        for e in group:
            out[int(e)] = d
    if (out < 0).any():
        missing = (out < 0).nonzero().flatten().tolist()
        raise ValueError(f"placement leaves experts {missing[:8]} without a device; every expert needs one")
    return out


def device_counts(topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int) -> torch.Tensor:
    """(T, D) number of each token's selected experts on each device."""
    dev_TK = expert_device_E.to(topk_ids_TK.device)[topk_ids_TK.long()]
    counts = torch.zeros(topk_ids_TK.shape[0], num_devices, dtype=torch.long, device=topk_ids_TK.device)
    return counts.scatter_add_(1, dev_TK, torch.ones_like(dev_TK))


def devices_per_token(
    topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int
) -> torch.Tensor:
    """(T,) C_T per token: distinct devices hosting the token's experts."""
    return (device_counts(topk_ids_TK, expert_device_E, num_devices) > 0).sum(dim=1)


def comm_complexity(topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int) -> float:
    """Mean C_T over tokens: rows per token that a de-duplicated all-to-all sends (0.0 for no tokens)."""
    if topk_ids_TK.shape[0] == 0:
        return 0.0
    return devices_per_token(topk_ids_TK, expert_device_E, num_devices).float().mean().item()


def expert_node(expert_device_E: torch.Tensor, num_devices: int, nodes: int) -> torch.Tensor:
    """(E,) node of each expert when node n holds devices [n * D/N, (n + 1) * D/N)."""
    layout = ExpertLayout(num_devices, num_devices, nodes)  # N must divide D; the mapping may be any
    return expert_device_E // layout.devices_per_node


def nodes_per_token(
    topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int, nodes: int
) -> torch.Tensor:
    """(T,) N_T per token: distinct nodes hosting the token's experts (1 <= N_T <= C_T)."""
    return devices_per_token(topk_ids_TK, expert_node(expert_device_E, num_devices, nodes), nodes)


def node_comm_complexity(
    topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int, nodes: int
) -> float:
    """Mean N_T over tokens: rows per token of the two-stage exchange's inter-node stage, one per
    destination node (the row for the token's own node, which stays on its device, included, as C_T
    includes the row a device keeps for itself); 0.0 for no tokens."""
    if topk_ids_TK.shape[0] == 0:
        return 0.0
    return int(nodes_per_token(topk_ids_TK, expert_device_E, num_devices, nodes).sum()) / topk_ids_TK.shape[0]


def intra_share(topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int) -> float:
    """Fraction of co-selected expert pairs (over all tokens) that sit on one device.

    A token with n_d experts on device d has sum_d n_d (n_d - 1) / 2 intra-device pairs out of
    K (K - 1) / 2 pairs in all.
    """
    k = topk_ids_TK.shape[1]
    if topk_ids_TK.shape[0] == 0 or k < 2:
        return 0.0
    counts = device_counts(topk_ids_TK, expert_device_E, num_devices).double()
    intra = (counts * (counts - 1) / 2).sum()
    return (intra / (topk_ids_TK.shape[0] * k * (k - 1) / 2)).item()


def device_histogram(topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int) -> list[int]:
    """hist[c] = number of tokens reaching exactly c devices, c = 0..D."""
    per_token = devices_per_token(topk_ids_TK, expert_device_E, num_devices)
    return torch.bincount(per_token, minlength=num_devices + 1).tolist()


def device_load(topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int) -> torch.Tensor:
    """(D,) rows each device receives under de-duplicated dispatch (tokens that reach it)."""
    return (device_counts(topk_ids_TK, expert_device_E, num_devices) > 0).sum(dim=0)


def load_imbalance(topk_ids_TK: torch.Tensor, expert_device_E: torch.Tensor, num_devices: int) -> float:
    """max / mean of `device_load` (1.0 = perfectly even; 0.0 for no tokens)."""
    load = device_load(topk_ids_TK, expert_device_E, num_devices).double()
    mean = load.mean()
    return (load.max() / mean).item() if mean > 0 else 0.0


def random_placement_comm_complexity(num_experts: int, top_k: int, num_devices: int) -> float:
    """Expected C_T for uniform routing and a random placement: D * (1 - C(E - E/D, k) / C(E, k))."""
    per = num_experts // num_devices
    return num_devices * (1 - math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k))


def comm_complexity_lower_bound(num_experts: int, top_k: int, num_devices: int) -> int:
    """ceil(k * D / E): k experts need at least that many devices of E/D experts."""
    return math.ceil(top_k * num_devices / num_experts)


@dataclass
class LayerMetrics:
    """Routing metrics of one MoE layer (see the module docstring for the definitions)."""

    layer: int
    tokens: int
    top_k: int
    comm_complexity: float
    intra_share: float
    devices_histogram: list[int]
    naive_rows_per_token: int
    dedup_rows_per_token: float
    load_imbalance: float
    node_comm_complexity: float | None = None


@dataclass
class RoutingReport:
    """Per-layer and overall metrics; `overall` averages over layers weighted by tokens.

    `load_imbalance` is the worst layer's device load imbalance (max / mean rows per device under
    de-duplicated dispatch), `mean_load_imbalance` its token-weighted mean over layers (each layer
    waits for its own most loaded device, so the mean is what a step feels).
    """

    num_devices: int
    num_experts: int
    top_k: int
    comm_complexity: float
    intra_share: float
    load_imbalance: float
    devices_histogram: list[int]
    layers: list[LayerMetrics] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    nodes: int = 1
    node_comm_complexity: float | None = None
    mean_load_imbalance: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def layer_metrics(
    layer: int,
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    nodes: int = 1,
    copies_ED: torch.Tensor | None = None,
) -> LayerMetrics:
    """Metrics of one layer; `node_comm_complexity` is filled when the devices span `nodes` > 1 nodes.
    With `copies_ED` (redundant experts, `occult_ft.replicas`) each row goes to the copy the replica
    rule picks, and every figure counts those devices."""
    if copies_ED is not None:
        # the rows' devices as "expert ids" of an identity placement: every metric below reads them as is
        topk_ids_TK = replica_devices(topk_ids_TK, copies_ED)
        expert_device_E = torch.arange(num_devices, device=topk_ids_TK.device)
    return LayerMetrics(
        layer=layer,
        tokens=int(topk_ids_TK.shape[0]),
        top_k=int(topk_ids_TK.shape[1]),
        comm_complexity=comm_complexity(topk_ids_TK, expert_device_E, num_devices),
        intra_share=intra_share(topk_ids_TK, expert_device_E, num_devices),
        devices_histogram=device_histogram(topk_ids_TK, expert_device_E, num_devices),
        naive_rows_per_token=int(topk_ids_TK.shape[1]),
        dedup_rows_per_token=comm_complexity(topk_ids_TK, expert_device_E, num_devices),
        load_imbalance=load_imbalance(topk_ids_TK, expert_device_E, num_devices),
        node_comm_complexity=(
            node_comm_complexity(topk_ids_TK, expert_device_E, num_devices, nodes) if nodes > 1 else None
        ),
    )


def routing_report(
    topk_ids: Mapping[int, torch.Tensor],
    expert_device: Mapping[int, torch.Tensor] | torch.Tensor,
    num_devices: int,
    num_experts: int,
    nodes: int = 1,
    copies: Mapping[int, torch.Tensor] | None = None,
) -> RoutingReport:
    """Metrics for every layer of a routing.

    Args:
        topk_ids: layer index -> topk_ids_TK.
        expert_device: layer index -> expert_device_E, or one expert_device_E for all layers.
        num_devices: D.
        num_experts: E (for the report header).
        nodes: N nodes of D/N consecutive devices; above 1, `node_comm_complexity` is reported beside
            `comm_complexity`, per layer and overall.
        copies: layer index -> copies_ED (redundant experts); the layers it names count their rows on
            the copies the replica rule picks (`occult_ft.replicas.replica_devices`).
    """
    if nodes != 1:
        expert_node(torch.zeros(1, dtype=torch.long), num_devices, nodes)  # validates nodes
    layers = []
    for idx in sorted(topk_ids):
        mapping = expert_device if isinstance(expert_device, torch.Tensor) else expert_device[idx]
        layer_copies = copies.get(idx) if copies is not None else None
        layers.append(layer_metrics(idx, topk_ids[idx], mapping, num_devices, nodes, layer_copies))
    total = sum(m.tokens for m in layers)

    def mean(attr: str) -> float:
        return sum(getattr(m, attr) * m.tokens for m in layers) / total if total else 0.0

    hist = [sum(m.devices_histogram[c] for m in layers) for c in range(num_devices + 1)]
    return RoutingReport(
        num_devices=num_devices,
        num_experts=num_experts,
        top_k=layers[0].top_k if layers else 0,
        comm_complexity=mean("comm_complexity"),
        intra_share=mean("intra_share"),
        load_imbalance=max((m.load_imbalance for m in layers), default=0.0),
        devices_histogram=hist,
        layers=layers,
        nodes=nodes,
        node_comm_complexity=mean("node_comm_complexity") if nodes > 1 else None,
        mean_load_imbalance=mean("load_imbalance"),
    )
