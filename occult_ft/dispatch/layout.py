"""The dispatch layout: which rows a device sends where, computed once per forward, reused by backward.

The de-duplication rule (Occult, and DeepEP's `is_token_in_rank`): **a token is sent once per device
however many of its experts live there.** The receiving device fans that one copy out to the local
experts the token selected, applies the gate weights, and sums them, so one row also comes back. Rows
sent per token = number of distinct devices hosting its top-k experts = the paper's C_T
(`occult_ft.metrics.devices_per_token`), against K rows for per-expert dispatch.

Experts are contiguous per device: with P = E / D experts per device, expert e lives on device e // P
and is local expert e - d * P there (a placed model is made contiguous by `occult_ft.placement`).

Worked example (E=4, D=2, so P=2; T=3 tokens, K=2):

    topk_ids_TK = [[0, 1], [1, 2], [3, 2]]      weights_TK = [[.6, .4], [.7, .3], [.5, .5]]
    devices     = [[0, 0], [0, 1], [1, 1]]      token 0 -> {0}, token 1 -> {0, 1}, token 2 -> {1}
    send order (device-major, tokens ascending):   row:  0      1      2      3
        send_token_idx_S  = [0, 1, 1, 2]
        send_device_S     = [0, 0, 1, 1]             send_counts_D = [2, 2]; rows_sent = 4 (naive: 6)
        send_local_ids_SK = [[0, 1], [1, -1], [-1, 0], [1, 0]]
        send_weights_SK   = [[.6, .4], [.7, 0], [0, .3], [.5, .5]]

Slots keep their position k (as DeepEP's `recv_topk_idx` does): slot k of a row is slot k of its
token, and slots whose expert lives on another device hold the sentinel id -1 and weight 0.

Shape legend:
    T  tokens on this rank     K  experts per token     E  experts     D  devices (expert-parallel size)
    P  experts per device (E / D)                        S  rows this rank sends (sum over tokens of C_T)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LOCAL_SENTINEL", "DispatchLayout", "compute_layout"]

LOCAL_SENTINEL = -1
"""Local expert id of a slot whose expert lives on another device (its weight is 0 there)."""


@dataclass(frozen=True, eq=False)
class DispatchLayout:
    """Immutable handle: where each of this rank's tokens goes under de-duplicated dispatch.

    **A token is sent once per device however many of its experts live there.** Built by
    `compute_layout` once per forward; dispatch, combine and their backward passes all read it.

    Attributes:
        num_tokens: T, tokens on this rank (may be 0).
        top_k: K.
        num_experts: E, experts of the layer over all devices.
        num_devices: D.
        rank: this rank's device index in [0, D); its own rows (`rows_kept_local`) need no network.
        experts_per_device: P = E / D; expert e lives on device e // P as local expert e % P.
        send_token_idx_S: (S,) int64, token index (into this rank's T tokens) of each sent row. Rows
            are grouped by destination device in ascending order, tokens ascending within a device,
            so the first send_counts_D[0] rows go to device 0, and so on. No sentinel.
        send_device_S: (S,) int64, destination device of each row, non-decreasing. No sentinel.
        send_counts_D: (D,) int64, rows sent to each device = tokens with at least one expert there.
        send_splits: the same counts as a tuple of Python ints (split sizes for `all_to_all_single`,
            kept on the host so the collectives need no device sync).
        send_local_ids_SK: (S, K) int64, for each row and slot k, the local id (in [0, P)) on the
            destination device of the token's k-th expert, or `LOCAL_SENTINEL` (-1) where that expert
            lives on another device. Every row has at least one non-sentinel slot.
        send_weights_SK: (S, K), dtype of `weights_TK`: the token's gate weight at non-sentinel slots,
            exactly 0 at sentinel slots. Built by differentiable gather/where from `weights_TK`, so it
            carries the router's autograd graph (compute the layout outside `torch.no_grad` to train
            the router).
        rows_sent: S = sum of send_counts_D = sum over tokens of their distinct devices (C_T).
    """

    num_tokens: int
    top_k: int
    num_experts: int
    num_devices: int
    rank: int
    experts_per_device: int
    send_token_idx_S: torch.Tensor
    send_device_S: torch.Tensor
    send_counts_D: torch.Tensor
    send_splits: tuple[int, ...]
    send_local_ids_SK: torch.Tensor
    send_weights_SK: torch.Tensor
    rows_sent: int

    @property
    def naive_rows(self) -> int:
        """Rows a per-(token, expert) dispatch would send: T * K."""
        return self.num_tokens * self.top_k

    @property
    def comm_complexity(self) -> float:
        """Mean C_T over this rank's tokens: rows_sent / T (0.0 without tokens)."""
        return self.rows_sent / self.num_tokens if self.num_tokens else 0.0

    @property
    def rows_kept_local(self) -> int:
        """Rows whose destination is this rank itself (no network traffic)."""
        return self.send_splits[self.rank]


