"""The router self-check: the registry's maths must reproduce the model's own router, or nothing runs.

occult_ft prunes, profiles and permutes routing with the maths of the model's registry entry
(`MoEArch.selection_scores` / `gate_weights` / `selectable`), not with the model's router code. An entry
that is wrong, or a transformers release that changed a router, would route silently differently. So the
first time `find_moe_layers` sees a model with real weights, `check_model_routing` runs, on one MoE layer,
the model's own router and the registry's prediction (`MoEArch.route`) on the same random hidden states
and compares the selected experts and the gate weights. It runs twice: with the router as it is, and on
a copy whose weights and vectors (correction bias, per-expert scale, router bias) and block-held router
inputs are random, so that a convention term a trained model happens to leave at zero (or a freshly
initialised model's all-zero router) is exercised too.
A mismatch raises `RouterCheckError`, one line naming the model type, the layer and the field that
disagrees (with a hint at the entry field behind it).

It costs two router calls on 64 tokens of one layer (well under a second even for DeepSeek-V3's 256 x 7168
router; `benchmarks/selfcheck_cost.py` measures it on the embedded model). Models on the `meta` device
(memory plans, the sharded loader's skeleton) are skipped until their weights are real.

Shape legend: T tokens, E experts, K top-k, H hidden size.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["RouterCheckError", "check_layer_routing", "check_model_routing", "CHECK_TOKENS"]

#: tokens of random hidden states the check routes
CHECK_TOKENS = 64
_CHECKED = "_occult_routing_checked"


class RouterCheckError(ValueError):
    """The model's own router and its registry entry disagree (one line: type, layer, field, hint)."""


def _base_forward(router: nn.Module):
    """The model's own router forward (below occult_ft's pruned subclass, if it was swapped in)."""
    cls = type(router)
    while getattr(cls, "_occult_pruned", False):
        cls = cls.__mro__[1]
    return cls.forward


def _randomized(router: nn.Module, inputs: tuple, num_experts: int, gen: torch.Generator):
    """A copy of the router with random weights (matrices ~ N(0, 1/H), vectors ~ N(0, 1/4)), and random
    block-held vector inputs: the convention's maths must hold whatever the values."""
    twin = copy.deepcopy(router)
    with torch.no_grad():
        for tensor in [*twin.parameters(), *twin.buffers()]:
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            std = tensor.shape[-1] ** -0.5 if tensor.dim() >= 2 and tensor.shape[0] > 1 else 0.5
            tensor.copy_((torch.randn(tensor.shape, generator=gen) * std).to(tensor.device, tensor.dtype))
    new_inputs = tuple(
        (torch.randn(x.shape, generator=gen) * 0.5).to(x.device, x.dtype)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() == num_experts
        else x
        for x in inputs
    )
    return twin, new_inputs


