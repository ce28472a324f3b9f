"""The fine-tuning run shared by the demo and the studies: `DemoSettings` (run sizes that fit 2 CPU cores)
and `finetune_embedded` (one `occult_ft.trainer.train` of the embedded model, timed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ..fileio import check_results_dir
from ..trainer import OccultConfig, train

__all__ = ["DemoSettings", "RESULTS_ENTRIES", "finetune_embedded", "results_dir"]

#: every entry the demo and the studies write at the top of their `output_dir`: the profile, the
#: placements, the fine-tuned checkpoints (`model`, `ft-*`, a task study's `runs/`), a task's training
#: rows and the results JSON
RESULTS_ENTRIES = (
    r"profile\.safetensors|placement-\w+\.json|model|ft-[\w.-]+|runs|[\w.-]+-train\.jsonl"
    r"|(demo|study)(_[\w.-]+)?_results\.json"
)


@dataclass
class DemoSettings:
    """Sizes of the demo and study runs (defaults fit 2 CPU cores).

    Args:
        output_dir: where the profile, placement, checkpoints and results go.
        devices: D, the expert-parallel layout the placement and budget refer to.
        max_devices_per_token: the demo's budget M.
        criterion: the demo's pruning criterion.
        steps: fine-tuning steps per run; batch_size, seq_len: per step.
        learning_rate: fine-tuning learning rate (MoE blocks only, as in the paper).
        profile_tokens: training tokens profiled for placement and similarity tables.
        eval_tokens: held-out tokens evaluated per model.
        seed: training seed.
        progress: a progress bar (or a phase line) on every phase, fine-tuning included.
    """

    output_dir: str = "occult-demo"
    devices: int = 4
    max_devices_per_token: int = 2
    criterion: str = "similarity"
    steps: int = 150
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 1e-3
    profile_tokens: int = 32768
    eval_tokens: int = 32768
    seed: int = 0
    progress: bool = True


def results_dir(s: DemoSettings) -> str:
    """`s.output_dir`, created, once `check_results_dir` has found nothing of the user's in it."""
    check_results_dir(s.output_dir, RESULTS_ENTRIES)
    os.makedirs(s.output_dir, exist_ok=True)
    return s.output_dir


def finetune_embedded(
    s: DemoSettings,
    placement_path: str,
    out: str,
    budget: int | None,
    criterion: str,
    dataset: str = "embedded",
    seed: int | None = None,
    **extra,
):
    """One fine-tuning of the embedded model, as the demo and the studies run it.

    Args:
        s: the run sizes (steps, batch size, sequence length, learning rate, devices, seed).
        placement_path: a placement JSON (`occult-ft place`) for `s.devices` devices.
        out: the run's output directory.
        budget / criterion: `max_devices_per_token` (None: unpruned fine-tuning) and its criterion.
        dataset: training data (any form `OccultConfig.dataset` takes); seed: overrides `s.seed`.
        extra: further `OccultConfig` fields (e.g. `train_mode`, `distill_coef`).

    Returns:
        (trainer, run): the `OccultTrainer` after training and saving, and a dict with
        `train_seconds`, `train_tokens_per_second` and the trainer's `log_history`.
    """
    config = OccultConfig(
        output_dir=out,
        model_name_or_path="embedded",
        dataset=dataset,
        seq_len=s.seq_len,
        devices=s.devices,
        placement=placement_path,
        max_devices_per_token=budget,
        criterion=criterion,
        profile_tokens=s.profile_tokens,
        train_mode=extra.pop("train_mode", "moe"),
        max_steps=s.steps,
        per_device_train_batch_size=s.batch_size,
        learning_rate=s.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, s.steps // 20),
        logging_steps=max(1, s.steps // 10),
        save_strategy="no",
        report_to=[],
        seed=s.seed if seed is None else seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.accelerator.is_available(),
        disable_tqdm=not s.progress,
        **extra,
    )
    t = time.perf_counter()
    trainer, metrics = train(config)
    seconds = time.perf_counter() - t
    tokens = s.steps * s.batch_size * s.seq_len
    return trainer, {
        "train_seconds": seconds,
        "train_tokens_per_second": tokens / seconds,
        "log_history": trainer.state.log_history,
    }
