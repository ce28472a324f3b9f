"""`PruningConfig`: the budget a pruned router applies (devices, nodes, criterion, gate weights).

Shape legend: E experts, K top-k, D devices, N nodes, M = max_devices_per_token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..checks import divisors
from .rules import check_pruning_settings

__all__ = ["PruningConfig"]


@dataclass(frozen=True)
class PruningConfig:
    """What the pruned router does.

    Args:
        num_devices: D, the expert-parallel size the budget refers to.
        max_devices_per_token: M, at most this many devices per token; None = no device budget (with no
            node budget either, the router only records its routing).
        criterion: one of `CRITERIA`.
        gate_weights: one of `GATE_WEIGHT_POLICIES`.
        num_nodes: N, the nodes the D devices span (node i holds devices [i*D/N, (i+1)*D/N)).
        max_nodes_per_token: at most this many nodes per token (DeepSeek-V3's node limit), alone or
            together with `max_devices_per_token`; None = no node budget.
    """

    num_devices: int
    max_devices_per_token: int | None = None
    criterion: str = "score"
    gate_weights: str = "model"
    num_nodes: int = 1
    max_nodes_per_token: int | None = None

    def __post_init__(self):
        check_pruning_settings(
            self.num_devices,
            self.max_devices_per_token,
            self.criterion,
            self.gate_weights,
            self.num_nodes,
            self.max_nodes_per_token,
        )

    @property
    def active(self) -> bool:
        m, n = self.max_devices_per_token, self.max_nodes_per_token
        # a budget of all devices (M = D) or all nodes prunes nothing: the router then only records.
        return (m is not None and m < self.num_devices) or (n is not None and n < self.num_nodes)

    @property
    def device_budget(self) -> int:
        """Devices a token may reach under both budgets: min(M, max_nodes * D / N)."""
        m = self.max_devices_per_token or self.num_devices
        if self.max_nodes_per_token is not None:
            # N nodes hold D/N devices each, so a budget of n nodes reaches at most n * D/N devices.
            m = min(m, self.max_nodes_per_token * (self.num_devices // self.num_nodes))
        return m

    def check(self, num_experts: int, top_k: int) -> None:
        """Raise ValueError when the budget cannot hold k experts or D does not divide E."""
        if num_experts % self.num_devices:
            raise ValueError(
                f"devices={self.num_devices} does not divide the {num_experts} experts; "
                f"use one of {divisors(num_experts)}"
            )
        # experts are spread evenly: E/D per device, so M devices hold M * E/D candidates for the k picks.
        per_device = num_experts // self.num_devices
        m = self.max_devices_per_token
        if m is not None and m * per_device < top_k:
            # the smallest M with M * E/D >= k: ceil(k * D / E), written -(-a // b) to stay in integers.
            need = -(-top_k * self.num_devices // num_experts)
            raise ValueError(
                f"max_devices_per_token={m} holds only {m * per_device} experts "
                f"({per_device} per device) but tokens pick top-{top_k}; use at least {need}"
            )
        n = self.max_nodes_per_token
        # the node budget caps the devices too (device_budget), so it must still hold k experts.
        if n is not None and self.device_budget * per_device < top_k:
            per_node = per_device * (self.num_devices // self.num_nodes)
            with_m = "" if m is None else f" with max_devices_per_token={m}"
            raise ValueError(
                f"max_nodes_per_token={n}{with_m} holds only {self.device_budget * per_device} experts "
                f"({per_node} per node) but tokens pick top-{top_k}; use max_nodes_per_token >= "
                f"{-(-top_k // per_node)}"
            )

    def to_dict(self) -> dict:
        return asdict(self)
