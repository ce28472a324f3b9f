"""`OccultTrainer`: a `transformers.Trainer` that fine-tunes an MoE under a device budget per token.

It reads models by path (`embedded`, a Hub id, a pruned checkpoint, a LoRA adapter; each rank reads only
its experts under expert parallelism) and raw rows of every layout `occult_ft.data` knows, tokenized
and packed by `occult_ft.data.tokenize_for_training` with `seq_len` / `packing` / `response_only`; the
Occult behaviour itself (placement, pruning, the balance loss, routing metrics, pruned checkpoints,
resumption, expert parallelism) is `occult_ft.trainer.mixin.OccultTrainerMixin`, which
`occult_ft.trl.OccultSFTTrainer` shares.
"""

from __future__ import annotations

from torch import nn

from ..data import flat_packing, make_collator, pad_token_id, tokenize_for_training
from ..models.registry import unwrap_model
from .config import OccultConfig, check_before_loading
from .mixin import OccultTrainerMixin, load_run_model

__all__ = ["OccultTrainer"]


class OccultTrainer(OccultTrainerMixin):
    """Trainer for Occult fine-tuning: placement, collaboration pruning and pruning-aware balancing.

    Args:
        model: a supported transformers MoE model, a pruned occult_ft checkpoint, an occult_ft LoRA
            model, or a path / Hub id (loaded with its tokenizer).
        args: the run's `OccultConfig` (default: `OccultConfig()`).
        data_collator: default `occult_ft.data.make_collator` (padded or packed batches; packed ones as one
            flat row for flash-attention kernels).
        train_dataset / eval_dataset: tokenized rows (`input_ids`, `labels`, `attention_mask` or
            `position_ids`) or raw rows of any layout of `occult_ft.data.load_text_dataset` (text,
            instruction, prompt / completion, messages; `Dataset` or `IterableDataset`), tokenized here
            with `args.seq_len`, `args.packing`, `args.response_only`.
        processing_class: the tokenizer.
        placement: a `Placement` that overrides `args.placement`.
        kwargs: passed to `transformers.Trainer`.

    Attributes:
        occult: the `OccultSetup` (pruning config, placement, similarity tables, expert -> device maps).
    """

    args: OccultConfig  # checked in __init__

    def __init__(
        self,
        model: nn.Module | str | None = None,
        args: OccultConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        placement=None,
        **kwargs,
    ):
        if args is None:
            args = OccultConfig()
        if not isinstance(args, OccultConfig):
            raise TypeError(
                f"args must be an OccultConfig, got {type(args).__name__}; build one with OccultConfig(...)"
            )
        if model is None:
            raise ValueError("OccultTrainer needs a model (a transformers MoE model or a model path)")
        check_before_loading(args)
        if isinstance(model, str):
            model, tokenizer = load_run_model(model, args, placement)
            processing_class = processing_class if processing_class is not None else tokenizer
        train_dataset = tokenize_for_training(train_dataset, processing_class, args)
        if isinstance(eval_dataset, dict):
            eval_dataset = {
                k: tokenize_for_training(v, processing_class, args) for k, v in eval_dataset.items()
            }
        else:
            eval_dataset = tokenize_for_training(eval_dataset, processing_class, args)
        if data_collator is None:
            data_collator = make_collator(
                pad_token_id=pad_token_id(processing_class, unwrap_model(model)), flatten=flat_packing(model)
            )
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            placement=placement,
            **kwargs,
        )
