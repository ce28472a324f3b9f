"""The pruning-aware load-balancing loss and its scaling under gradient accumulation and data parallelism.

The model's own auxiliary loss (`load_balancing_loss_func`) recomputes softmax + top-k from the raw
router logits, so it balances the routing the model *would* use without pruning. Occult fine-tuning
balances the routing it actually uses, with the model's own formula and scale (Switch Transformer
style, pooled over the MoE layers as transformers pools them), and with a budget also the device load
(the rows each device receives). The formulas are at the lines that compute them (`balance_loss`).

    balance_loss          the loss over the recorded layers: expert term, plus the device term with a budget
    device_balance_term   one layer's rows per device (no gradient) and probability mass per device
    balance_loss_factor   the factor that keeps it a plain mean under gradient accumulation

No value is read on the host: masks weight the rows instead of selecting them.

Shape legend: T tokens, E experts, K experts per token, D devices, C mean devices per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch

from ..routing import RouterRecord

__all__ = ["balance_loss", "balance_loss_factor", "device_balance_term"]


def _weights(mask_T: torch.Tensor | None, tokens: int, device) -> torch.Tensor:
    if mask_T is not None and mask_T.numel() == tokens:
        return mask_T.to(device=device, dtype=torch.float32)
    return torch.ones(tokens, device=device, dtype=torch.float32)


def balance_loss(
    records: Mapping[int, RouterRecord],
    mask_T: torch.Tensor | None = None,
    expert_device: Mapping[int, torch.Tensor] | None = None,
    num_devices: int | None = None,
) -> torch.Tensor | None:
    """Pruning-aware Switch balance loss over the layers in `records`, on transformers' scale.

    Args:
        records: layer index -> `RouterRecord` with `probs` (T, E) attached to the graph and the
            `topk_ids` (T, K) actually used; every layer must route to the same E experts.
        mask_T: optional (T,) bool, True for real tokens (the flattened attention mask).
        expert_device: layer index -> (E,) device of each expert; given (with a budget), the loss also
            balances device load (the rows each device receives).
        num_devices: D, needed with `expert_device`.

    Returns:
        A scalar fp32 tensor (K for uniform routing, at most E), or None when no record carries
        probabilities (recording without graph). With every token masked it is 0 (no gradient).
    """
    if expert_device is not None and not num_devices:
        raise ValueError("balance_loss(expert_device=...) needs num_devices")
    counts_E = probs_E = rows = None
    top_k = 0
    device_parts = []
    for index in sorted(records):
        rec = records[index]
        if rec.probs is None:
            continue
        probs_TE, ids_TK = rec.probs, rec.topk_ids
        tokens, num_experts = probs_TE.shape
        keep_T = _weights(mask_T, tokens, probs_TE.device)
        if counts_E is None:
            counts_E = torch.zeros(num_experts, device=probs_TE.device, dtype=torch.float32)
            probs_E = torch.zeros(num_experts, device=probs_TE.device, dtype=torch.float32)
            rows = torch.zeros((), device=probs_TE.device, dtype=torch.float32)
        elif num_experts != counts_E.numel():
            raise ValueError(
                f"MoE layer {index} routes to {num_experts} experts, earlier layers to {counts_E.numel()}; "
                "the balance loss pools layers of one expert count"
            )
        top_k = ids_TK.shape[1]
        if tokens == 0:
            continue
        p_TE = probs_TE.float()
        # scores that do not sum to one (DeepSeek-V3's sigmoid) are normalised per token first
        p_TE = p_TE / p_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        ids_TK = ids_TK.to(p_TE.device)
        # padding rows weigh 0 (transformers weights them by the attention mask, the same thing)
        slot_w_N = keep_T[:, None].expand_as(ids_TK).reshape(-1)
        counts_E = counts_E.scatter_add(0, ids_TK.reshape(-1), slot_w_N)
        assert probs_E is not None and rows is not None  # created with counts_E
        probs_E = probs_E + (p_TE * keep_T[:, None]).sum(dim=0)
        rows = rows + keep_T.sum()
        if expert_device is not None:
            assert num_devices  # checked above
            device_parts.append(device_balance_term(p_TE, ids_TK, expert_device[index], num_devices, keep_T))
    if counts_E is None or probs_E is None or rows is None:  # all three are created together
        return None
    denom = rows.clamp_min(1.0)  # every token masked: counts are 0, so the loss is 0
    # expert_term = E * sum_e f_e * P_e: f_e the share of rows whose used selection (after pruning)
    # holds e (sum_e f_e = K, no gradient), P_e the mean router probability of e (the gradient path),
    # both over every (layer, token) row. Uniform routing gives K, as transformers' loss does, so a
    # model's `router_aux_loss_coef` means the same here (OLMoE 0.01; Mixtral, Qwen, GPT-OSS 0.001); on
    # unpruned routing of a softmax router it equals `load_balancing_loss_func`.
    expert_term = counts_E.numel() * ((counts_E / denom) * (probs_E / denom)).sum()
    if not device_parts:
        return expert_term
    g_D = cast(torch.Tensor, sum(part[0] for part in device_parts))  # device_parts is not empty
    q_D = cast(torch.Tensor, sum(part[1] for part in device_parts))
    reach = g_D.sum().clamp_min(1e-20)  # rows over all layers = C * rows
    assert num_devices  # device_parts needs expert_device, which needs num_devices
    # With a budget the most loaded device sets a layer's time, and its load is the rows it receives
    # (tokens reaching it), not (token, expert) pairs; pruning concentrates tokens on fewer devices, so
    # balancing experts alone lets devices drift apart. device_term = (D / C) * sum_d g_d * Q_d, with
    # g_d the share of rows reaching device d (sum_d g_d = C, no gradient) and Q_d the mean probability
    # mass on d's experts (sum_d Q_d = 1): 1 at uniform load, D with all load on one device.
    device_term = num_devices * ((g_D / reach) * (q_D / denom)).sum()
    # (expert_term + K * device_term) / 2 is still K at uniform routing: the coefficient keeps its meaning
    return 0.5 * (expert_term + top_k * device_term)


def device_balance_term(
    p_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    expert_device_E: torch.Tensor,
    num_devices: int,
    keep_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's device-load statistics: (rows reaching each device (D,), no gradient; summed router
    probability mass on each device's experts (D,), the gradient path), masked rows weighted 0.

    Args:
        p_TE: (T, E) router probabilities (rows summing to 1). ids_TK: (T, K) the selection used.
        expert_device_E: (E,) device of each expert. keep_T: (T,) weights of the rows (default 1).
    """
    dev_E = expert_device_E.to(p_TE.device).long()
    t = p_TE.shape[0]
    keep_T = torch.ones(t, device=p_TE.device) if keep_T is None else keep_T
    reached_TD = torch.zeros(t, num_devices, dtype=torch.bool, device=p_TE.device)
    reached_TD.scatter_(1, dev_E[ids_TK], True)
    g_D = (reached_TD.float() * keep_T[:, None]).sum(dim=0).detach()
    mass_TD = torch.zeros(t, num_devices, device=p_TE.device, dtype=p_TE.dtype)
    mass_TD = mass_TD.index_add(1, dev_E, p_TE)
    q_D = (mass_TD * keep_T[:, None]).sum(dim=0)
    return g_D, q_D


def balance_loss_factor(loss_is_scaled_for_ga: bool, accumulation_steps: int) -> float:
    """Factor for a per-micro-batch mean loss added to the loss `Trainer.compute_loss` returns.

    Trainer divides the returned loss by the accumulation steps only when the model loss is *not* already
    normalised over the whole accumulated batch (`num_items_in_batch`); when it is, an added per-batch
    mean must be divided here, or it would count `accumulation_steps` times. The data-parallel factor
    Trainer multiplies the model loss by (to undo DDP's gradient averaging of token sums) is not applied:
    the balance loss is a per-process mean, which DDP's averaging already turns into the global mean.

    Args:
        loss_is_scaled_for_ga: whether Trainer will leave the returned loss undivided.
        accumulation_steps: the micro-batches of the current optimizer step.
    """
    return 1.0 / max(1, int(accumulation_steps)) if loss_is_scaled_for_ga else 1.0
