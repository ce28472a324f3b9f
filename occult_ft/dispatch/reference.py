"""The test oracle: a plain loop over (token, slot) pairs, and the expert function of a HF experts module.

    reference_moe       out[t] = sum_k w[t, k] * expert(ids[t, k], x[t]), one pair at a time
    experts_module_fn   the `ExpertFn` of a transformers fused experts module
    expert_weights      its fused parameters in one (E, in, out) orientation
    expert_activation   its own nonlinearity between the two projections

Shape legend:
    T  tokens            K  experts per token (top-k)        H  hidden size
    N  rows given to one call of an expert function           E  experts of the module
    I  expert width (intermediate size)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict, cast

import torch
from torch import nn

__all__ = [
    "ExpertFn",
    "ExpertWeights",
    "reference_moe",
    "experts_module_fn",
    "expert_weights",
    "expert_activation",
]

# expert_fn(expert_id, x_NH) -> y_NH: the output of one expert on N rows.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def reference_moe(
    hidden_TH: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor, expert_fn: ExpertFn
) -> torch.Tensor:
    """out[t] = sum_k weights_TK[t, k] * expert_fn(topk_ids_TK[t, k], hidden_TH[t]), one pair at a time.

    Args:
        hidden_TH: (T, H) token activations (any float dtype).
        topk_ids_TK: (T, K) int expert ids.
        weights_TK: (T, K) gate weights.
        expert_fn: see `ExpertFn`; `experts_module_fn` builds one for a transformers experts module.

    Returns:
        (T, H) in `hidden_TH.dtype`; accumulated in the promoted dtype of outputs and weights (fp32 for
        fp32 gate weights), like transformers' kernels. Differentiable in all float inputs.
    """
    num_tokens, top_k = topk_ids_TK.shape
    if hidden_TH.shape[0] != num_tokens or weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"shapes disagree: hidden {tuple(hidden_TH.shape)}, topk_ids {tuple(topk_ids_TK.shape)}, "
            f"weights {tuple(weights_TK.shape)}; expected (T, H), (T, K), (T, K)"
        )
    # Deliberately slow and obvious: no sorting, no grouping, no communication, so every fast path in
    # occult_ft.dispatch is checked against it, and it fixes the meaning of a duplicated expert id (a
    # token that lists an expert twice gets it twice).
    rows = []
    for t in range(num_tokens):
        acc_H = None
        # the oracle: one token, one slot at a time, in slot order, no batching, no de-duplication
        for k in range(top_k):
            y_H = expert_fn(int(topk_ids_TK[t, k]), hidden_TH[t : t + 1])[0]
            term_H = weights_TK[t, k] * y_H
            acc_H = term_H if acc_H is None else acc_H + term_H
        # a token with no slot (K = 0) contributes a zero row
        rows.append(acc_H if acc_H is not None else torch.zeros_like(hidden_TH[t]))
    if not rows:
        return hidden_TH[:0] * 0  # (0, H), still attached to the graph
    return torch.stack(rows).to(hidden_TH.dtype)


class ExpertWeights(TypedDict):
    """The fused expert parameters of `expert_weights`, (E, in, out) views."""

    up_EIO: torch.Tensor
    up_bias_EO: torch.Tensor | None
    down_EIO: torch.Tensor
    down_bias_EO: torch.Tensor | None


def expert_weights(experts: nn.Module) -> ExpertWeights:
    """The fused parameters of a transformers experts module in one orientation: (E, in, out).

    transformers stores `gate_up_proj` as (E, 2I, H) and `down_proj` as (E, H, I) (`nn.Linear`
    convention, `is_transposed=False`), except GPT-OSS, which stores (E, H, 2I) and (E, I, H)
    (`is_transposed=True`) and has biases (`has_bias=True`). Modules without a gate
    (`has_gate=False`) hold `up_proj` instead of `gate_up_proj`.

    Returns:
        dict with `up_EIO` ((E, H, 2I), or (E, H, I) without gate), `up_bias_EO` ((E, 2I) or None),
        `down_EIO` ((E, I, H)), `down_bias_EO` ((E, H) or None); views, so gradients reach the parameters.
    """
    has_gate = getattr(experts, "has_gate", True)
    has_bias = getattr(experts, "has_bias", False)
    transposed = getattr(experts, "is_transposed", False)
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up, down = getattr(experts, up_name), cast(torch.Tensor, experts.down_proj)
    if not transposed:  # nn.Linear's (out, in) per expert -> (in, out), a view: gradients still flow
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    return {
        "up_EIO": up,
        "up_bias_EO": getattr(experts, f"{up_name}_bias") if has_bias else None,
        "down_EIO": down,
        "down_bias_EO": cast(torch.Tensor, experts.down_proj_bias) if has_bias else None,
    }


def expert_activation(experts: nn.Module, proj_NO: torch.Tensor) -> torch.Tensor:
    """The module's own nonlinearity between the two projections (its `_apply_gate`, e.g. GPT-OSS's
    clamped, interleaved SwiGLU; plain `act_fn` for gateless experts), then its optional post-norm is
    applied by the caller."""
    if getattr(experts, "has_gate", True):
        return experts._apply_gate(proj_NO)  # type: ignore[operator]
    return experts.act_fn(proj_NO)  # type: ignore[operator]


def experts_module_fn(experts: nn.Module) -> ExpertFn:
    """`expert_fn` for a transformers fused experts module (any of the layouts in `expert_weights`).

    The expert maths is the module's own: up projection (+ bias), `module._apply_gate` (so GPT-OSS's
    clamped SwiGLU over interleaved gate/up columns and the default `act(gate) * up` over concatenated
    halves are both honoured), down projection (+ bias), optional `post_expert_norm`.
    """

    def expert_fn(expert_id: int, x_NH: torch.Tensor) -> torch.Tensor:
        # read per call: the function sees the module's current tensors (replaced ones included)
        w = expert_weights(experts)
        # (N, H) @ (H, 2I): the fused gate and up halves in one product, split by the module's _apply_gate
        up_NO = x_NH.to(w["up_EIO"].dtype) @ w["up_EIO"][expert_id]
        if w["up_bias_EO"] is not None:
            up_NO = up_NO + w["up_bias_EO"][expert_id]
        mid_NI = expert_activation(experts, up_NO)
        # (N, I) @ (I, H): back to the hidden size
        y_NH = mid_NI @ w["down_EIO"][expert_id]
        if w["down_bias_EO"] is not None:
            y_NH = y_NH + w["down_bias_EO"][expert_id]
        if getattr(experts, "has_post_expert_norm", False):
            y_NH = experts.post_expert_norm(y_NH)  # type: ignore[operator]
        return y_NH

    return expert_fn
