"""Occult inside TRL: `OccultSFTConfig` (TRL's `SFTConfig` + the Occult fields) and `OccultSFTTrainer`
(TRL's `SFTTrainer` + `occult_ft.trainer.mixin.OccultTrainerMixin`).

    from occult_ft.trl import OccultSFTConfig, OccultSFTTrainer

    args = OccultSFTConfig(output_dir="out", devices=4, max_devices_per_token=2, max_length=512)
    trainer = OccultSFTTrainer("embedded", args=args, train_dataset=rows)   # rows of any TRL shape
    trainer.train(); trainer.save_model()       # out/ is a pruned checkpoint (occult_ft.from_pretrained)

Needs `trl` (`pip install 'occult-ft[trl]'`); importing this package without it is one ImportError line.
See docs/trl.md for what composes with TRL's features and what does not.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("trl") is None:
    raise ImportError("occult_ft.trl needs TRL, which is not installed: pip install 'occult-ft[trl]'")

from .config import OccultSFTConfig  # noqa: E402
from .trainer import OccultSFTTrainer  # noqa: E402

__all__ = ["OccultSFTConfig", "OccultSFTTrainer"]
