"""`OccultSFTConfig`: TRL's `SFTConfig` plus the Occult fields of `occult_ft.trainer.OccultArguments`.

The Occult fields (devices, nodes, placement, the budget, criterion, gate weights, the balance loss, the
exchange, expert parallelism, what trains, the model and data of a recipe) are the same fields with the
same checks as `OccultConfig`'s: both configs inherit them from `OccultArguments`. TRL's own fields keep
their meaning and defaults (`max_length`, `packing`, `completion_only_loss`, `assistant_only_loss`,
`dataset_text_field`, ...), except:

- `train_mode` defaults to `full` (what `SFTTrainer` trains); `lora` is occult_ft's LoRA (experts via
  `target_parameters`, routers trainable); a `peft_config` given to `OccultSFTTrainer` is used instead;
- `router_aux_loss_coef` is 0: the model's own auxiliary loss recomputes top-k from the raw router
  logits and so ignores the pruning; `balance_loss_coef` weighs the pruning-aware one instead;
- `distill_coef` must stay 0: SFTTrainer's loss runs through TRL's fused LM head, which builds no logits,
  so there is no student distribution to distil into (use `OccultTrainer` for distillation);
- `label_smoothing_factor` must stay 0: SFTTrainer then computes the loss from one forward and its
  metrics from a second one without gradient, whose routing would replace the one the balance loss
  needs (the same holds for a `compute_loss_func`, refused by `OccultSFTTrainer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from trl import SFTConfig

from ..trainer.config import OccultArguments

__all__ = ["OccultSFTConfig"]


@dataclass
class OccultSFTConfig(OccultArguments, SFTConfig):
    r"""Configuration of an Occult fine-tuning run through TRL (`OccultSFTTrainer`).

    Every `trl.SFTConfig` field (and so every `transformers.TrainingArguments` field), plus the Occult
    fields of `occult_ft.trainer.OccultArguments` (see `OccultConfig` for each one's meaning). The row
    length the Occult checks use (the capacity-bounded exchange, the model's positions) is `max_length`.
    """

    train_mode: str = field(
        default="full",
        metadata={
            "help": "full: every parameter (SFTTrainer's default); moe: MoE blocks only (routers + experts, as in "
            "the paper); lora: occult_ft's LoRA on experts and attention, routers fully trainable (a "
            "peft_config given to OccultSFTTrainer is used instead)."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=0.0,
        metadata={
            "help": "Must stay 0: the model's own auxiliary loss ignores the pruning; the pruning-aware balance "
            "loss is weighted by balance_loss_coef."
        },
    )

    row_length_field: ClassVar[str] = "max_length"

    def tokens_per_row(self) -> int | None:
        return self.max_length

    def _check_trainer_fields(self) -> None:
        if self.router_aux_loss_coef:
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef!r}: the model's own balance loss ignores the "
                "pruning; leave it 0 and set balance_loss_coef (the pruning-aware loss, on the same scale)"
            )
        self.router_aux_loss_coef = 0.0
        if self.distill_coef:
            raise ValueError(
                f"distill_coef={self.distill_coef!r}: SFTTrainer computes its loss with TRL's fused LM head, which "
                "builds no logits to distil into; set distill_coef=0 or train with OccultTrainer"
            )
        if self.label_smoothing_factor > 0:
            raise ValueError(
                f"label_smoothing_factor={self.label_smoothing_factor!r}: SFTTrainer then runs a second forward "
                "without gradient, whose routing replaces the one the balance loss needs; set it to 0"
            )
        if self.exchange_capacity == "auto" and self.max_length is None:
            raise ValueError(
                "exchange_capacity='auto' bounds the receive buffers by per_device_batch_size x max_length, but "
                "max_length is None; set max_length or a number of rows"
            )
        if self.max_length is not None and (isinstance(self.max_length, bool) or self.max_length < 2):
            raise ValueError(
                f"max_length={self.max_length!r} is too short; use at least 2 tokens (typically 128-4096)"
            )
