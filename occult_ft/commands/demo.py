"""`occult-ft demo`: the whole pipeline on the embedded default model (profile, place, prune,
fine-tune, evaluate, save) in a few minutes on a CPU, ending with a summary table."""

from __future__ import annotations

from ._common import positive_int, standalone

__all__ = ["add_parser", "run", "add_settings_args", "settings_from_args"]


def add_settings_args(p, output_dir: str, steps: int) -> None:
    from ..routing import CRITERIA

    p.add_argument(
        "--output-dir", default=output_dir, help=f"where results and checkpoints go (default {output_dir})"
    )
    p.add_argument("--devices", type=positive_int, default=4, help="expert-parallel devices D (default 4)")
    p.add_argument(
        "--steps", type=positive_int, default=steps, help=f"fine-tuning steps per run (default {steps})"
    )
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence (default 128)")
    p.add_argument(
        "--learning-rate", type=float, default=1e-3, help="fine-tuning learning rate (default 1e-3)"
    )
    p.add_argument("--eval-tokens", type=positive_int, default=32768, help="held-out tokens per evaluation")
    p.add_argument("--profile-tokens", type=positive_int, default=32768, help="training tokens profiled")
    p.add_argument(
        "--criterion", default="similarity", help=f"pruning criterion, one of {', '.join(CRITERIA)}"
    )
    p.add_argument("--seed", type=int, default=0)


def settings_from_args(args, **extra):
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
    p.add_argument(
        "--max-devices-per-token", type=positive_int, default=2, help="pruning budget M (default 2)"
    )
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from ..routing import PruningConfig
    from ..studies.demo import run_demo

    PruningConfig(args.devices, args.max_devices_per_token, args.criterion)  # fail fast on bad flags
    run_demo(settings_from_args(args, max_devices_per_token=args.max_devices_per_token))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("demo", add_parser))
