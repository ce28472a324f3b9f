"""The pruning-aware load-balancing loss and its scaling under gradient accumulation and data parallelism.

The model's own auxiliary loss (`load_balancing_loss_func`) recomputes softmax + top-k from the raw
router logits, so it balances the routing the model *would* use without pruning. Occult fine-tuning
balances the routing it actually uses, with the model's own formula and scale (Switch Transformer
style, pooled over the MoE layers exactly as transformers pools them):

    balance = E * sum_e f_e * P_e

where f_e is the share of tokens whose used selection (`topk_ids_TK`, after pruning) contains expert e
(sum_e f_e = K; no gradient) and P_e is the mean router probability of e (the gradient path), both
taken over every (layer, token) row. Perfectly uniform routing gives K, as transformers' loss does, so a
model's `router_aux_loss_coef` means the same here (OLMoE 0.01; Mixtral, Qwen, GPT-OSS 0.001). On
unpruned routing of a softmax router it equals `load_balancing_loss_func`. For routers whose scores do
not sum to one (DeepSeek-V3's sigmoid), each token's scores are normalised first. Padding tokens are
skipped (transformers weights them by the attention mask, the same thing).

Shape legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..routing import RouterRecord

__all__ = ["balance_loss", "balance_loss_factor"]


def balance_loss(
    records: Mapping[int, RouterRecord], mask_T: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Pruning-aware Switch balance loss over the layers in `records`, on transformers' scale.

    Args:
        records: layer index -> `RouterRecord` with `probs` (T, E) attached to the graph and the
            `topk_ids` (T, K) actually used; every layer must route to the same E experts.
        mask_T: optional (T,) bool, True for real tokens (the flattened attention mask).

    Returns:
        A scalar fp32 tensor (K for uniform routing, at most E), or None when no record carries
        probabilities (recording without graph) or every token is masked.
    """
    counts_E = probs_E = None
    rows = 0
    for index in sorted(records):
        rec = records[index]
        if rec.probs is None:
            continue
        probs_TE, ids_TK = rec.probs, rec.topk_ids
        if mask_T is not None and mask_T.numel() == probs_TE.shape[0]:
            keep = mask_T.to(probs_TE.device)
            probs_TE, ids_TK = probs_TE[keep], ids_TK[keep.to(ids_TK.device)]
        tokens, num_experts = probs_TE.shape
        if counts_E is None:
            counts_E = torch.zeros(num_experts, device=probs_TE.device, dtype=torch.float32)
            probs_E = torch.zeros(num_experts, device=probs_TE.device, dtype=torch.float32)
        elif num_experts != counts_E.numel():
            raise ValueError(
                f"MoE layer {index} routes to {num_experts} experts, earlier layers to {counts_E.numel()}; "
                "the balance loss pools layers of one expert count"
            )
        if tokens == 0:
            continue
        p_TE = probs_TE.float()
        p_TE = p_TE / p_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        counts_E = counts_E.scatter_add(
            0, ids_TK.reshape(-1).to(p_TE.device), torch.ones(ids_TK.numel(), device=p_TE.device)
        )
        probs_E = probs_E + p_TE.sum(dim=0)
        rows += tokens
    if rows == 0:
        return None
    return counts_E.numel() * ((counts_E / rows) * (probs_E / rows)).sum()


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
