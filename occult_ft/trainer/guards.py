"""Guards on a run's numbers: nothing non-finite is trained on, logged as a number or saved as a result.

    check_step(...)            at every optimizer step, before the update: a non-finite loss (of any
                               micro-batch since the last step) or gradient norm stops the run with one
                               line naming the step, so the weights stay those of the step before
    check_finite_weights(...)  before any checkpoint or final model is written: non-finite weights are
                               refused, naming the tensors

Under fp16 with a gradient scaler an overflowing gradient is expected (the scaler skips that step and
lowers its scale), so there only the loss is checked. Under DeepSpeed the engine steps inside the
backward pass: a bad step is caught at the next step's loss, and its weights by `check_finite_weights`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NonFiniteError", "check_step", "check_finite_weights"]


class NonFiniteError(ValueError):
    """A loss, gradient or weight that is NaN or infinite."""


def _value(x) -> float | None:
    if x is None:
        return None
    return float(x.detach().float().item()) if isinstance(x, torch.Tensor) else float(x)


def check_step(
    step: int, loss_finite: torch.Tensor | bool, grad_norm, learning_rate: float, check_gradient: bool
) -> None:
    """Raise `NonFiniteError` when step `step` (1-based) would apply a non-finite update.

    Args:
        step: the optimizer step about to be taken.
        loss_finite: whether every micro-batch loss since the last step was finite (a bool tensor is
            read here, one host sync per optimizer step).
        grad_norm: the global gradient norm (tensor or float; None when the backend does not expose it).
        learning_rate: the configured one, for the message.
        check_gradient: False under an fp16 gradient scaler (it skips overflowing steps by itself).
    """
    loss_ok = bool(loss_finite.item()) if isinstance(loss_finite, torch.Tensor) else bool(loss_finite)
    norm = _value(grad_norm) if check_gradient else None
    if loss_ok and (norm is None or math.isfinite(norm)):
        return
    what = "the loss is not finite" if not loss_ok else f"the gradient norm is {norm}"
    raise NonFiniteError(
        f"step {step}: {what}, so training stopped before applying it (nothing non-finite was saved); "
        f"lower learning_rate (now {learning_rate:g}), keep max_grad_norm > 0, or look for broken rows in "
        "the data"
    )


def check_finite_weights(state_dict: dict[str, torch.Tensor], where: str) -> None:
    """Refuse to write `state_dict` (to `where`) when a floating-point tensor holds NaN or inf."""
    bad = [
        name
        for name, tensor in state_dict.items()
        if isinstance(tensor, torch.Tensor)
        and tensor.is_floating_point()
        and tensor.numel()
        and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteError(
            f"{len(bad)} weight tensors hold NaN or inf ({shown}); not saved to {where}: the run diverged, "
            "lower learning_rate and train again"
        )
