"""`occult-ft profile MODEL --data DATA --out PROFILE`: record per-layer routing statistics.

The profile feeds `occult-ft place` and the similarity criterion of `occult-ft prune`. `--data embedded`
reads the shipped training text here (the evaluation text stays held out for `eval` and `analyze`).
Rows are read in `occult_ft.data.spread_order`, so a profile cut at --max-tokens samples the whole data.
"""

from __future__ import annotations

import argparse

from ._common import (
    add_model_data_args,
    check_hub_sources,
    data_batches,
    load_args_data,
    note_data_ran_out,
    positive_int,
    quiet_deepspeed_accelerator,
    standalone,
)

__all__ = ["add_parser", "run"]


def add_parser(sub):
    p = sub.add_parser(
        "profile", help="run a model over data and record expert co-selection statistics", description=__doc__
    )
    add_model_data_args(p, embedded_split="train")
    p.add_argument("--out", required=True, help="where to write the profile (.safetensors)")
    p.add_argument(
        "--max-routing-tokens",
        type=positive_int,
        default=65536,
        help="token-level routing rows kept per layer (placements are evaluated on them)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..fileio import check_output_path

    check_output_path(args.out, args.model, args.data, what="--out")
    check_hub_sources("profile", models=[args.model], datasets=[args.data])
    from ..data import spread_rows

    data = spread_rows(load_args_data(args))  # --max-tokens then samples every source of the data

    quiet_deepspeed_accelerator()
    from ..checkpoint.load import load_model_and_tokenizer
    from ..profiling import profile_model

    model, tokenizer = load_model_and_tokenizer(args.model)
    batches = data_batches(
        tokenizer, data, args.seq_len, args.batch_size, args.max_tokens, response_only=False
    )
    prof = profile_model(
        model,
        batches,
        model_name=args.model,
        max_tokens=args.max_tokens,
        max_routing_tokens=args.max_routing_tokens,
    )
    prof.save(args.out)
    note_data_ran_out("profile", args.data, prof.num_tokens, args.max_tokens)
    print(
        f"profiled {prof.num_tokens} tokens over {len(prof.layers)} MoE layers "
        f"({prof.num_experts} experts, top-{prof.top_k}) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("profile", add_parser))
