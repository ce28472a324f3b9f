"""`occult-ft convert MODEL --out DIR`: a DeepSeek-MoE checkpoint -> an exactly equivalent qwen2_moe one.

    occult-ft convert deepseek-ai/deepseek-moe-16b-base --out models/deepseek-moe-16b-qwen2moe

MODEL is a local directory or a Hub id with `model_type: deepseek` (DeepSeek-MoE, which transformers
only runs through remote code). The result loads with `AutoModelForCausalLM` and every occult_ft
command; see `occult_ft.checkpoint.convert` for the mapping. Other commands convert such a model by themselves
(once, into a cache directory), so converting by hand is only needed to keep or publish the result.
"""

from __future__ import annotations

import argparse

from ._common import check_hub_sources, quiet_deepspeed_accelerator, standalone

__all__ = ["add_parser", "run", "main"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert",
        help="convert a DeepSeek-MoE checkpoint (model_type deepseek) to the transformers-native qwen2_moe",
        description=__doc__,
    )
    p.add_argument("model", metavar="MODEL", help="DeepSeek-MoE checkpoint: local directory or Hub model id")
    p.add_argument("--out", required=True, help="directory to write (must not be inside MODEL)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    check_hub_sources("convert", models=[args.model])
    quiet_deepspeed_accelerator()

    from ..checkpoint.convert import convert_deepseek_moe

    out = convert_deepseek_moe(args.model, args.out, overwrite=args.overwrite)
    print(f"converted {args.model} (deepseek) to qwen2_moe in {out}")
    return 0


def main(argv=None) -> int:
    return standalone("convert", add_parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
