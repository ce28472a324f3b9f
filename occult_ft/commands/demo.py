"""`occult-ft demo`: the whole pipeline on the embedded default model (profile, place, prune,
fine-tune, evaluate, save, reload) on a CPU, ending with a summary table; every phase shows a progress
bar. The longer comparison (standard fine-tuning, both criteria, budgets 1 and 2) is `occult-ft study`."""

from __future__ import annotations

import argparse

from ._choices import CRITERIA, DEFAULT_CRITERION
from ._common import positive_int, quiet_deepspeed_accelerator, standalone

__all__ = ["add_parser", "run", "add_settings_args", "settings_from_args"]


def add_settings_args(p, output_dir: str, steps: int) -> None:
    """The run-size flags of `demo` and `study`; their defaults are `DemoSettings`' (tests/test_demo.py
    checks that they agree: importing it here would import torch)."""
    from_settings = {
        "batch_size": 8,
        "seq_len": 128,
        "learning_rate": 1e-3,
        "eval_tokens": 32768,
        "profile_tokens": 32768,
    }
    p.add_argument("--output-dir", default=output_dir, help="where results and checkpoints go")
    p.add_argument("--devices", type=positive_int, default=4, help="expert-parallel devices D")
    p.add_argument("--steps", type=positive_int, default=steps, help="fine-tuning steps per run")
    p.add_argument(
        "--batch-size", type=positive_int, default=from_settings["batch_size"], help="sequences per step"
    )
    p.add_argument(
        "--seq-len", type=positive_int, default=from_settings["seq_len"], help="tokens per sequence"
    )
    p.add_argument(
        "--learning-rate",
        type=float,
        default=from_settings["learning_rate"],
        help="fine-tuning learning rate",
    )
    p.add_argument(
        "--eval-tokens",
        type=positive_int,
        default=from_settings["eval_tokens"],
        help="held-out tokens per evaluation",
    )
    p.add_argument(
        "--profile-tokens",
        type=positive_int,
        default=from_settings["profile_tokens"],
        help="training tokens profiled",
    )
    p.add_argument(
        "--criterion",
        default=DEFAULT_CRITERION,
        choices=CRITERIA,
        metavar="CRITERION",
        help=f"pruning criterion, one of {', '.join(CRITERIA)}",
    )
    p.add_argument("--seed", type=int, default=0, help="training seed")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads: the embedded model's matrices are too small to gain from more, and on a "
        "machine whose cores are busy more threads cost many times the CPU time",
    )


def settings_from_args(args: argparse.Namespace, **extra):
    from ..studies.finetune import DemoSettings

    return DemoSettings(
        output_dir=args.output_dir,
        devices=args.devices,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.learning_rate,
        eval_tokens=args.eval_tokens,
        profile_tokens=args.profile_tokens,
        criterion=args.criterion,
        seed=args.seed,
        **extra,
    )


def add_parser(sub):
    p = sub.add_parser(
        "demo", help="run the whole pipeline on the embedded default model", description=__doc__
    )
    add_settings_args(p, "occult-demo", 150)
    p.add_argument("--max-devices-per-token", type=positive_int, default=2, help="pruning budget M")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    quiet_deepspeed_accelerator()
    import torch

    from ..routing import PruningConfig
    from ..studies.demo import run_demo

    torch.set_num_threads(args.threads)

    PruningConfig(args.devices, args.max_devices_per_token, args.criterion)  # fail fast on bad flags
    run_demo(settings_from_args(args, max_devices_per_token=args.max_devices_per_token))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("demo", add_parser))
