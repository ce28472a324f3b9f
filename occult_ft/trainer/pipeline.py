"""`train(config)`: the whole Occult fine-tuning run behind `occult-ft train` and the demo.

Load the tokenizer -> load and tokenize the data -> build an `OccultTrainer` from the model's path (it
loads the model: under expert parallelism each rank reads only its experts; a float32 checkpoint of a
16-bit run keeps what rounding it lost; then placement, pruning, train mode) -> `finish_run`: train
(resuming if asked) -> save the final pruned checkpoint to `config.output_dir` -> evaluate on
`config.eval_dataset` when given.
"""

from __future__ import annotations

import os
import sys

from datasets import IterableDataset

from ..data import DataError, load_text_dataset, tokenize_for_training
from ..plan import check_fits_before_loading
from .config import OccultArguments, OccultConfig, check_before_loading
from .loading import load_training_tokenizer
from .mixin import OccultTrainerMixin
from .trainer import OccultTrainer

__all__ = ["train", "load_run_dataset", "finish_run", "announcer"]


def load_run_dataset(
    source: str, split: str | None, tokenizer, config: OccultConfig, evaluation: bool = False
):
    """Load `source` with `occult_ft.data.load_text_dataset` and tokenize it as `config` says.

    For `source="embedded"` the default split is `train` (or `eval` when `evaluation`)."""

    if source == "embedded" and split is None:
        split = "eval" if evaluation else "train"
    dataset = load_text_dataset(
        source,
        split=split,
        text_field=config.text_field,
        streaming=config.streaming and not evaluation,
        skip_invalid_rows=config.skip_invalid_rows,
    )
    if tokenizer is None:
        raise ValueError(
            f"model {config.model_name_or_path!r} has no tokenizer; save one beside the model (tokenizer.save_pretrained)"
        )
    tokenized = tokenize_for_training(dataset, tokenizer, config, name=source)
    if isinstance(tokenized, IterableDataset) and next(iter(tokenized), None) is None:
        raise DataError(
            f"dataset {source!r} gives no training example of seq_len={config.seq_len} tokens (its text is "
            "shorter than one packed block, or no row is left); add data, lower seq_len or set packing=False"
        )
    return tokenized


def train(config: OccultConfig, **trainer_kwargs) -> tuple[OccultTrainer, dict[str, float]]:
    """Run one Occult fine-tuning as `config` says.

    Args:
        config: the run's `OccultConfig`; `model_name_or_path` and `dataset` are required.
        trainer_kwargs: extra `OccultTrainer` arguments (e.g. `callbacks`).

    Returns:
        (trainer, metrics): the trainer (its model is the trained, pruned model) and the train metrics
        plus, with `eval_dataset`, the `eval_*` metrics (loss, perplexity, routing metrics).
    """
    if not config.model_name_or_path:
        raise ValueError("model_name_or_path is required: a model directory, a Hub id or 'embedded'")
    if not config.dataset:
        raise ValueError(
            "dataset is required: a .txt/.jsonl/.json file, a saved dataset, a Hub id or 'embedded'"
        )
    say = announcer(config)

    check_before_loading(config)  # output_dir, budget and layout: before the data is read and tokenized
    check_fits_before_loading(config)  # GPU runs: the memory plan, before any weight is downloaded
    tokenizer = load_training_tokenizer(config.model_name_or_path)
    say(
        f"loading and tokenizing {config.dataset!r} (seq_len {config.seq_len}, packing "
        f"{'on' if config.packing else 'off'})"
    )
    train_dataset = load_run_dataset(config.dataset, config.dataset_split, tokenizer, config)
    eval_dataset = None
    if config.eval_dataset:
        eval_dataset = load_run_dataset(
            config.eval_dataset, config.eval_dataset_split, tokenizer, config, evaluation=True
        )
    say(f"loading the model {config.model_name_or_path!r}")
    if config.placement == "auto" or config.criterion == "similarity":
        say(f"placing and pruning the experts (profiling up to {config.profile_tokens} training tokens)")
    trainer = OccultTrainer(
        model=config.model_name_or_path,  # loaded by the trainer: sharded under expert parallelism
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        **trainer_kwargs,
    )
    return trainer, finish_run(trainer, config, train_dataset, eval_dataset, say)


def finish_run(
    trainer: OccultTrainerMixin, config: OccultArguments, train_dataset, eval_dataset, say
) -> dict[str, float]:
    """The run after its trainer is built (shared with `occult_ft.trl`'s pipeline): train (resuming if
    asked), refuse a run that took no step, save the final model to `config.output_dir`, evaluate on the
    eval data, save metrics and state, push when asked. Returns the metrics."""
    if config.deepspeed:
        say("starting DeepSpeed (its first run on a machine builds CUDA ops, which can take minutes)")
    say("training")
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    if trainer.state.global_step == 0:  # never save and report an untouched model as trained
        raise ValueError(
            f"the run took no optimizer step (max_steps={config.max_steps}, num_train_epochs="
            f"{config.num_train_epochs}, {len(train_dataset) if hasattr(train_dataset, '__len__') else 'streamed'} "
            "training rows); nothing was saved: give more data or set max_steps"
        )
    pruned = trainer.occult.pruning.active  # a budget set here, or kept from a pruned checkpoint
    what = "LoRA adapter" if config.train_mode == "lora" else "pruned model" if pruned else "model"
    say(f"saving the {what} to {config.output_dir}")
    trainer.save_model(config.output_dir)
    metrics = dict(result.metrics)
    if eval_dataset is not None:
        say(f"evaluating on {config.eval_dataset!r}")
        metrics.update(trainer.evaluate())
    if trainer.is_world_process_zero():
        trainer.save_metrics("all", metrics, combined=False)
        trainer.save_state()
    if config.push_to_hub:
        trainer.push_to_hub()  # with the Occult model card (OccultTrainerMixin.create_model_card)
    return metrics


def announcer(config: OccultArguments, command: str = "train"):
    """`say(message)`: one `occult-ft train: ...` line on stderr for each long phase, from the first process
    only, while progress bars are on (`disable_tqdm` off); silent otherwise."""
    quiet = bool(config.disable_tqdm) or os.environ.get("LOCAL_RANK", "0") not in ("", "0")
    quiet = quiet or os.environ.get("RANK", "0") not in ("", "0")

    def say(message: str) -> None:
        if not quiet:
            print(f"occult-ft {command}: {message} ...", file=sys.stderr, flush=True)

    return say