def compute_layout(
    topk_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    num_devices: int,
    rank: int,
) -> DispatchLayout:
    """Build the `DispatchLayout` of one rank's tokens (pure, local: no communication).

    Args:
        topk_ids_TK: (T, K) int expert ids in [0, E) (T may be 0).
        weights_TK: (T, K) float gate weights; gradients flow back to them through `send_weights_SK`.
        num_experts: E; must be divisible by `num_devices`.
        num_devices: D >= 1.
        rank: this rank's device index in [0, D).

    Returns:
        The layout handle (see `DispatchLayout` for every field's shape, dtype and sentinel).

    Raises:
        ValueError: for non-divisible E / D, a rank out of range, mismatched shapes, non-integer ids
            or ids outside [0, E); the message quotes the offending values.
    """
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_devices={num_devices}; "
            f"use an expert-parallel size that divides {num_experts}"
        )
    if not 0 <= rank < num_devices:
        raise ValueError(f"rank={rank} is outside [0, num_devices={num_devices})")
    if topk_ids_TK.dim() != 2 or weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids_TK.shape)} and weights {tuple(weights_TK.shape)} must both be (T, K)"
        )
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got dtype {topk_ids_TK.dtype}")
    num_tokens, top_k = topk_ids_TK.shape
    ids_TK = topk_ids_TK.long()
    lo_hi = torch.stack(torch.aminmax(ids_TK)).tolist() if ids_TK.numel() else [0, 0]  # one host sync
    if lo_hi[0] < 0 or lo_hi[1] >= num_experts:
        bad = ids_TK[(ids_TK < 0) | (ids_TK >= num_experts)].unique()[:8].tolist()
        raise ValueError(f"topk_ids hold expert ids {bad} outside [0, num_experts={num_experts})")

    per_device = num_experts // num_devices
    device_TK = ids_TK // per_device
    present_TD = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=ids_TK.device)
    present_TD.scatter_(1, device_TK, True)

    # nonzero() on the (D, T) mask lists (device, token) pairs device-major, tokens ascending: exactly
    # the order all_to_all_single needs (contiguous blocks per destination).
    pairs_S2 = present_TD.t().nonzero()
    send_device_S, send_token_idx_S = pairs_S2[:, 0], pairs_S2[:, 1]
    send_counts_D = present_TD.sum(dim=0)

    local_SK = device_TK[send_token_idx_S] == send_device_S[:, None]
    send_local_ids_SK = torch.where(
        local_SK, ids_TK[send_token_idx_S] - send_device_S[:, None] * per_device, LOCAL_SENTINEL
    )
    gathered_SK = weights_TK[send_token_idx_S]
    send_weights_SK = torch.where(local_SK, gathered_SK, torch.zeros_like(gathered_SK))

    send_splits = tuple(int(c) for c in send_counts_D.tolist())
    return DispatchLayout(
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        num_devices=num_devices,
        rank=rank,
        experts_per_device=per_device,
        send_token_idx_S=send_token_idx_S,
        send_device_S=send_device_S,
        send_counts_D=send_counts_D,
        send_splits=send_splits,
        send_local_ids_SK=send_local_ids_SK,
        send_weights_SK=send_weights_SK,
        rows_sent=sum(send_splits),
    )
