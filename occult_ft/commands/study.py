"""`occult-ft study`: the quality study on the embedded model (base, standard fine-tuning, zero-shot
pruning and pruned fine-tuning to 1 and 2 devices with the score and similarity criteria).

`--task text` (default) measures the loss on held-out embedded text. `--task months` (see
`occult_ft.studies.tasks`) is an instruction task the base model never saw, where fine-tuning matters: response
loss and exact match on held-out rows, budgets 1-3, several seeds with their spread, and pruned runs
distilled from the unpruned model (`--distill-coef`)."""

from __future__ import annotations

import argparse

from ._choices import TASK_INFO
from ._common import positive_int, quiet_deepspeed_accelerator, standalone
from .demo import add_settings_args, settings_from_args

__all__ = ["add_parser", "run"]

_TEXT_SIZES = {"steps": 300, "batch_size": 8, "seq_len": 128, "learning_rate": 1e-3, "profile_tokens": 32768}


def _int_list(text: str) -> list[int]:
    import argparse

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no value; write e.g. 0,1,2")
    return values


def add_parser(sub):
    p = sub.add_parser(
        "study", help="quality study of pruned fine-tuning on the embedded model", description=__doc__
    )
    add_settings_args(p, "occult-study", 300)
    # sizes default per task (text: _TEXT_SIZES; a task: occult_ft.studies.task_study.TASK_SETTINGS)
    p.set_defaults(steps=None, batch_size=None, seq_len=None, learning_rate=None, profile_tokens=None)
    for action in p._actions:
        if action.dest in _TEXT_SIZES:
            action.help += f"; default: {_TEXT_SIZES[action.dest]:g} for text, the task's size for a task"
    tasks = "; ".join(f"{name}: {info}" for name, info in TASK_INFO.items())
    p.add_argument(
        "--task",
        default="text",
        choices=("text", *TASK_INFO),
        help=f"text: held-out embedded text, one seed; {tasks}. With a task, --steps, --batch-size, "
        "--seq-len, --learning-rate and --profile-tokens take the task's sizes (150, 8, 48, 3e-3, 16384)",
    )
    p.add_argument("--seeds", type=_int_list, default=[0, 1, 2], help="a task's training seeds")
    p.add_argument(
        "--budgets", type=_int_list, default=None, help="budgets M to study; default: text 2,1, a task 1,2,3"
    )
    p.add_argument(
        "--distill-coef",
        type=float,
        default=1.0,
        help="a task's distilled rows: OccultConfig.distill_coef (0 leaves them out)",
    )
    p.add_argument(
        "--distill-budgets",
        type=_int_list,
        default=None,
        help="budgets of the distilled rows (default: --budgets)",
    )
    p.add_argument("--train-rows", type=positive_int, default=4000, help="a task's training rows")
    p.add_argument(
        "--train-mode",
        default="full",
        choices=("full", "moe", "lora"),
        help="a task's OccultConfig.train_mode (full: attention must learn where the month digits are)",
    )
    p.add_argument("--eval-rows", type=positive_int, default=256, help="a task's held-out rows")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    quiet_deepspeed_accelerator()
    import torch

    from ..routing import PruningConfig
    from ..studies.demo import run_quality_study
    from ..studies.task_study import TASK_SETTINGS

    sizes = _TEXT_SIZES if args.task == "text" else TASK_SETTINGS
    for name in _TEXT_SIZES:
        if getattr(args, name) is None:
            setattr(args, name, sizes[name])
    if args.task != "text" and args.output_dir == "occult-study":
        args.output_dir = f"occult-study-{args.task}"
    budgets = tuple(args.budgets) if args.budgets else ((2, 1) if args.task == "text" else (1, 2, 3))
    for m in (*budgets, *(args.distill_budgets or ())):
        PruningConfig(args.devices, m, args.criterion)  # fail fast on bad flags
    if not args.distill_coef >= 0:
        raise ValueError(f"--distill-coef {args.distill_coef} must be >= 0 (0 leaves the distilled rows out)")
    settings = settings_from_args(args)
    torch.set_num_threads(args.threads)
    if args.task == "text":
        run_quality_study(settings, budgets=budgets)
    else:
        run_quality_study(
            settings,
            budgets=budgets,
            task=args.task,
            seeds=args.seeds,
            distill_coef=args.distill_coef,
            distill_budgets=tuple(args.distill_budgets) if args.distill_budgets else None,
            train_mode=args.train_mode,
            train_rows=args.train_rows,
            eval_rows=args.eval_rows,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("study", add_parser))
