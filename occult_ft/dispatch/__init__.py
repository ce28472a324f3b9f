"""Dispatchers for expert-parallel MoE layers: the oracle, the single-device base case, and the token
exchanges (Occult's de-duplicated all-to-all first), plugged into transformers as an experts kernel.

    reference.py     reference_moe (slow loop, the test oracle), experts_module_fn
    local.py         local_experts_forward / local_moe_forward: grouped compute on one device
    plan.py          DispatchLayout (the frozen handle) and its size-free RowPlan: which rows go where
    comm.py          uneven all_to_all_single of row blocks, with autograd; asynchronous variant
    exchange.py      the Exchange contract (dispatch / combine + frozen handle): FlatExchange,
                     PerExpertExchange; moe_forward
    two_stage.py     TwoStageExchange: once per node over the network, then fan-out in the node
    pipeline.py      pipelined_moe_forward: chunks whose exchange overlaps the local experts
    shared.py        SharedBeside: a block's shared MLP run beside the combine (exchange_overlap_shared)
    experts_impl.py  "occult_ep" transformers experts kernel (picks the exchange from the shard record),
                     shard_experts, configure_exchange, gather_experts[_state_dict]
    decode.py        DecodeCapacity: generation's decode steps on the capacity-bounded flat exchange

The names below are the public contract; the building blocks are imported from their modules.
Importing this package registers the "occult_ep" experts implementation with transformers.
How the exchanges work: docs/expert-parallel.md.
"""

from .decode import enable_decode_capacity
from .exchange import Exchange, FlatExchange, PerExpertExchange, ReceivedRows, moe_forward
from .experts_impl import (
    EXCHANGES,
    EXPERTS_IMPLEMENTATION,
    PIPELINE_CHUNKS,
    ExpertShard,
    check_exchange_settings,
    configure_exchange,
    default_exchange_chunks,
    expert_shard_parameters,
    gather_experts,
    gather_experts_state_dict,
    shard_experts,
    shard_experts_module,
)
from .local import local_experts_forward, local_moe_forward
from .pipeline import pipelined_moe_forward
from .plan import DispatchLayout
from .reference import experts_module_fn, reference_moe
from .two_stage import TwoStageExchange, TwoStageHandle, node_groups

__all__ = [
    # the oracle and the single-device dispatcher
    "reference_moe",
    "experts_module_fn",
    "local_experts_forward",
    "local_moe_forward",
    # the exchange contract, its exchanges and handles
    "Exchange",
    "FlatExchange",
    "PerExpertExchange",
    "TwoStageExchange",
    "node_groups",
    "DispatchLayout",
    "ReceivedRows",
    "TwoStageHandle",
    # one layer through an exchange, whole or in pipelined chunks
    "moe_forward",
    "pipelined_moe_forward",
    # transformers integration
    "EXPERTS_IMPLEMENTATION",
    "EXCHANGES",
    "ExpertShard",
    "check_exchange_settings",
    "default_exchange_chunks",
    "PIPELINE_CHUNKS",
    "configure_exchange",
    "shard_experts",
    "shard_experts_module",
    "expert_shard_parameters",
    "gather_experts_state_dict",
    "gather_experts",
    # generation: exact prefill, capacity-bounded decode
    "enable_decode_capacity",
]
