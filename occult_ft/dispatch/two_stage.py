"""The two-stage (node-aware) de-duplicated exchange: **a token crosses the network once per node**.

With the expert-parallel group of D ranks laid out as N nodes of L = D / N ranks (consecutive ranks on
one node, as launchers number them: rank r is local index l = r % L of node n = r // L), the flat
exchange (`alltoall.py`) sends a token once per *device*, so a token with experts on three devices of
a remote node crosses the slow inter-node link three times. Here it crosses once per *node*:

1. stage 1, inter-node (`NodeGroups.inter_group`, the N ranks of local index l, one per node, as in
   DeepEP / DeepSeek-V3): `compute_layout` with the N nodes as the "devices" (node m holds experts
   [m * L * P, (m + 1) * L * P)) sends each token once to every node hosting one of its experts, to the
   rank of that node with the sender's local index (its *gateway*), with the K gate weights and the
   K node-local expert ids (-1 for experts on other nodes) as in the flat exchange;
2. stage 2, intra-node (`NodeGroups.intra_group`, the L ranks of one node): the gateway fans each
   received row out once to every device of its node that hosts one of the row's experts
   (`fanout_layout`: the same de-duplication rule, reading node-local ids with sentinels);
3. `local_experts_forward` on each device, as in the flat exchange;
4. combine in reverse: stage 2's combine sums the node's devices into one row per (token, node) at the
   gateway (rounded once to the hidden dtype: that row is what crosses back), stage 1's combine brings
   that one row home and sums over nodes (in at least fp32).

Rows over the inter-node stage per token = N_T, the distinct nodes of its experts
(`occult_ft.metrics.nodes_per_token`); rows over the intra-node stage per token = C_T. The sum is
re-associated (over devices inside a node, then over nodes), so results equal the flat exchange and the
unsharded layer to float rounding, outputs and all gradients; gradients flow through both stages by the
reverse exchanges of `comm.all_to_all_rows`. Every rank of the EP group must call the layer, also
without tokens. Collectives per layer: forward 1 (an all-gather of every rank's counts: rows per node,
rows per device, pairs per expert, from which each rank works out both stages' splits and its expert
counts) + 2 x rows + 2 combines, backward 4; one host synchronisation (the counts' `.tolist()`).

`TwoStageExchange` has the dispatch / combine contract of `exchange.Exchange`; `two_stage_moe_forward`
is `moe_forward` through it.

`node_groups` builds (once, cached) the sub-groups from the EP group with `torch.distributed.new_group`;
that is a collective over the *whole* world (every rank creates every sub-group of every EP group, in
one order), so the first call must happen on all ranks at once, as the first MoE forward does.

Shape legend:
    T  tokens on this rank    K  experts per token    H  hidden size    E  experts    D  ranks (EP)
    N  nodes    L  ranks per node (D / N)    P  experts per rank (E / D)
    S  rows sent by stage 1   R  rows received by stage 1 (this rank as gateway)
    U  rows sent by stage 2   V  rows received by stage 2 (this rank as expert host)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..layout import ExpertLayout
from .comm import group_size_and_rank
from .exchange import Exchange, ReceivedRows, check_hidden, moe_forward, return_rows, send_rows
from .layout import DispatchLayout, dedup_plan, layout_from_plan, raise_bad_ids
from .local import num_local_experts

__all__ = [
    "NodeGroups",
    "node_groups",
    "fanout_layout",
    "TwoStageHandle",
    "TwoStageExchange",
    "two_stage_dispatch",
    "two_stage_combine",
    "two_stage_moe_forward",
]


@dataclass(frozen=True, eq=False)
class NodeGroups:
    """The expert-parallel group seen as N nodes of L ranks, with the two sub-groups one rank uses.

    Attributes:
        nodes: N.  local_size: L = D / N.  node: this rank's node n.  local_rank: its index l in it.
        inter_group: the N ranks with local index l (group rank = node index); None only without
            torch.distributed (D = 1).
        intra_group: the L ranks of node n (group rank = local index); None likewise.
        ep_group: the expert-parallel group they were built from (None: the default group).
    """

    nodes: int
    local_size: int
    node: int
    local_rank: int
    inter_group: dist.ProcessGroup | None
    intra_group: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None = None

    @property
    def num_devices(self) -> int:
        return self.nodes * self.local_size


# (id(group), N) -> (the default group when built, the group, NodeGroups); the references keep the ids
# unique, and a re-initialised torch.distributed (new default group) invalidates the entry.
_GROUP_CACHE: dict[tuple[int, int], tuple[object, object, NodeGroups]] = {}


def node_groups(nodes: int, group: dist.ProcessGroup | None = None) -> NodeGroups:
    """The `NodeGroups` of this rank for `nodes` nodes over the EP `group` (cached per group and N).

    The first call for a (group, N) is a collective over the whole world: every rank creates every
    inter- and intra-node sub-group of every EP group (gathered from all ranks), in the same order.

    Raises:
        ValueError: when N does not divide the group's size.
    """
    num_devices, rank = group_size_and_rank(group)
    ExpertLayout(num_devices, num_devices, nodes)  # N must divide D (E plays no part here)
    world_pg = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    key = (id(group), nodes)
    cached = _GROUP_CACHE.get(key)
    if cached is not None and cached[0] is world_pg and cached[1] is group:
        return cached[2]
    local_size = num_devices // nodes
    node, local_rank = rank // local_size, rank % local_size
    inter = intra = None
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        ep_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
        if len(ep_ranks) == world:
            all_ep = [ep_ranks]
        else:  # several EP groups (data parallel x expert parallel): every rank builds all sub-groups
            gathered: list[tuple[int, ...] | None] = [None] * world
            dist.all_gather_object(gathered, ep_ranks)
            all_ep = sorted(set(gathered))  # type: ignore[arg-type]
        my_inter = [ep_ranks[m * local_size + local_rank] for m in range(nodes)]
        my_intra = list(ep_ranks[node * local_size : (node + 1) * local_size])
        for ranks in all_ep:
            subgroups = [[ranks[m * local_size + li] for m in range(nodes)] for li in range(local_size)]
            subgroups += [list(ranks[m * local_size : (m + 1) * local_size]) for m in range(nodes)]
            for index, members in enumerate(subgroups):  # one-rank groups too: None = the default group
                created = dist.new_group(members)
                if ranks == ep_ranks and index < local_size and members == my_inter:
                    inter = created
                elif ranks == ep_ranks and index >= local_size and members == my_intra:
                    intra = created
    result = NodeGroups(nodes, local_size, node, local_rank, inter, intra, group)
    _GROUP_CACHE[key] = (world_pg, group, result)
    return result


def fanout_layout(
    local_ids_RK: torch.Tensor, weights_RK: torch.Tensor, experts_per_device: int, num_devices: int, rank: int
) -> DispatchLayout:
    """Stage-2 layout: the gateway's received rows -> the devices of its node (one row per device).

    Like `compute_layout`, for rows whose slots hold node-local expert ids in [0, L * P) or
    `LOCAL_SENTINEL` (-1, an expert on another node, weight 0): **a row is sent once per device of the
    node however many of its experts live there**; sentinel slots reach no device. One host read (the
    counts); inside a layer `TwoStageExchange` folds it into its count exchange.

    Args:
        local_ids_RK: (R, K) int64 node-local expert ids or -1 (every row has at least one id).
        weights_RK: (R, K) gate weights (0 at sentinel slots); differentiable.
        experts_per_device: P.  num_devices: L, devices of the node.  rank: this gateway's index l.

    Returns:
        A `DispatchLayout` over the R rows (num_tokens = R, num_experts = L * P, num_devices = L).
    """
    layout = ExpertLayout(experts_per_device * num_devices, num_devices)
    plan = dedup_plan(local_ids_RK, weights_RK, layout, rank, sentinel_in=True)
    counts = plan.meta_DC[:, [0, -1]].tolist()
    if counts[0][1]:
        raise_bad_ids(local_ids_RK, layout.num_experts, sentinel_in=True)
    return layout_from_plan(plan, tuple(int(c[0]) for c in counts))


@dataclass(frozen=True, eq=False)
class TwoStageHandle:
    """Immutable handle of one two-stage dispatch, consumed by the combine (and backward).

    Attributes:
        node_layout: stage 1 layout (the N nodes as devices): rows_sent = sum of N_T over this rank's
            tokens; send_splits[n] rows go to node n's gateway (send_splits[node] stays on this rank).
        node_received: stage 1 `ReceivedRows` (this rank as gateway: R rows with node-local ids).
        device_layout: stage 2 layout of the R rows over the node's L devices.
        device_received: stage 2 `ReceivedRows` (this rank as expert host: V rows, local ids).
        groups: the `NodeGroups` used.
    """

    node_layout: DispatchLayout
    node_received: ReceivedRows
    device_layout: DispatchLayout
    device_received: ReceivedRows
    groups: NodeGroups

    @property
    def recv_local_ids_RJ(self) -> torch.Tensor:
        """(V, K) local expert ids of the rows this rank's experts receive."""
        return self.device_received.recv_local_ids_RK

    @property
    def expert_counts(self):
        return self.device_received.expert_counts

    @property
    def node_rows(self) -> int:
        """Stage-1 rows this rank sends (its own node's included) = sum over its tokens of N_T."""
        return self.node_layout.rows_sent

    @property
    def rows_sent(self) -> int:
        return self.node_rows

    @property
    def cross_node_rows(self) -> int:
        """Stage-1 rows that leave this rank's node (the inter-node link)."""
        return self.node_layout.rows_sent - self.node_layout.rows_kept_local

    @property
    def intra_node_rows(self) -> int:
        """Stage-2 rows this rank (as gateway) sends to other devices of its node."""
        return self.device_layout.rows_sent - self.device_layout.rows_kept_local


