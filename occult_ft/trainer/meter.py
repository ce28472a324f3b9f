"""`RoutingMeter`: routing metrics accumulated over the micro-batches between two log lines.

After each forward the trainer hands the meter the routers' `RouterRecord`s; the meter keeps running
sums on the model's device (no host sync per step) and turns them into averages when the trainer logs:

    comm_complexity     mean over tokens and MoE layers of the devices a token reaches (the paper's C_T)
    intra_share         share of co-selected expert pairs that sit on one device
    removed_mass        share of the unpruned top-k router probability mass that pruning removed
    load_imbalance      max / mean rows per device under de-duplicated dispatch, averaged over layers
                        and micro-batches
    max_token_devices   the most devices any token reached (never above `max_devices_per_token`)
    balance_loss        the pruning-aware balance loss, averaged over micro-batches (training only)
    padding_share       share of the micro-batches' positions that are padding (`occult_ft.data`)

Under several processes the sums are reduced across processes at log time (all ranks log together).

With `keep_loads` the meter also keeps each layer's (D,) device load (rows per device) since the last
`take_loads()`: what the trainer's device balancing reads after every optimizer step.

Shape legend: T tokens, K experts per token, E experts, D devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import torch

from ..metrics import device_counts
from ..routing import RouterRecord

__all__ = ["RoutingMeter", "METRIC_NAMES"]

METRIC_NAMES = (
    "comm_complexity",
    "intra_share",
    "removed_mass",
    "load_imbalance",
    "max_token_devices",
    "balance_loss",
    "padding_share",
)

# slots of the running-sum vector
_COMM, _TOKENS, _INTRA, _PAIRS, _REMOVED, _IMB, _IMB_N, _BAL, _BAL_N, _PAD, _POSITIONS = range(11)
_SLOTS = 11


class RoutingMeter:
    """Running routing metrics of one phase (training or evaluation).

    Args:
        num_devices: D, the expert-parallel size the metrics are measured for.
        keep_loads: also keep the device loads per layer for `take_loads`.
    """

    def __init__(self, num_devices: int, keep_loads: bool = False):
        self.num_devices = int(num_devices)
        self.keep_loads = keep_loads
        self._loads: dict[int, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        self._sums: torch.Tensor | None = None
        self._max: torch.Tensor | None = None

    def _ensure(self, device) -> torch.Tensor:
        """The running sums (created with the running max on `device` at first use)."""
        if self._sums is None:
            self._sums = torch.zeros(_SLOTS, dtype=torch.float64, device=device)
            self._max = torch.zeros((), dtype=torch.float64, device=device)
        return self._sums

    @torch.no_grad()
    def update(
        self,
        records: Mapping[int, RouterRecord],
        expert_device: Mapping[int, torch.Tensor],
        mask_T: torch.Tensor | None = None,
    ) -> None:
        """Add one forward's routing.

        Args:
            records: layer index -> `RouterRecord` (topk_ids (T, K), removed_mass (T,)).
            expert_device: layer index -> (E,) device of each expert.
            mask_T: optional (T,) bool, True for real (non-padding) tokens.
        """
        for index, rec in records.items():
            ids_TK, removed_T = rec.topk_ids, rec.removed_mass
            tokens, k = ids_TK.shape
            if tokens == 0:
                continue
            s = self._ensure(ids_TK.device)
            # masked tokens are weighted 0, not selected: boolean indexing would read the mask on the host
            if mask_T is not None and mask_T.numel() == tokens:
                keep_T = mask_T.to(ids_TK.device).double()
            else:
                keep_T = torch.ones(tokens, dtype=torch.float64, device=ids_TK.device)
            counts_TD = device_counts(
                ids_TK, expert_device[index].to(ids_TK.device), self.num_devices
            ).double()
            reached_TD = (counts_TD > 0).double() * keep_T[:, None]
            per_token_T = reached_TD.sum(dim=1)
            load_D = reached_TD.sum(dim=0)
            real = keep_T.sum()
            seen = (real > 0).double()
            s[_COMM] += per_token_T.sum()
            s[_TOKENS] += real
            s[_INTRA] += ((counts_TD * (counts_TD - 1) / 2) * keep_T[:, None]).sum()
            s[_PAIRS] += real * (k * (k - 1) / 2)
            s[_REMOVED] += (removed_T.double() * keep_T).sum()
            s[_IMB] += seen * load_D.max() / load_D.mean().clamp_min(1e-12)
            s[_IMB_N] += seen
            self._max = torch.maximum(cast(torch.Tensor, self._max), per_token_T.max())
            if self.keep_loads:
                held = self._loads.get(index)
                self._loads[index] = load_D if held is None else held + load_D

    def take_loads(self) -> dict[int, torch.Tensor]:
        """layer index -> (D,) float64 rows per device since the last call (on the model's device, no
        host read), then forgets them."""
        loads, self._loads = self._loads, {}
        return loads

    @torch.no_grad()
    def add_balance_loss(self, value: torch.Tensor) -> None:
        """Add one micro-batch's (unscaled) balance loss."""
        sums = self._ensure(value.device)
        sums[_BAL] += value.detach().double()
        sums[_BAL_N] += 1

    @torch.no_grad()
    def add_padding(self, mask_BS: torch.Tensor) -> None:
        """Add one micro-batch's padding: `mask_BS` is 1 on real tokens, 0 on padding."""
        sums = self._ensure(mask_BS.device)
        sums[_PAD] += (mask_BS == 0).sum().double()
        sums[_POSITIONS] += mask_BS.numel()

    def summary(self, reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> dict[str, float]:
        """Averages since the last reset (then resets).

        Args:
            reduce: optional cross-process reduction `reduce(tensor, "sum" | "max")`, called on every
                process (all processes must call `summary` together when it is given).
        Returns:
            A dict with the `METRIC_NAMES` that were measured (empty when nothing was seen).
        """
        sums, peak = self._sums, self._max
        if reduce is not None:
            # every rank must take part in the collective, even one that saw no tokens
            if sums is None or peak is None:
                sums = torch.zeros(_SLOTS, dtype=torch.float64)
                peak = torch.zeros((), dtype=torch.float64)
            sums, peak = reduce(sums, "sum"), reduce(peak, "max")
        self.reset()
        if sums is None or peak is None:  # both are set together
            return {}
        v = sums.tolist()
        out: dict[str, float] = {}
        if v[_TOKENS] > 0:
            out["comm_complexity"] = v[_COMM] / v[_TOKENS]
            out["intra_share"] = v[_INTRA] / v[_PAIRS] if v[_PAIRS] > 0 else 0.0
            out["removed_mass"] = v[_REMOVED] / v[_TOKENS]
            out["load_imbalance"] = v[_IMB] / v[_IMB_N]
            out["max_token_devices"] = float(peak)
        if v[_BAL_N] > 0:
            out["balance_loss"] = v[_BAL] / v[_BAL_N]
        if v[_POSITIONS] > 0:
            out["padding_share"] = v[_PAD] / v[_POSITIONS]
        return out
