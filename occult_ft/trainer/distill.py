"""Distillation from the unpruned model during pruned fine-tuning (beyond the paper; off by default).

The teacher is the model being trained, the same weights, routed without the budget
(`occult_ft.routing.unpruned_routing`), run without gradient on the same batch. The student is the
pruned forward that the language-modelling loss already ran. Per labelled position (the positions
whose next token carries a label: response tokens of instruction rows, every real token of text)

    KL(teacher || student) = sum_v p_t(v) * (log p_t(v) - log p_s(v)),   p = softmax(logits / tau)

times tau^2 (Hinton et al.'s scaling, so that the gradient scale does not depend on tau), averaged over
the labelled positions of the micro-batch. An unpruned model is its own teacher: the loss is 0.

Shape legend: B rows, S positions, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..routing import unpruned_routing

__all__ = ["distillation_kl", "teacher_logits"]


def distillation_kl(
    student_BSV: torch.Tensor, teacher_BSV: torch.Tensor, labels_BS: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor | None:
    """Mean KL(teacher || student) * tau^2 over the positions that predict a labelled token.

    Args:
        student_BSV: (B, S, V) student logits (attached to the graph).
        teacher_BSV: (B, S, V) teacher logits (no gradient).
        labels_BS: (B, S) labels, -100 = ignored; position s - 1 predicts label s (causal LM shift).
        temperature: tau > 0 softening both distributions.

    Returns:
        A scalar fp32 tensor, or None when no position is labelled.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (1.0 = the plain distributions)")
    keep_N = (labels_BS[:, 1:] != -100).reshape(-1).to(student_BSV.device)
    if not bool(keep_N.any()):
        return None
    s_NV = student_BSV[:, :-1].reshape(-1, student_BSV.shape[-1])[keep_N].float() / temperature
    t_NV = teacher_BSV[:, :-1].reshape(-1, teacher_BSV.shape[-1])[keep_N].float() / temperature
    log_t = F.log_softmax(t_NV, dim=-1)
    kl_N = (log_t.exp() * (log_t - F.log_softmax(s_NV, dim=-1))).sum(dim=-1)
    return kl_N.mean() * temperature**2


@torch.no_grad()
def teacher_logits(model, inputs: dict) -> torch.Tensor:
    """(B, S, V) logits of `model` on `inputs` with the budget lifted on every pruned router; router
    records (metrics, balance loss) are left as the student's forward sets them."""

    batch = {k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}
    with unpruned_routing(model):
        return model(**batch).logits.detach()