class TwoStageExchange(Exchange):
    """Once per (token, node) across nodes to the gateway of the sender's local index, then once per
    (token, device) inside the node; combine in reverse (see the module docstring).

    Args:
        layout: E experts on D = N x L ranks (`ExpertLayout(E, D, N)`).
        groups: this rank's `NodeGroups` for N (`node_groups(N, ep_group)`).
    """

    name = "two_stage"

    def __init__(self, layout: ExpertLayout, groups: NodeGroups):
        if groups.nodes != layout.num_nodes or groups.num_devices != layout.num_devices:
            raise ValueError(
                f"node groups of {groups.nodes} x {groups.local_size} ranks do not match the layout's "
                f"{layout.num_nodes} nodes of {layout.devices_per_node} devices"
            )
        self.layout, self.groups, self.group = layout, groups, groups.ep_group
        self.rank = groups.node * groups.local_size + groups.local_rank
        self.fanout = layout.node_local()

    def dispatch(self, hidden_TH, topk_ids_TK, weights_TK):
        check_hidden(hidden_TH, topk_ids_TK)
        groups, layout, me = self.groups, self.layout, self.groups.local_rank
        plan1 = dedup_plan(topk_ids_TK, weights_TK, layout.nodes_view(), groups.node)
        sends1, recvs1, sends2, recvs2, counts = self._counts(plan1)  # the layer's one host read
        node_layout = layout_from_plan(plan1, sends1)
        node_x_RH, node_w_RK, node_ids_RK = send_rows(hidden_TH, node_layout, recvs1, groups.inter_group)
        node_received = ReceivedRows(node_layout, recvs1, node_ids_RK)
        plan2 = dedup_plan(node_ids_RK, node_w_RK, self.fanout, me, sentinel_in=True)
        device_layout = layout_from_plan(plan2, sends2)
        recv_x_VH, recv_w_VK, recv_ids_VK = send_rows(node_x_RH, device_layout, recvs2, groups.intra_group)
        device_received = ReceivedRows(device_layout, recvs2, recv_ids_VK, counts)
        handle = TwoStageHandle(node_layout, node_received, device_layout, device_received, groups)
        return recv_x_VH, recv_w_VK, handle

    def _counts(self, plan1):
        """Every split of both stages and this rank's expert counts, from one all-gather of each rank's
        (rows per node, rows per device, pairs per expert, bad ids) and one `.tolist()`.

        Rank s = (node n_s, local index l_s) sends node_rows_s[m] rows to gateway (m, l_s); gateway
        (m, l) fans each row out to the devices of node m its token reaches, so it sends device (m, l')
        the sum over senders s with l_s = l of dev_rows_s[(m, l')]; a device's experts receive every
        (token, slot) that selects them, from whichever rank."""
        layout, groups = self.layout, self.groups
        n, l_size, e, d = layout.num_nodes, layout.devices_per_node, layout.num_experts, layout.num_devices
        ids_TK = plan1.topk_ids_TK.long()
        valid_TK = (ids_TK >= 0) & (ids_TK < e)
        dev_TK = torch.where(valid_TK, ids_TK, 0) // layout.experts_per_device
        dev_TK = torch.where(valid_TK, dev_TK, d)
        reached_TD = torch.zeros(ids_TK.shape[0], d + 1, dtype=torch.bool, device=ids_TK.device)
        reached_TD.scatter_(1, dev_TK, True)
        mine = torch.cat(
            [
                plan1.meta_DC[:, 0],  # rows to each node (N)
                reached_TD[:, :d].sum(dim=0),  # rows reaching each device (D)
                plan1.meta_DC[:, 1:-1].reshape(-1),  # (token, slot) pairs per expert (E, node-major)
                plan1.meta_DC[:1, -1],  # ids outside [0, E)
            ]
        ).long()
        table = _all_gather_rows(mine, groups.ep_group, d).tolist()  # (D ranks, N + D + E + 1)
        bad = [s for s, row in enumerate(table) if row[-1]]
        if bad:
            if table[self.rank][-1]:
                raise_bad_ids(ids_TK, e)
            raise ValueError(
                f"ranks {bad} routed tokens to expert ids outside [0, num_experts={e}); see their error"
            )
        node, me = groups.node, groups.local_rank
        rank_of = [[m * l_size + li for li in range(l_size)] for m in range(n)]  # rank of (node m, local li)
        sends1 = tuple(table[self.rank][m] for m in range(n))
        recvs1 = tuple(table[rank_of[m][me]][node] for m in range(n))
        senders = [rank_of[m][me] for m in range(n)]  # the ranks this gateway serves
        sends2 = tuple(sum(table[s][n + rank_of[node][li]] for s in senders) for li in range(l_size))
        recvs2 = tuple(sum(table[rank_of[m][li]][n + self.rank] for m in range(n)) for li in range(l_size))
        p = layout.experts_per_device
        first = n + d + self.rank * p
        counts = tuple(sum(row[first + j] for row in table) for j in range(p))
        return sends1, recvs1, sends2, recvs2, counts

    def combine(self, out_RH, handle, out_dtype=None):
        dtype = out_dtype or out_RH.dtype
        node_RH = return_rows(out_RH, handle.device_received, self.groups.intra_group, dtype)
        return return_rows(node_RH, handle.node_received, self.groups.inter_group, dtype)


