"""`CompensatedAdamW`: AdamW that loses no update to the rounding of 16-bit weights.

A bf16 weight has 8 significant bits: a weight of 0.02 moves only by steps of ~1.2e-4, so an AdamW
update of 2e-5 (a typical fine-tuning learning rate) is rounded away: measured on 1M weights of std 0.02
over 10 steps at lr 2e-5, `torch.optim.AdamW` on bf16 weights changes 30% of them and moves them by a
third of the intended amount (`tests/test_optim.py`). A float32 master copy fixes that at 4 extra bytes
per parameter; Kahan summation at 2 (Zamirai et al., "Revisiting BFloat16 Training", 2021): a 16-bit
`compensation` buffer beside each 16-bit parameter keeps what the last rounding lost (the update is
spelled out in `CompensatedAdamW.step`). Memory per trainable parameter: 16-bit weight 2 + gradient 2 +
float32 moments 8 + compensation 2 = 14 bytes (`occult_ft.plan` counts it).

    CompensatedAdamW     the optimizer (`seed_compensation` starts it from an unrounded float32 load)
    choose_optimizer     what `OccultTrainer` builds: this one in place of `torch.optim.AdamW`
                         (adamw_torch / adamw_torch_fused, `occult_ft.plan.COMPENSATED_OPTIMS`) whenever
                         a trainable parameter is 16-bit and DeepSpeed (float32 master weights) is off
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["CompensatedAdamW", "is_low_precision", "choose_optimizer"]

logger = logging.getLogger("occult_ft.trainer")


def is_low_precision(p: torch.Tensor) -> bool:
    return p.dtype in (torch.bfloat16, torch.float16)


class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with Kahan-compensated 16-bit weights.

    Args:
        params: parameters or parameter groups, as for `torch.optim.AdamW`.
        lr, betas, eps, weight_decay: as for `torch.optim.AdamW`.
        fused, foreach: accepted for `torch.optim.AdamW` compatibility (Trainer passes `fused=True` for
            `adamw_torch_fused`) and ignored.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        fused: bool | None = None,
        foreach: bool | None = None,
    ):
        if not lr >= 0:
            raise ValueError(f"lr={lr!r} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas!r} must both be in [0, 1)")
        if not eps >= 0:
            raise ValueError(f"eps={eps!r} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    # A float32 checkpoint loaded as bf16 is rounded before the first step, and every later update
    # smaller than half a bf16 step from that rounded start would be lost against the float32 run:
    # `OccultTrainer` loads such a checkpoint in float32, prepares it, rounds it and seeds `c` here.
    @torch.no_grad()
    def seed_compensation(self, residuals) -> int:
        """Start the compensation of 16-bit parameters with what rounding them to 16 bits lost
        (`residuals`: parameter -> float32 value - rounded value, e.g. from
        `occult_ft.trainer.loading.round_keeping_residuals`), so that the weights follow the float32
        trajectory from the unrounded start. Before the first step only; returns the parameters seeded."""
        seeded = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p in residuals and is_low_precision(p) and "step" not in self.state[p]:
                    self.state[p]["compensation"] = residuals[p].to(device=p.device, dtype=p.dtype).clone()
                    seeded += 1
        return seeded

    def load_state_dict(self, state_dict: dict) -> None:
        """`Optimizer.load_state_dict`, keeping the moments float32 (torch casts every floating-point
        state to its parameter's dtype, which would turn them bf16 on resume)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params):
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved.get(pid, {}):
                    self.state[p][key] = saved[pid][key].to(dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CompensatedAdamW does not support sparse gradients")
                state = self.state[p]
                # the moments are float32 whatever p's dtype (a bf16 exp_avg_sq would lose its 0.1% updates
                # the same way); float32 parameters get no compensation and follow torch.optim.AdamW exactly
                if "step" not in state:  # a seeded compensation (`seed_compensation`) is kept
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if is_low_precision(p) and "compensation" not in state:
                        state["compensation"] = torch.zeros_like(p)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                step_size = lr / (1 - beta1**step)
                if "compensation" not in state:  # float32: exactly torch.optim.AdamW
                    p.mul_(1 - lr * decay)
                    p.addcdiv_(exp_avg, denom, value=-step_size)
                    continue
                # Kahan step, p as stored, c its compensation, u the AdamW step in float32:
                #   exact = p * (1 - lr * weight_decay) - u + c   (float32)
                #   p     = round(exact)                           (to p's dtype)
                #   c     = exact - p                              (what the rounding lost, in p's dtype)
                # so p is always the nearest 16-bit value to p + c: a saved 16-bit checkpoint is already
                # the best a 16-bit file can hold of the compensated (float32) trajectory.
                compensation = state["compensation"]
                exact = p.float().mul_(1 - lr * decay)
                exact.addcdiv_(exp_avg, denom, value=-step_size).add_(compensation.float())
                p.copy_(exact)  # round to nearest
                compensation.copy_(exact.sub_(p.float()))  # what the rounding lost, for the next step
        return loss


def choose_optimizer(args: TrainingArguments, model, cls, kwargs: dict) -> tuple[type, dict]:
    """The optimizer class and keyword arguments `OccultTrainer` builds, from Trainer's choice (`cls`,
    `kwargs`): `torch.optim.AdamW` over 16-bit trainable weights becomes `CompensatedAdamW`, without
    DeepSpeed (which keeps float32 master weights itself); another optimizer over 16-bit weights is kept
    with a warning that it loses small updates."""
    low = model is not None and any(p.requires_grad and is_low_precision(p) for p in model.parameters())
    if not low or getattr(args, "deepspeed", None):
        return cls, kwargs
    if cls is torch.optim.AdamW:
        keep = ("lr", "betas", "eps", "weight_decay")
        return CompensatedAdamW, {k: v for k, v in kwargs.items() if k in keep}
    logger.warning(
        f"optim={args.optim}: this optimizer updates the 16-bit weights in place and loses updates smaller "
        "than their rounding step; use optim adamw_torch (compensated by occult_ft) or model_dtype float32"
    )
    return cls, kwargs
