"""`occult-ft study`: the quality study on the embedded model (base, standard fine-tuning, zero-shot
pruning and pruned fine-tuning to 1 and 2 devices with the score and similarity criteria)."""

from __future__ import annotations

from ._common import standalone
from .demo import add_settings_args, settings_from_args

__all__ = ["add_parser", "run"]


def add_parser(sub):
    p = sub.add_parser(
        "study", help="quality study of pruned fine-tuning on the embedded model", description=__doc__
    )
    add_settings_args(p, "occult-study", 300)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from ..demo import run_quality_study

    run_quality_study(settings_from_args(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("study", add_parser))