def _run(layer, router: nn.Module, inputs: tuple, x_TH: torch.Tensor):
    arch = layer.arch
    x = x_TH.unsqueeze(0) if arch.router_input == "batch" else x_TH
    was_training = router.training
    router.eval()
    try:
        out = _base_forward(router)(router, x, *inputs)
    except (TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise RouterCheckError(
            f"{arch.model_type} router self-check failed on MoE layer {layer.index}: calling the router as the "
            f"entry says (router_input={arch.router_input!r}, router_args={arch.router_args!r}) failed: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ) from None
    finally:
        router.train(was_training)
    logits, weights, ids = out[0], out[1], out[2]
    return (
        logits.reshape(x_TH.shape[0], -1),
        weights.reshape(x_TH.shape[0], -1),
        ids.reshape(x_TH.shape[0], -1),
    )


def _compare(layer, router: nn.Module, inputs: tuple, x_TH: torch.Tensor, what: str) -> None:
    arch = layer.arch
    where = f"{arch.model_type} router self-check failed on MoE layer {layer.index} ({what})"
    logits_TE, weights_TK, ids_TK = _run(layer, router, inputs, x_TH)
    num_experts, top_k = arch.num_experts(router), arch.top_k(router)
    if logits_TE.shape[1] != num_experts or ids_TK.shape[1] != top_k:
        raise RouterCheckError(
            f"{where}: the router returns {logits_TE.shape[1]} experts x top-{ids_TK.shape[1]}, the entry "
            f"reads {num_experts} x top-{top_k} (num_experts_attr / top_k_attr)"
        )
    pred_ids_TK, pred_w_TK, scores_TE = arch.route(router, logits_TE, inputs)
    # tokens whose k-th and (k+1)-th selection scores nearly tie may pick either; the rest must agree
    if num_experts > top_k:
        top = scores_TE.topk(top_k + 1, dim=-1).values
        clear_T = (top[:, top_k - 1] - top[:, top_k]).abs() > 1e-5 * top[:, 0].abs().clamp_min(1.0)
    else:
        clear_T = torch.ones(x_TH.shape[0], dtype=torch.bool, device=scores_TE.device)
    got_ids, got_order = ids_TK.long().sort(dim=1)
    want_ids, want_order = pred_ids_TK.sort(dim=1)
    same_T = (got_ids == want_ids).all(dim=1) | ~clear_T
    if not bool(same_T.all()):
        bad = int((~same_T).sum())
        raise RouterCheckError(
            f"{where}: the selected experts disagree for {bad} of {x_TH.shape[0]} tokens (scoring="
            f"{arch.scoring!r}, correction_bias_attr={arch.correction_bias_attr!r}, bias_on={arch.bias_on!r}, "
            f"native_group_routing={arch.native_group_routing!r}); fix the {arch.model_type!r} entry in "
            "occult_ft/models/entries.py or check what this transformers release changed in the router"
        )
    keep = clear_T & (got_ids == want_ids).all(dim=1)
    if int(keep.sum()) < x_TH.shape[0] // 2:
        if what == "as loaded":  # degenerate weights (all ties): the random twin decides
            return
        raise RouterCheckError(f"{where}: inconclusive, only {int(keep.sum())} tokens without near-ties")
    got_w = weights_TK.float().gather(1, got_order)[keep]
    want_w = pred_w_TK.gather(1, want_order)[keep]
    tol = max(1e-5, 8 * torch.finfo(weights_TK.dtype).eps)
    scale = want_w.abs().max().clamp_min(1e-6)
    if not torch.allclose(got_w, want_w, atol=tol * float(scale), rtol=tol):
        raise RouterCheckError(f"{where}: the gate weights disagree ({_weights_hint(got_w, want_w, tol)})")


def _weights_hint(got_TK: torch.Tensor, want_TK: torch.Tensor, tol: float) -> str:
    """Which entry field the weight mismatch points at."""
    ratio = got_TK / want_TK.where(want_TK.abs() > 1e-12, torch.ones_like(want_TK))
    if float(ratio.std()) <= 10 * tol * float(ratio.abs().mean()):
        return f"the model's are {float(ratio.mean()):.6g}x the entry's everywhere: check scaling_attr"
    got_sum, want_sum = got_TK.sum(1), want_TK.sum(1)
    if float(got_sum.std()) < tol and float(want_sum.std()) > tol:
        return f"the model's sum to {float(got_sum.mean()):.6g} per token and the entry's do not: check renormalize"
    if float(want_sum.std()) < tol and float(got_sum.std()) > tol:
        return "the entry renormalises and the model does not: check renormalize"
    worst = float((got_TK - want_TK).abs().max())
    return f"largest difference {worst:.3g}: check scoring, renormalize, scaling_attr and expert_scale_attr"


def check_layer_routing(layer, seed: int = 0) -> None:
    """Compare the registry's routing with `layer`'s own router on random hidden states (see module).

    Raises:
        RouterCheckError: naming the model type, the layer and the field that disagrees.
    """
    router = layer.router
    ref = next(iter([*router.parameters(), *router.buffers()]), None)
    device = ref.device if ref is not None else torch.device("cpu")
    dtype = next((p.dtype for p in router.parameters() if p.is_floating_point()), torch.float32)
    hidden = _hidden_size(layer)
    gen = torch.Generator().manual_seed(seed)
    x_TH = (torch.randn(CHECK_TOKENS, hidden, generator=gen) * 2.0).to(device, dtype)
    inputs = layer.router_inputs()
    with torch.no_grad():
        _compare(layer, router, inputs, x_TH, "as loaded")
        twin, twin_inputs = _randomized(router, inputs, layer.num_experts, gen)
        _compare(layer, twin, twin_inputs, x_TH, "random router weights")


def _hidden_size(layer) -> int:
    """H: the in-features of the router's first 2-D weight (E, H)."""
    for param in layer.router.parameters():
        if param.dim() == 2:
            return int(param.shape[1])
    raise RouterCheckError(f"{layer.arch.model_type}: router of MoE layer {layer.index} has no (E, H) weight")


def check_model_routing(model: nn.Module, layers: list) -> bool:
    """Run `check_layer_routing` once per model (cached on it); False when skipped (meta weights).

    The layer checked is the first whose router is a learned top-k router with real weights."""
    if model.__dict__.get(_CHECKED):
        return True
    for layer in layers:
        params = [*layer.router.parameters()]
        if not params or any(p.is_meta for p in params):
            return False
        if any(p.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64) for p in params):
            continue  # quantised router weights: nothing to multiply random states with
        check_layer_routing(layer)
        break
    model.__dict__[_CHECKED] = True
    return True
