"""`train_sft(config)`: the run behind `occult-ft train --trainer trl`, through TRL's SFTTrainer.

Load the model and tokenizer (occult_ft's loader) -> load `config.dataset` as raw rows of one of TRL's
shapes (`occult_ft.data.load_text_dataset`; Alpaca instruction rows become prompt-completion rows with
occult_ft's prompt template, so their loss is completion-only as in TRL) -> `OccultSFTTrainer` (TRL
tokenizes, packs and collates; the mixin places and prunes) -> the rest of the run as
`occult_ft.trainer.pipeline.finish_run` does it for `occult-ft train`.
"""

from __future__ import annotations

from datasets import IterableDataset

from ..checkpoint.load import can_load_sharded
from ..data import DataError, format_prompt, load_text_dataset
from ..data.loading import dataset_columns, dataset_layout
from ..plan import check_fits_before_loading
from ..trainer.config import check_before_loading
from ..trainer.pipeline import announcer, finish_run
from .config import OccultSFTConfig
from .trainer import OccultSFTTrainer

__all__ = ["train_sft", "load_sft_rows"]


def _instruction_to_prompt(row: dict) -> dict:
    return {
        "prompt": format_prompt(row["instruction"], row.get("input") or ""),
        "completion": row["output"],
    }


def load_sft_rows(source: str, split: str | None, config: OccultSFTConfig, evaluation: bool = False):
    """Raw rows of `source` in a shape SFTTrainer reads: text rows under `config.dataset_text_field`,
    prompt-completion rows (instruction rows converted), or `messages` rows."""
    if source == "embedded" and split is None:
        split = "eval" if evaluation else "train"
    field = config.dataset_text_field
    streaming = config.streaming and not evaluation

    def read(text_field: str | None):
        return load_text_dataset(
            source,
            split=split,
            text_field=text_field,
            streaming=streaming,
            skip_invalid_rows=config.skip_invalid_rows,
        )

    if field in ("text", "content"):
        rows = read(None)
    else:
        try:  # `dataset_text_field` names the text of plain-text rows; other shapes do not have it
            rows = read(field)
        except DataError:
            rows = read(None)
    columns = dataset_columns(rows)
    layout = dataset_layout(columns)
    if layout == "instruction":
        rows = rows.map(_instruction_to_prompt, remove_columns=columns)
    elif layout == "text" and field != "text":
        rows = rows.rename_column("text", field)
    return rows


def train_sft(config: OccultSFTConfig, **trainer_kwargs) -> tuple[OccultSFTTrainer, dict[str, float]]:
    """Run one Occult fine-tuning through TRL as `config` says (`model_name_or_path`, `dataset` required).

    Returns:
        (trainer, metrics), as `occult_ft.trainer.train` returns them.
    """
    if not config.model_name_or_path:
        raise ValueError("model_name_or_path is required: a model directory, a Hub id or 'embedded'")
    if not config.dataset:
        raise ValueError(
            "dataset is required: a .txt/.jsonl/.json file, a saved dataset, a Hub id or 'embedded'"
        )
    say = announcer(config)
    check_before_loading(config)  # output_dir, budget and layout: before the data is read
    if config.max_length is not None:
        check_fits_before_loading(config)  # GPU runs: the memory plan, before any weight is downloaded
    say(f"loading and checking {config.dataset!r}")
    train_rows = load_sft_rows(config.dataset, config.dataset_split, config)
    if isinstance(train_rows, IterableDataset) and next(iter(train_rows), None) is None:
        raise ValueError(f"dataset {config.dataset!r} yields no rows; check the data source")
    eval_rows = None
    if config.eval_dataset:
        eval_rows = load_sft_rows(config.eval_dataset, config.eval_dataset_split, config, evaluation=True)
    sharded = config.expert_parallel_size > 1 and can_load_sharded(config.model_name_or_path)
    mine = " (each rank its own experts)" if sharded else ""
    say(
        f"loading the model {config.model_name_or_path!r}{mine}, preparing the data (TRL), placing and "
        "pruning the experts"
    )
    trainer = OccultSFTTrainer(
        config.model_name_or_path,
        args=config,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        **trainer_kwargs,
    )
    return trainer, finish_run(trainer, config, trainer.train_dataset, eval_rows, say)