def _all_gather_rows(row_C: torch.Tensor, group: dist.ProcessGroup | None, world: int) -> torch.Tensor:
    """(world, C): every rank's `row_C`, in group rank order (no collective for one rank)."""
    if world == 1:
        return row_C.unsqueeze(0)
    pieces = [torch.empty_like(row_C) for _ in range(world)]
    dist.all_gather(pieces, row_C.contiguous(), group=group)
    return torch.stack(pieces)


def two_stage_dispatch(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    groups: NodeGroups,
) -> tuple[torch.Tensor, torch.Tensor, TwoStageHandle]:
    """`TwoStageExchange.dispatch` for E = `num_experts` experts over `groups` (D = N x L ranks)."""
    layout = ExpertLayout(num_experts, groups.num_devices, groups.nodes)
    return TwoStageExchange(layout, groups).dispatch(hidden_TH, topk_ids_TK, weights_TK)


def two_stage_combine(
    out_VH: torch.Tensor, handle: TwoStageHandle, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Stage 2 back (sum over the node's devices at the gateway, one row per (token, node)), then
    stage 1 back (sum over nodes at home). Returns (T, H) in `out_dtype` (default out_VH's)."""
    dtype = out_dtype or out_VH.dtype
    node_RH = return_rows(out_VH, handle.device_received, handle.groups.intra_group, dtype)
    return return_rows(node_RH, handle.node_received, handle.groups.inter_group, dtype)


def two_stage_moe_forward(
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    local_experts_module: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    nodes: int,
    num_experts: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One expert-parallel MoE layer with the two-stage exchange (same contract as `dedup_moe_forward`).

    Args:
        hidden_TH: (T, H) this rank's tokens (T may be 0).
        topk_ids_TK: (T, K) global expert ids; weights_TK: (T, K) gate weights (receive gradients).
        local_experts_module: this rank's P contiguous experts (see `shard_experts`).
        group: the EP group of D ranks (None: the default group).
        nodes: N, dividing D; consecutive ranks share a node.
        num_experts: E, to cross-check against P * D.
        backend: grouped matmul backend of the local compute.

    Returns:
        (T, H) in hidden_TH.dtype, equal to the flat exchange and the unsharded layer. The rows it sent
        are in `TwoStageExchange.dispatch`'s handle.
    """
    num_devices, _ = group_size_and_rank(group)
    per_device = num_local_experts(local_experts_module)
    if num_experts is not None and num_experts != per_device * num_devices:
        raise ValueError(
            f"num_experts={num_experts} but the module holds {per_device} experts on each of "
            f"{num_devices} devices ({per_device * num_devices}); shard with shard_experts(model, group)"
        )
    layout = ExpertLayout(per_device * num_devices, num_devices, nodes)
    exchange = TwoStageExchange(layout, node_groups(nodes, group))
    return moe_forward(hidden_TH, topk_ids_TK, weights_TK, local_experts_module, exchange, backend)
