"""Dispatchers for expert-parallel MoE layers: the oracle, the single-device base case, and the
de-duplicated all-to-all of Occult (mechanism 1), plugged into transformers as an experts kernel.

The rule everything here implements: **a token is sent once per device however many of its experts
live there**; the receiving device sums the outputs of the token's local experts, so one row also
comes back. Rows per token = C_T (`occult_ft.metrics.comm_complexity`) instead of K.

    reference.py     reference_moe (slow loop, the test oracle), experts_module_fn
    layout.py        DispatchLayout (the frozen handle) and compute_layout
    local.py         local_experts_forward / local_moe_forward: grouped compute on one device
    comm.py          uneven all_to_all_single of row blocks, with autograd
    alltoall.py      dispatch, combine, dedup_moe_forward
    two_stage.py     node-aware exchange: once per node over the network, then fan-out in the node
    experts_impl.py  "occult_ep" transformers experts kernel, shard_experts, gather_experts[_state_dict]

Importing this package registers the "occult_ep" experts implementation with transformers.
"""

from .alltoall import ReceivedRows, combine, dedup_moe_forward, dispatch
from .comm import all_to_all_rows, exchange_counts, exchange_rows, group_size_and_rank
from .experts_impl import (
    EXPERTS_IMPLEMENTATION,
    ExpertShard,
    expert_shard_parameters,
    gather_experts,
    gather_experts_state_dict,
    occult_ep_experts_forward,
    register_experts_implementation,
    shard_experts,
    shard_experts_module,
)
from .layout import LOCAL_SENTINEL, DispatchLayout, compute_layout
from .local import BACKENDS, grouped_linear, local_experts_forward, local_moe_forward, num_local_experts
from .reference import ExpertFn, expert_activation, expert_weights, experts_module_fn, reference_moe
from .two_stage import (
    NodeGroups,
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
    "exchange_rows",
    "all_to_all_rows",
    # de-duplicated all-to-all
    "ReceivedRows",
    "dispatch",
    "combine",
    "dedup_moe_forward",
    # two-stage (node-aware) exchange
    "NodeGroups",
    "node_groups",
    "fanout_layout",
    "TwoStageHandle",
    "two_stage_dispatch",
    "two_stage_combine",
    "two_stage_moe_forward",
    # transformers integration
    "EXPERTS_IMPLEMENTATION",
    "ExpertShard",
    "occult_ep_experts_forward",
    "register_experts_implementation",
    "shard_experts",
    "shard_experts_module",
    "expert_shard_parameters",
    "gather_experts_state_dict",
    "gather_experts",
]
