"""Occult fine-tuning: `OccultConfig(TrainingArguments)`, `OccultTrainer(Trainer)` and `train(config)`.

from occult_ft.trainer import OccultConfig, train

config = OccultConfig(model_name_or_path="embedded", dataset="embedded", devices=4,
                      max_devices_per_token=2, max_steps=100, output_dir="out")
trainer, metrics = train(config)        # out/ is a pruned checkpoint: occult_ft.from_pretrained("out")
"""

from ..data import tokenize_for_training
from .config import MODEL_DTYPES, PLACEMENT_MODES, TRAIN_MODES, OccultArguments, OccultConfig
from .loading import load_training_model
from .losses import balance_loss, balance_loss_factor
from .meter import METRIC_NAMES, RoutingMeter
from .mixin import OccultTrainerMixin
from .pipeline import load_run_dataset, train
from .prepare import OccultSetup, prepare_model, set_train_mode
from .trainer import OccultTrainer

__all__ = [
    "MODEL_DTYPES",
    "METRIC_NAMES",
    "PLACEMENT_MODES",
    "TRAIN_MODES",
    "OccultArguments",
    "OccultConfig",
    "OccultSetup",
    "OccultTrainer",
    "OccultTrainerMixin",
    "RoutingMeter",
    "balance_loss",
    "balance_loss_factor",
    "load_run_dataset",
    "load_training_model",
    "prepare_model",
    "set_train_mode",
    "tokenize_for_training",
    "train",
]
