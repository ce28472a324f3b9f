"""`OccultSFTTrainer`: TRL's `SFTTrainer` with the Occult behaviour of `OccultTrainerMixin`.

Method order: OccultSFTTrainer -> SFTTrainer -> TRL's base trainer -> OccultTrainerMixin -> Trainer.

- `__init__`: a model given by path is read by occult_ft's loader (`embedded`, pruned checkpoints with
  their routing, occult_ft LoRA adapters, each rank's experts only under expert parallelism; a float32
  checkpoint of a 16-bit run in float32, rounded by the mixin once prepared); TRL then
  prepares the data (chat templates, prompt-completion masks, packing, `dataset_text_field`) and builds
  its collator; when it reaches `Trainer.__init__`, the mixin profiles that prepared data, places and
  prunes the model, applies LoRA (a `peft_config` is held back from TRL and applied here, after the
  placement, so that the adapter is built on the placed experts) and shards the experts.
- `compute_loss`: SFTTrainer computes its loss itself (TRL's fused LM head, not `Trainer.compute_loss`),
  so it is the `inner` loss of the mixin's `occult_loss`, which adds the pruning-aware balance loss and
  feeds the routing meter.
- `_save_checkpoint`: TRL writes its model card into `output_dir` at every checkpoint; here the Occult
  card is written by `save_model` / `push_to_hub` instead (`create_model_card` is the mixin's).
"""

from __future__ import annotations

from torch import nn
from trl import SFTTrainer

from ..data.loading import dataset_columns
from ..trainer.config import check_before_loading
from ..trainer.mixin import OccultTrainerMixin, load_run_model
from .config import OccultSFTConfig

__all__ = ["OccultSFTTrainer"]


class OccultSFTTrainer(SFTTrainer, OccultTrainerMixin):
    """`trl.SFTTrainer` that places and prunes the model before training (see the module docstring).

    Args:
        model: a loaded supported MoE model, or a path / Hub id / `embedded` (default:
            `args.model_name_or_path`), read with its tokenizer by occult_ft's loader.
        args: the run's `OccultSFTConfig`.
        train_dataset / eval_dataset / data_collator / processing_class / formatting_func / callbacks /
            ...: as for `trl.SFTTrainer` (rows of TRL's shapes: `text`, `prompt` / `completion`,
            `messages`, conversational prompt-completion; tokenized rows).
        peft_config: a `peft.PeftConfig`, applied after placement and pruning. For LoRA on the fused
            experts use `target_parameters` (PEFT cannot target them as modules);
            `occult_ft.integrations.peft.build_lora_config(model, ...)` builds occult_ft's config.
        placement: a `Placement` that overrides `args.placement`.
    """

    args: OccultSFTConfig  # checked in __init__

    def __init__(
        self,
        model: nn.Module | str | None = None,
        args: OccultSFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *,
        peft_config=None,
        placement=None,
        **kwargs,
    ):
        if args is None:
            args = OccultSFTConfig()
        if not isinstance(args, OccultSFTConfig):
            raise TypeError(
                f"args must be an OccultSFTConfig, got {type(args).__name__}; build one with OccultSFTConfig(...) "
                "(it takes every SFTConfig field)"
            )
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "compute_loss_func: SFTTrainer then takes its metrics from a second forward without gradient, "
                "whose routing replaces the one the balance loss needs; subclass OccultSFTTrainer and override "
                "compute_loss instead"
            )
        if kwargs.get("quantization_config") is not None:
            raise ValueError(
                "quantization_config: occult_ft permutes and shards the expert weights, which quantized "
                "weights do not allow; train in bf16/fp32 (LoRA keeps the memory low)"
            )
        model = model if model is not None else args.model_name_or_path
        if model is None:
            raise ValueError("OccultSFTTrainer needs a model (a transformers MoE model or a model path)")
        check_before_loading(args)
        round_to = None
        if isinstance(model, str):
            if args.model_init_kwargs:
                raise ValueError(
                    f"model_init_kwargs={args.model_init_kwargs!r}: occult_ft reads the model {model!r} itself "
                    "(pruned checkpoints, expert shards); set model_dtype, or pass a loaded model"
                )
            model, tokenizer, round_to = load_run_model(model, args, placement)
            processing_class = processing_class if processing_class is not None else tokenizer
        if peft_config is not None:
            if args.train_mode == "moe":
                raise ValueError(
                    "train_mode='moe' trains the MoE blocks fully, but a peft_config was given; drop one of them"
                )
            args.train_mode = "lora"  # what the checkpoints record
        _check_chat_template(processing_class, args, train_dataset, eval_dataset)
        # TRL's __init__ does not pass these through to Trainer.__init__: the mixin reads them there
        self.occult_init_options = {"placement": placement, "peft_config": peft_config, "round_to": round_to}
        super().__init__(
            model=model,  # type: ignore[arg-type]  # a PreTrainedModel (or PEFT model) by now
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            peft_config=None,  # applied by the mixin after placement
            **kwargs,
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """SFTTrainer's loss + the pruning-aware balance loss; feeds the routing meter."""
        inner = super().compute_loss  # SFTTrainer's (it does not call Trainer.compute_loss)
        return self.occult_loss(inner, model, inputs, return_outputs, num_items_in_batch)

    def _save_checkpoint(self, model, trial):
        # past SFTTrainer's override, which writes TRL's model card into output_dir at every checkpoint
        super(SFTTrainer, self)._save_checkpoint(model, trial)

    create_model_card = OccultTrainerMixin.create_model_card


def _check_chat_template(processing_class, args: OccultSFTConfig, *datasets) -> None:
    """'messages' rows go through the tokenizer's chat template: one without any (and no
    `chat_template_path`) is refused in one line here, before TRL fails deep inside with a type error."""
    if processing_class is None or args.chat_template_path is not None:
        return
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor holds one
    if getattr(tokenizer, "chat_template", None):
        return
    if any(ds is not None and "messages" in (dataset_columns(ds) or ()) for ds in datasets):
        raise ValueError(
            f"'messages' rows need a chat template and the tokenizer of {args.model_name_or_path or 'the model'} "
            "has none; set chat_template_path (a Jinja template file; with assistant_only_loss it must mark "
            "the assistant turns with {% generation %}) or give prompt/completion rows"
        )
