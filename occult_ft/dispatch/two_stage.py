"""The two-stage (node-aware) de-duplicated exchange: **a token crosses the network once per node**.

    NodeGroups / node_groups   the EP group as N nodes of L ranks, with its inter- and intra-node groups
    TwoStageHandle             the handle of one two-stage dispatch (both stages' layouts)
    TwoStageExchange           stage 1 across nodes to a gateway, stage 2 fanned out inside the node

How the stages work and what they cost: docs/expert-parallel.md.

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

from ..layout import ExpertLayout
from .comm import group_cache, group_size_and_rank
from .exchange import Exchange, ReceivedRows, check_hidden, return_rows, send_rows
from .plan import DispatchLayout, layout_from_plan, raise_bad_ids, row_plan

__all__ = ["NodeGroups", "node_groups", "TwoStageHandle", "TwoStageExchange"]


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
_GROUP_CACHE: dict[tuple[int, int], tuple[object, object, NodeGroups]] = group_cache()


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
    # Launchers number the ranks of one node consecutively: rank r is local index r % L of node r // L.
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
        # inter: my local index on every node (one rank per node, as in DeepEP); intra: my node's L ranks
        my_inter = [ep_ranks[m * local_size + local_rank] for m in range(nodes)]
        my_intra = list(ep_ranks[node * local_size : (node + 1) * local_size])
        # new_group is collective over the whole world and must be called in one order everywhere, so
        # every rank creates every sub-group of every EP group (L inter groups, then N intra groups) and
        # keeps the two it belongs to.
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
        return self.device_received.recv_local_ids_RJ

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
    (token, device) inside the node; combine in reverse (docs/expert-parallel.md, "Two stages").

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
        # rank = node * L + local index: the EP rank this rank holds (ranks of a node are consecutive)
        self.rank = groups.node * groups.local_size + groups.local_rank
        # the fan-out layout: one node's L * P experts on its L devices (ids node-local, as stage 1 sends them)
        self.fanout = layout.node_local()

    def dispatch(self, hidden_TH, topk_ids_TK, weights_TK):
        check_hidden(hidden_TH, topk_ids_TK)
        groups, layout, me = self.groups, self.layout, self.groups.local_rank
        # Stage 1 is the flat plan with the N nodes as "devices" (node m holds experts
        # [m * L * P, (m + 1) * L * P)): one row per (token, node), carrying node-local expert ids.
        plan1 = row_plan(topk_ids_TK, weights_TK, layout.nodes_view(), groups.node)
        sends1, recvs1, sends2, recvs2, counts = self._counts(plan1)  # the layer's one host read
        node_layout = layout_from_plan(plan1, sends1)
        node_x_RH, node_w_RK, node_ids_RK = send_rows(hidden_TH, node_layout, recvs1, groups.inter_group)
        node_received = ReceivedRows(node_layout, recvs1, node_ids_RK)
        # Stage 2: this rank as gateway fans its R received rows out once per device of its node; the
        # node-local ids of slots served on other nodes arrived as -1 and reach no device.
        plan2 = row_plan(node_ids_RK, node_w_RK, self.fanout, me, sentinel_in=True)
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
        # devices each token reaches (a spare column D for invalid ids): stage 2 sends one row per pair
        valid_TK = (ids_TK >= 0) & (ids_TK < e)
        # expert e lives on device e // P (contiguous blocks); invalid ids go to the spare column D
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
        # table[s] = rank s's [rows to node 0..N-1 | rows reaching device 0..D-1 | pairs per expert | bad]
        node, me = groups.node, groups.local_rank
        rank_of = [[m * l_size + li for li in range(l_size)] for m in range(n)]  # rank of (node m, local li)
        # stage 1: I send my rows for node m to its gateway (m, me); the rank of my local index on node m
        # sends me, its gateway on my node, its rows for my node (column `node` of its table row)
        sends1 = tuple(table[self.rank][m] for m in range(n))
        recvs1 = tuple(table[rank_of[m][me]][node] for m in range(n))
        # stage 2: as gateway I forward, to device li of my node, every row my senders (the ranks of
        # local index me on all nodes) had reaching that device; as host, device li of my node forwards
        # me the rows its senders had reaching me
        senders = [rank_of[m][me] for m in range(n)]
        # column n + r of a table row: rows that sender had reaching device r (the D block after N node columns)
        sends2 = tuple(sum(table[s][n + rank_of[node][li]] for s in senders) for li in range(l_size))
        recvs2 = tuple(sum(table[rank_of[m][li]][n + self.rank] for m in range(n)) for li in range(l_size))
        # my P experts' pairs: their columns (after the N + D row counts), summed over every sender
        p = layout.experts_per_device
        first = n + d + self.rank * p
        counts = tuple(sum(row[first + j] for row in table) for j in range(p))
        return sends1, recvs1, sends2, recvs2, counts

    def combine(self, out_RH, handle, out_dtype=None):
        # Reverse order: stage 2 back sums the node's devices into one row per (token, node) at the
        # gateway, rounded once to the hidden dtype (that row is what crosses back); stage 1 back sums
        # over nodes at home in at least fp32. The sum is re-associated, equal to float rounding.
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
