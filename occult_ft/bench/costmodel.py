"""A bandwidth cost model for the expert-parallel all-to-all: measured volumes -> predicted time.

The exchange benchmark (`occult_ft.bench`) measures how many rows each backend sends from every device
to every other device (a D x D row matrix per MoE layer). This module turns such a matrix into a
predicted all-to-all time on a named cluster shape, so users see what de-duplication and pruning would
gain on their hardware rather than on the benchmark's gloo processes. The model is deliberately simple,
every term visible, and written out at the lines that compute it (`predict_all_to_all_ms`).

    ClusterShape / get_cluster         named shapes: nodes, devices per node, link GB/s, latency
    rows_matrix / capacity_rows_matrix / token_ranks   rows_DD of a routing; of a capacity-based dispatch
    predict_all_to_all_ms / predict_exchange_ms        one all-to-all; dispatch + combine (its transpose)
    pruned_topk / predict_speedup      the score criterion; per-expert vs dedup vs pruned dedup times
    two_stage_rows / split_rows / predict_two_stage_exchange_ms   the two-stage exchange (stage 1 across
                                       nodes to the gateway, stage 2 inside; four all-to-alls)
    predict_node_exchange              per-expert, flat and two-stage, with and without a node budget

Shape legend: T tokens, K experts per token, E experts, D devices, N nodes, L = D / N devices per node.
    rows_DD[i, j]    rows device i sends to device j in one all-to-all (diagonal: rows kept local)
    token_rank_T     device that holds each token before dispatch (default: T/D contiguous tokens each)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..checks import is_positive_int
from ..metrics import contiguous_expert_device, device_counts, expert_node
from ..routing import limit_topk

__all__ = [
    "ClusterShape",
    "CLUSTER_PRESETS",
    "get_cluster",
    "token_ranks",
    "rows_matrix",
    "capacity_rows_matrix",
    "predict_all_to_all_ms",
    "predict_exchange_ms",
    "pruned_topk",
    "predict_speedup",
    "two_stage_rows",
    "split_rows",
    "predict_two_stage_exchange_ms",
    "predict_node_exchange",
]


@dataclass(frozen=True)
class ClusterShape:
    """A cluster of `nodes` x `devices_per_node` accelerators and its links.

    Args:
        name: preset or user-given name.
        devices_per_node: accelerators per node; device d sits on node d // devices_per_node.
        nodes: number of nodes.
        intra_node_GBps: per-device, per-direction bandwidth to a device of the same node (GB/s).
        inter_node_GBps: per-device, per-direction bandwidth to a device of another node (GB/s).
        latency_us: fixed cost added once per all-to-all (launch + link latency), microseconds.
        source: where the figures come from.
    """

    name: str
    devices_per_node: int
    nodes: int
    intra_node_GBps: float
    inter_node_GBps: float
    latency_us: float
    source: str = ""

    def __post_init__(self):
        for field_name in ("devices_per_node", "nodes"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster {self.name!r}: {field_name}={value!r} must be a positive integer")
        for field_name in ("intra_node_GBps", "inter_node_GBps"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"cluster {self.name!r}: {field_name}={value!r} must be a positive number (GB/s)"
                )
        if not isinstance(self.latency_us, (int, float)) or self.latency_us < 0:
            raise ValueError(f"cluster {self.name!r}: latency_us={self.latency_us!r} must be >= 0")

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def to_dict(self) -> dict:
        return asdict(self)


# Nominal figures (vendor datasheets / specifications, peak per direction); measured all-to-all
# bandwidth is lower, typically 70-85% of these. Latencies are order-of-magnitude assumptions for one
# NCCL all-to-all (kernel launch + link latency), not datasheet values.
CLUSTER_PRESETS: dict[str, ClusterShape] = {
    shape.name: shape
    for shape in (
        # NVIDIA H100 SXM datasheet: NVLink 4 "900 GB/s" per GPU, counted over both directions, so
        # 450 GB/s per direction; NVSwitch gives every pair full bandwidth inside a DGX/HGX node.
        # Inter-node value: one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100 datasheet) = 50 GB/s;
        # unused with one node.
        ClusterShape(
            "8xH100-nvlink",
            8,
            1,
            450.0,
            50.0,
            10.0,
            "NVIDIA H100 SXM datasheet: NVLink 900 GB/s bidirectional per GPU (nominal)",
        ),
        # The Occult paper's own setup: one node of 4 RTX A6000 on PCIe 4.0 x16. PCI-SIG PCIe 4.0:
        # 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction nominal; 25 GB/s is the usual
        # achievable peer-to-peer figure (host bridge and protocol overhead), used here.
        ClusterShape(
            "4xA6000-pcie",
            4,
            1,
            25.0,
            25.0,
            20.0,
            "NVIDIA RTX A6000 datasheet: PCIe 4.0 x16 (31.5 GB/s nominal per direction, ~25 usable)",
        ),
        # 2 DGX-H100-like nodes, links as in 4x8-ib below.
        ClusterShape(
            "2x8-ib",
            8,
            2,
            450.0,
            50.0,
            30.0,
            "H100 NVLink 450 GB/s/direction intra-node; ConnectX-7 400 Gb/s NDR IB = 50 GB/s inter-node "
            "(nominal)",
        ),
        # 4 DGX-H100-like nodes: NVLink 450 GB/s per direction inside a node (as above); between nodes
        # 400 Gb/s InfiniBand NDR per GPU (NVIDIA ConnectX-7 datasheet) = 50 GB/s per direction.
        ClusterShape(
            "4x8-ib",
            8,
            4,
            450.0,
            50.0,
            30.0,
            "H100 NVLink 450 GB/s/direction intra-node; ConnectX-7 400 Gb/s NDR IB = 50 GB/s inter-node "
            "(nominal)",
        ),
    )
}

_SPEC_KEYS = {
    "devices_per_node": "devices_per_node",
    "dpn": "devices_per_node",
    "nodes": "nodes",
    "intra": "intra_node_GBps",
    "inter": "inter_node_GBps",
    "latency": "latency_us",
}


def get_cluster(spec: str | ClusterShape) -> ClusterShape:
    """A preset by name, or a custom shape from `NAME:devices_per_node=8,nodes=2,intra=450,inter=50,latency=10`.

    Raises:
        ValueError: for an unknown preset or a malformed spec (one line naming the presets).
    """
    if isinstance(spec, ClusterShape):
        return spec
    if spec in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[spec]
    presets = ", ".join(CLUSTER_PRESETS)
    if ":" not in spec:
        raise ValueError(
            f"unknown cluster {spec!r}; choose one of {presets} or give "
            "NAME:devices_per_node=8,nodes=2,intra=450,inter=50,latency=10 (GB/s, microseconds)"
        )
    name, _, body = spec.partition(":")
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, eq, text = item.partition("=")
        if not eq or key.strip() not in _SPEC_KEYS:
            raise ValueError(f"cluster spec {spec!r}: cannot read {item!r}; keys are {', '.join(_SPEC_KEYS)}")
        try:
            values[_SPEC_KEYS[key.strip()]] = float(text)
        except ValueError:
            raise ValueError(f"cluster spec {spec!r}: {key.strip()}={text!r} is not a number") from None
    missing = [k for k in ("devices_per_node", "intra_node_GBps") if k not in values]
    if missing:
        raise ValueError(
            f"cluster spec {spec!r} lacks {', '.join(missing)}; e.g. {name}:devices_per_node=8,intra=450"
        )
    for key in ("devices_per_node", "nodes"):
        if key in values and values[key] != int(values[key]):
            raise ValueError(f"cluster spec {spec!r}: {key}={values[key]} must be a whole number")
    dpn = int(values["devices_per_node"])
    return ClusterShape(
        name=name or "custom",
        devices_per_node=dpn,
        nodes=int(values.get("nodes", 1)),
        intra_node_GBps=values["intra_node_GBps"],
        inter_node_GBps=values.get("inter_node_GBps", values["intra_node_GBps"]),
        latency_us=values.get("latency_us", 0.0),
        source="user-given",
    )


def token_ranks(num_tokens: int, num_devices: int) -> torch.Tensor:
    """(T,) device holding each token when T tokens are split evenly and contiguously over D devices.

    With T not divisible by D the first T % D devices hold one token more (torch.tensor_split rule).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be at least 1")
    sizes = [len(chunk) for chunk in torch.arange(num_tokens).tensor_split(num_devices)]
    return torch.repeat_interleave(torch.arange(num_devices), torch.tensor(sizes, dtype=torch.long))


