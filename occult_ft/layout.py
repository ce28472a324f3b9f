"""`ExpertLayout`: how the E routed experts of a layer sit on D devices grouped into N nodes.

Every part of occult_ft that splits experts over devices (the exchange, the metrics, the benchmark,
the cost model) needs the same three numbers and the same two rules: D divides E (each device holds
P = E / D experts) and N divides D (each node holds L = D / N consecutive devices, as launchers number
ranks). `ExpertLayout` checks both once, in `__post_init__`, with a one-line error naming the value and
the divisors to choose from, and answers the questions the rest of the code asks about the layout.

The layout is *contiguous*: device d holds experts [d * P, (d + 1) * P) and node n holds devices
[n * L, (n + 1) * L). A placed model is made contiguous by `occult_ft.placement.permute_experts`;
functions that take an arbitrary `expert_device_E` mapping keep accepting one.

Shape legend: E experts, D devices, N nodes, P = E / D experts per device, L = D / N devices per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_nodes, check_positive_int, divisors, is_int

__all__ = ["ExpertLayout"]


@dataclass(frozen=True)
class ExpertLayout:
    """E experts on D devices on N nodes, contiguous blocks at both levels (validated once).

    Args:
        num_experts: E, routed experts of one MoE layer.
        num_devices: D, expert-parallel devices (ranks); must divide E.
        num_nodes: N, nodes the D devices span; must divide D (default 1).

    Raises:
        ValueError: one line naming the field, its value and the values that would work.
    """

    num_experts: int
    num_devices: int
    num_nodes: int = 1

    def __post_init__(self):
        check_positive_int("num_experts", self.num_experts)
        check_positive_int("devices", self.num_devices, "devices=4")
        if self.num_experts % self.num_devices:
            raise ValueError(
                f"devices={self.num_devices} must divide the {self.num_experts} experts; "
                f"use one of {divisors(self.num_experts)}"
            )
        check_nodes(self.num_devices, self.num_nodes)

    @property
    def experts_per_device(self) -> int:
        """P = E / D."""
        return self.num_experts // self.num_devices

    @property
    def devices_per_node(self) -> int:
        """L = D / N."""
        return self.num_devices // self.num_nodes

    @property
    def experts_per_node(self) -> int:
        """L * P = E / N."""
        return self.num_experts // self.num_nodes

    def check_rank(self, rank: int) -> None:
        """Raise a one-line ValueError unless 0 <= rank < D."""
        if not is_int(rank) or not 0 <= rank < self.num_devices:
            raise ValueError(f"rank={rank!r} is outside [0, num_devices={self.num_devices})")

    def expert_device(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(E,) int64 device of each expert: e // P."""
        return torch.arange(self.num_experts, device=device) // self.experts_per_device

    def expert_node(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(E,) int64 node of each expert: e // (L * P)."""
        return torch.arange(self.num_experts, device=device) // self.experts_per_node

    def nodes_view(self) -> ExpertLayout:
        """The same experts with the N nodes as the devices (the two-stage exchange's first stage)."""
        return ExpertLayout(self.num_experts, self.num_nodes, self.num_nodes)

    def node_local(self) -> ExpertLayout:
        """One node's L * P experts on its L devices (the two-stage exchange's fan-out stage)."""
        return ExpertLayout(self.experts_per_node, self.devices_per_node, 1)
