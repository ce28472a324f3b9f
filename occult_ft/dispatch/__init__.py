"""Dispatchers for expert-parallel MoE layers: the oracle, the single-device base case, and the
de-duplicated all-to-all of Occult (mechanism 1), plugged into transformers as an experts kernel.

The rule everything here implements: **a token is sent once per device however many of its experts
live there**; the receiving device sums the outputs of the token's local experts, so one row also
comes back. Rows per token = C_T (`occult_ft.metrics.comm_complexity`) instead of K.

    reference.py     reference_moe (slow loop, the test oracle), experts_module_fn
    layout.py        DispatchLayout (the frozen handle), the size-free RowPlan, compute_layout
    local.py         local_experts_forward / local_moe_forward: grouped compute on one device
    comm.py          uneven all_to_all_single of row blocks, with autograd; asynchronous variant
    exchange.py      the Exchange contract (dispatch / combine + frozen handle): FlatExchange,
                     PerExpertExchange; moe_forward, dedup_moe_forward
    two_stage.py     TwoStageExchange: once per node over the network, then fan-out in the node
    pipeline.py      pipelined_moe_forward: chunks whose exchange overlaps the local experts
    experts_impl.py  "occult_ep" transformers experts kernel (picks the exchange from the shard record),
                     shard_experts, configure_exchange, gather_experts[_state_dict]
    decode.py        DecodeCapacity: generation's decode steps on the capacity-bounded flat exchange

Importing this package registers the "occult_ep" experts implementation with transformers.
"""

from .comm import (
    PendingRows,
    all_to_all_rows,
    exchange_counts,
    exchange_meta,
    exchange_rows,
    group_size_and_rank,
    start_exchange,
)
from .decode import DecodeCapacity, enable_decode_capacity
from .exchange import (
    Exchange,
    FlatExchange,
    PerExpertExchange,
    ReceivedRows,
    combine,
    dedup_moe_forward,
    dispatch,
    moe_forward,
)
from .experts_impl import (
    EXCHANGES,
    EXPERTS_IMPLEMENTATION,
    ExpertShard,
    check_exchange_settings,
    configure_exchange,
    exchange_for,
    expert_shard_parameters,
    gather_experts,
    gather_experts_state_dict,
    occult_ep_experts_forward,
    register_experts_implementation,
    shard_experts,
    shard_experts_module,
)
from .layout import (
    LOCAL_SENTINEL,
    DispatchLayout,
    RowPlan,
    capacity_layout,
    compute_layout,
    dedup_plan,
    layout_from_plan,
    per_expert_plan,
)
from .local import BACKENDS, grouped_linear, local_experts_forward, local_moe_forward, num_local_experts
from .pipeline import pipelined_moe_forward
from .reference import ExpertFn, expert_activation, expert_weights, experts_module_fn, reference_moe
from .two_stage import (
    NodeGroups,
    TwoStageExchange,
    TwoStageHandle,
    fanout_layout,
    node_groups,
    two_stage_combine,
    two_stage_dispatch,
    two_stage_moe_forward,
)

__all__ = [
    # reference
    "ExpertFn",
    "reference_moe",
    "experts_module_fn",
    "expert_weights",
    "expert_activation",
    # layout
    "LOCAL_SENTINEL",
    "DispatchLayout",
    "RowPlan",
    "dedup_plan",
    "per_expert_plan",
    "layout_from_plan",
    "capacity_layout",
    "compute_layout",
    # single device
    "BACKENDS",
    "grouped_linear",
    "local_experts_forward",
    "local_moe_forward",
    "num_local_experts",
    # communication
    "group_size_and_rank",
    "exchange_counts",
    "exchange_meta",
    "exchange_rows",
    "all_to_all_rows",
    "PendingRows",
    "start_exchange",
    # the exchange contract and the one-stage exchanges
    "Exchange",
    "ReceivedRows",
    "FlatExchange",
    "PerExpertExchange",
    "moe_forward",
    "dedup_moe_forward",
    "dispatch",
    "combine",
    # two-stage (node-aware) exchange
    "NodeGroups",
    "node_groups",
    "fanout_layout",
    "TwoStageHandle",
    "TwoStageExchange",
    "two_stage_dispatch",
    "two_stage_combine",
    "two_stage_moe_forward",
    # overlap
    "pipelined_moe_forward",
    # transformers integration
    "EXPERTS_IMPLEMENTATION",
    "EXCHANGES",
    "ExpertShard",
    "check_exchange_settings",
    "configure_exchange",
    "exchange_for",
    "occult_ep_experts_forward",
    "register_experts_implementation",
    "shard_experts",
    "shard_experts_module",
    "expert_shard_parameters",
    "gather_experts_state_dict",
    "gather_experts",
    # generation: exact prefill, capacity-bounded decode
    "DecodeCapacity",
    "enable_decode_capacity",
]