def rows_matrix(
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    dedup: bool = True,
    token_rank_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """(D, D) int64 rows sent from each device to each device by one dispatch all-to-all.

    Args:
        topk_ids_TK: every token's selected experts.
        expert_device_E: device of each expert.
        num_devices: D.
        dedup: True for de-duplicated dispatch (one row per (token, device): Occult, DeepEP), False for
            per-expert dispatch (one row per (token, expert): transformers native EP, DeepSpeed AutoEP,
            Tutel, MegaBlocks).
        token_rank_T: device holding each token (default `token_ranks(T, D)`).

    Returns:
        rows_DD; its total is sum over tokens of C_T (dedup) or T * K (per expert).
    """
    counts_TD = device_counts(topk_ids_TK, expert_device_E, num_devices)
    per_token_TD = (counts_TD > 0).long() if dedup else counts_TD
    ranks_T = token_ranks(topk_ids_TK.shape[0], num_devices) if token_rank_T is None else token_rank_T.long()
    rows_DD = torch.zeros(num_devices, num_devices, dtype=torch.long)
    return rows_DD.index_add_(0, ranks_T.cpu(), per_token_TD.cpu())


def capacity_rows_matrix(num_devices: int, num_experts: int, capacity: int) -> torch.Tensor:
    """(D, D) rows of a capacity-based dispatch (DeepSpeed classic MoE, GShard): every device sends a dense
    [E, C, H] buffer with equal splits, C * E / D rows to each device, whatever the routing."""
    if num_experts % num_devices:
        raise ValueError(f"devices={num_devices} must divide the {num_experts} experts")
    return torch.full((num_devices, num_devices), capacity * (num_experts // num_devices), dtype=torch.long)


def predict_all_to_all_ms(
    rows_DD: torch.Tensor | Sequence[Sequence[int]], bytes_per_row: float, shape: ClusterShape
) -> float:
    """Predicted time of one all-to-all (the formula is in the comments of the body).

    Args:
        rows_DD: (D, D) rows device i sends to device j; D must equal `shape.num_devices`.
        bytes_per_row: bytes of one row (hidden size x element size, plus any metadata per row).
        shape: the cluster.

    Returns:
        Milliseconds: max over devices of max(send, receive) link time, plus the latency.
    """
    rows = torch.as_tensor(rows_DD, dtype=torch.float64)
    d = rows.shape[0]
    if rows.dim() != 2 or rows.shape[1] != d:
        raise ValueError(f"rows matrix must be square (D, D), got shape {tuple(rows.shape)}")
    if d != shape.num_devices:
        raise ValueError(
            f"rows matrix covers {d} devices but cluster {shape.name!r} has {shape.num_devices} "
            f"({shape.nodes} x {shape.devices_per_node}); compute the volumes for {shape.num_devices} devices"
        )
    # The model: bytes(i -> j) = rows_DD[i, j] * bytes_per_row (rows a device sends itself are free);
    # link(i, j) = intra_node_GBps if i and j share a node, else inter_node_GBps (per device and
    # direction, 1 GB/s = 1e9 B/s); send_ms(i) = sum_{j != i} bytes(i -> j) / link(i, j), recv_ms(i)
    # likewise over what i receives; all_to_all_ms = max_i max(send_ms(i), recv_ms(i)) + latency.
    # Links are full duplex (hence the max of send and receive), but one device's intra- and inter-node
    # traffic is *added*, not overlapped: conservative (NVLink and the NIC can run concurrently, but
    # both draw on the same GPU copy engines and memory).
    node_D = torch.arange(d) // shape.devices_per_node
    same_node_DD = node_D[:, None] == node_D[None, :]
    # ms per byte on each link: 1 GB/s = 1e9 B/s = 1e6 B/ms
    ms_per_byte_DD = torch.where(
        same_node_DD, 1.0 / (shape.intra_node_GBps * 1e6), 1.0 / (shape.inter_node_GBps * 1e6)
    ).double()
    ms_per_byte_DD.fill_diagonal_(0.0)  # rows a device keeps never touch a link
    link_ms_DD = rows * float(bytes_per_row) * ms_per_byte_DD
    send_D, recv_D = link_ms_DD.sum(dim=1), link_ms_DD.sum(dim=0)
    return float(torch.maximum(send_D, recv_D).max()) + shape.latency_us / 1000.0


def predict_exchange_ms(rows_DD, bytes_per_row: float, shape: ClusterShape) -> float:
    """One MoE layer's forward exchange: dispatch (rows_DD) + combine (its transpose) = 2 all-to-alls."""
    # the transpose has the same per-device maxima (a device's sends become its receives): twice one all-to-all
    rows = torch.as_tensor(rows_DD)
    return predict_all_to_all_ms(rows, bytes_per_row, shape) + predict_all_to_all_ms(
        rows.T, bytes_per_row, shape
    )


def pruned_topk(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    max_devices: int,
) -> torch.Tensor:
    """Collaboration pruning with the router-score criterion (`occult_ft.routing.limit_topk`, "score").

    Tokens whose top-k already fits in `max_devices` devices keep their selection; the others walk their
    top-k by descending score, admit devices until `max_devices` are admitted and take the top-k among
    the experts there.
    """
    return limit_topk(scores_TE, topk_ids_TK, expert_device_E, num_devices, max_devices, "score")


def predict_speedup(
    scores_TE: torch.Tensor,
    top_k: int,
    shape: ClusterShape,
    bytes_per_row: float,
    budgets: Iterable[int] = (2, 1),
    topk_ids_TK: torch.Tensor | None = None,
    expert_device_E: torch.Tensor | None = None,
) -> dict[str, dict[str, Any]]:
    """Predicted exchange time of per-expert dispatch, de-duplicated dispatch and pruned de-duplicated
    dispatch for each budget, on `shape` (its D devices), from one layer's router scores.

    Args:
        scores_TE: (T, E) router selection scores of one layer.
        top_k: K.
        shape: the cluster; E must be divisible by its device count.
        bytes_per_row: bytes per row (e.g. hidden size x 2 for bf16).
        budgets: max_devices_per_token values to evaluate (those >= D equal plain de-duplication).
        topk_ids_TK: the unpruned selection (default: top-k of `scores_TE`).
        expert_device_E: placement (default: contiguous blocks of E / D experts).

    Returns:
        name -> {"kind", "max_devices_per_token", "num_devices", "rows_per_token", "exchange_ms",
        "speedup_vs_per_expert"} for "per_expert", "dedup" and "dedup_prune{M}"; `kind` is "per_expert" or
        "dedup", `max_devices_per_token` the budget M (None when unpruned), `num_devices` the shape's D.
    """
    num_devices, num_experts = shape.num_devices, scores_TE.shape[1]
    dev_E = contiguous_expert_device(num_experts, num_devices) if expert_device_E is None else expert_device_E
    ids_TK = scores_TE.topk(top_k, dim=-1).indices if topk_ids_TK is None else topk_ids_TK.long()
    # name -> (selection, de-duplicated, budget)
    routings: dict[str, tuple[torch.Tensor, bool, int | None]] = {
        "per_expert": (ids_TK, False, None),
        "dedup": (ids_TK, True, None),
    }
    for m in budgets:
        if not 1 <= m or m * (num_experts // num_devices) < top_k:
            raise ValueError(
                f"max_devices_per_token={m} cannot hold top-{top_k} with {num_experts // num_devices} experts per "
                f"device; use at least {math.ceil(top_k * num_devices / num_experts)}"
            )
        routings[f"dedup_prune{m}"] = (
            pruned_topk(scores_TE, ids_TK, dev_E, num_devices, min(m, num_devices)),
            True,
            int(m),
        )
    out: dict[str, dict[str, Any]] = {}
    tokens = max(1, ids_TK.shape[0])
    for name, (ids, dedup, budget) in routings.items():
        rows_DD = rows_matrix(ids, dev_E, num_devices, dedup=dedup)
        out[name] = {
            "kind": "dedup" if dedup else "per_expert",
            "max_devices_per_token": budget,
            "num_devices": num_devices,
            "rows_per_token": float(rows_DD.sum()) / tokens,
            "exchange_ms": predict_exchange_ms(rows_DD, bytes_per_row, shape),
        }
    base = out["per_expert"]["exchange_ms"]
    for entry in out.values():
        entry["speedup_vs_per_expert"] = base / entry["exchange_ms"] if entry["exchange_ms"] > 0 else math.inf
    return out


def two_stage_rows(
    topk_ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    nodes: int,
    token_rank_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stage1_DD, stage2_DD) int64 rows of the two-stage exchange's two dispatch all-to-alls.

    A pure simulator of `occult_ft.dispatch.two_stage`: device i (node n, local index l = i % L) sends
    each of its tokens once to every node m hosting one of the token's experts, to the gateway m * L + l
    (stage 1; m = n is the gateway i itself, a row that stays on the device); the gateway sends it once
    to every device of node m hosting one of its experts (stage 2; the gateway itself included).

    Args:
        topk_ids_TK: every token's selected experts.
        expert_device_E: device of each expert.
        num_devices: D.
        nodes: N, dividing D; node n holds devices [n * L, (n + 1) * L).
        token_rank_T: device holding each token (default `token_ranks(T, D)`).

    Returns:
        stage1_DD: totals sum over tokens of N_T (`occult_ft.metrics.nodes_per_token`); nonzero only
            between devices of one local index. stage2_DD: totals sum over tokens of C_T; nonzero only
            inside nodes.
    """
    expert_node(expert_device_E, num_devices, nodes)  # validates nodes
    per_node = num_devices // nodes
    num_tokens = topk_ids_TK.shape[0]
    present_TD = device_counts(topk_ids_TK, expert_device_E, num_devices).cpu() > 0
    present_TN = present_TD.view(num_tokens, nodes, per_node).any(dim=2)
    ranks_T = token_ranks(num_tokens, num_devices) if token_rank_T is None else token_rank_T.long().cpu()
    local_T = ranks_T % per_node
    stage1_DD = torch.zeros(num_devices, num_devices, dtype=torch.long)
    tok_P, node_P = present_TN.nonzero(as_tuple=True)
    stage1_DD.index_put_(
        (ranks_T[tok_P], node_P * per_node + local_T[tok_P]), torch.ones_like(tok_P), accumulate=True
    )
    stage2_DD = torch.zeros(num_devices, num_devices, dtype=torch.long)
    tok_Q, dev_Q = present_TD.nonzero(as_tuple=True)
    gateway_Q = dev_Q // per_node * per_node + local_T[tok_Q]
    stage2_DD.index_put_((gateway_Q, dev_Q), torch.ones_like(tok_Q), accumulate=True)
    return stage1_DD, stage2_DD


def split_rows(rows_DD: torch.Tensor, devices_per_node: int) -> dict[str, int]:
    """Rows of one all-to-all by where they travel: `kept` (device to itself, no link), `intra_node`
    (between two devices of one node) and `cross_node` (between nodes); the three sum to the total."""
    rows = torch.as_tensor(rows_DD, dtype=torch.long)
    d = rows.shape[0]
    if devices_per_node < 1 or d % devices_per_node:
        raise ValueError(f"devices_per_node={devices_per_node} does not divide the {d} devices of the matrix")
    node_D = torch.arange(d) // devices_per_node
    same_DD = node_D[:, None] == node_D[None, :]
    kept = int(rows.diagonal().sum())
    return {
        "kept": kept,
        "intra_node": int(rows[same_DD].sum()) - kept,
        "cross_node": int(rows[~same_DD].sum()),
    }


def predict_two_stage_exchange_ms(
    stage1_DD: torch.Tensor, stage2_DD: torch.Tensor, bytes_per_row: float, shape: ClusterShape
) -> float:
    """One MoE layer's forward two-stage exchange: stage 1 and stage 2 dispatch, then their combines
    (transposes), four all-to-alls each priced by `predict_all_to_all_ms` (latency paid four times)."""
    s1, s2 = torch.as_tensor(stage1_DD), torch.as_tensor(stage2_DD)
    return predict_exchange_ms(s1, bytes_per_row, shape) + predict_exchange_ms(s2, bytes_per_row, shape)


def predict_node_exchange(
    scores_TE: torch.Tensor,
    top_k: int,
    shape: ClusterShape,
    bytes_per_row: float,
    node_budgets: Iterable[int] = (1,),
    topk_ids_TK: torch.Tensor | None = None,
    expert_device_E: torch.Tensor | None = None,
) -> dict[str, dict[str, float]]:
    """Predicted forward exchange of per-expert dispatch, flat de-duplication ("dedup") and two-stage
    de-duplication ("two_stage") on `shape`, without and with a node budget M (node-limited routing,
    score criterion: tokens keep their experts if they fit in M nodes, else take the top-k inside their
    M best nodes): "dedup_nodes{M}", "two_stage_nodes{M}".

    Returns:
        name -> {"rows_per_token" (first stage for two-stage), "cross_node_rows_per_token",
        "intra_node_rows_per_token", "exchange_ms", "speedup_vs_per_expert"}.
    """
    num_devices, num_experts, nodes = shape.num_devices, scores_TE.shape[1], shape.nodes
    dev_E = contiguous_expert_device(num_experts, num_devices) if expert_device_E is None else expert_device_E
    node_E = expert_node(dev_E, num_devices, nodes)
    ids_TK = scores_TE.topk(top_k, dim=-1).indices if topk_ids_TK is None else topk_ids_TK.long()
    routings: dict[str, torch.Tensor] = {"": ids_TK}
    for m in node_budgets:
        per_node = num_experts // nodes
        if not is_positive_int(m) or m * per_node < top_k:
            raise ValueError(
                f"node budget {m!r} cannot hold top-{top_k} with {per_node} experts per node; use at least "
                f"{math.ceil(top_k / per_node)}"
            )
        routings[f"_nodes{m}"] = pruned_topk(scores_TE, ids_TK, node_E, nodes, min(m, nodes))
    tokens = max(1, ids_TK.shape[0])
    out: dict[str, dict[str, float]] = {}

    def entry(first_DD: torch.Tensor, link_DDs: list[torch.Tensor], ms: float) -> dict[str, float]:
        split = [split_rows(r, shape.devices_per_node) for r in link_DDs]
        return {
            "rows_per_token": float(first_DD.sum()) / tokens,
            "cross_node_rows_per_token": sum(p["cross_node"] for p in split) / tokens,
            "intra_node_rows_per_token": sum(p["intra_node"] for p in split) / tokens,
            "exchange_ms": ms,
        }

    for suffix, ids in routings.items():
        if not suffix:
            per_expert_DD = rows_matrix(ids, dev_E, num_devices, dedup=False)
            out["per_expert"] = entry(
                per_expert_DD, [per_expert_DD], predict_exchange_ms(per_expert_DD, bytes_per_row, shape)
            )
        flat_DD = rows_matrix(ids, dev_E, num_devices, dedup=True)
        out[f"dedup{suffix}"] = entry(flat_DD, [flat_DD], predict_exchange_ms(flat_DD, bytes_per_row, shape))
        s1, s2 = two_stage_rows(ids, dev_E, num_devices, nodes)
        out[f"two_stage{suffix}"] = entry(
            s1, [s1, s2], predict_two_stage_exchange_ms(s1, s2, bytes_per_row, shape)
        )
    base = out["per_expert"]["exchange_ms"]
    for value in out.values():
        value["speedup_vs_per_expert"] = base / value["exchange_ms"] if value["exchange_ms"] > 0 else math.inf
    return out
