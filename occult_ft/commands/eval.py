"""`occult-ft eval MODEL [--data DATA] [--devices D] [--json]`: quality and routing of a (pruned) model.

Loads MODEL with `occult_ft.from_pretrained`, so a pruned checkpoint or an occult_ft LoRA adapter routes
with its budget, and reports on DATA (plain text is packed into --seq-len blocks; instruction rows are
scored on their responses):

    loss, perplexity          mean next-token cross-entropy over the labelled tokens, and exp(loss)
    comm_complexity           mean devices a token reaches (rows of a de-duplicated all-to-all)
    intra_share               share of co-selected expert pairs on one device
    removed_mass              share of the unpruned top-k router mass that pruning removed
    load_imbalance            max / mean rows per device (worst layer)

and the devices-per-token histogram, overall and per layer. D is the model's own (from its `occult`
block), else --devices, else 4.

The output of `occult-ft train` records the run's settings: evaluated without --data / --split /
--seq-len, it is evaluated as the trainer evaluated it (its eval_dataset and split, its seq_len), and
the command says which settings it took from the run.
"""

from __future__ import annotations

import argparse
import json

from ._common import (
    add_model_data_args,
    check_hub_sources,
    data_batches,
    load_args_data,
    note,
    positive_int,
    quiet_deepspeed_accelerator,
    standalone,
)

__all__ = ["add_parser", "run", "run_defaults"]

_FALLBACK = {"data": None, "split": None, "seq_len": 256}


def add_parser(sub):
    p = sub.add_parser(
        "eval",
        help="loss, perplexity and routing metrics of a (pruned) model on held-out data",
        description=__doc__,
    )
    add_model_data_args(p, data_required=False)
    # None = the run's setting for a training output, else 256 (see run_defaults)
    p.set_defaults(seq_len=None)
    for action in p._actions:
        if action.dest == "seq_len":
            action.help = "tokens per sequence; default: the run's seq_len for a training output, else 256"
        if action.dest == "data":
            action.help += "; default: the run's eval_dataset for a training output"
    p.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="expert-parallel size D for the routing metrics; default: the model's own, else 4",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run_defaults(args: argparse.Namespace, recorded: dict) -> list[str]:
    """Fill --data, --split and --seq-len left out from the run's recorded settings (`recorded`: the
    occult block's `run` entry of a training output, {} otherwise); returns the settings taken from it."""
    taken = []
    if args.data is None and recorded.get("eval_dataset"):
        args.data = recorded["eval_dataset"]
        taken.append(f"data {args.data}")
        if args.split is None and recorded.get("eval_dataset_split"):
            args.split = recorded["eval_dataset_split"]
            taken.append(f"split {args.split}")
    if args.seq_len is None and recorded.get("seq_len"):
        args.seq_len = int(recorded["seq_len"])
        taken.append(f"seq_len {args.seq_len}")
    for name, value in _FALLBACK.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.data is None:
        raise ValueError(
            f"--data is required: {args.model} records no eval_dataset of a training run; pass --data "
            "(a file, a dataset, or 'embedded')"
        )
    return taken


def run(args: argparse.Namespace) -> int:
    check_hub_sources("eval", models=[args.model], datasets=[args.data])
    quiet_deepspeed_accelerator()

    from ..checkpoint import describe_checkpoint
    from ..checkpoint.card import recorded_run_settings
    from ..checkpoint.load import local_model_dir

    path = local_model_dir(args.model)
    summary = describe_checkpoint(path)
    recorded = summary.block.num_devices if summary.block is not None else None
    if recorded is not None and args.devices is not None and args.devices != recorded:
        # a placed or pruned checkpoint is laid out for its own D: other figures would mean nothing
        what = "pruned" if summary.pruned else "placed"
        raise ValueError(
            f"--devices {args.devices} but {args.model} is {what} for {recorded} devices; use --devices "
            f"{recorded} or drop --devices"
        )
    taken = run_defaults(args, recorded_run_settings(summary))
    if taken:
        note("eval", f"evaluating with the training run's settings: {', '.join(taken)}")
    data = load_args_data(args)

    import torch
    from tqdm.auto import tqdm

    from ..checkpoint.load import from_pretrained, load_tokenizer
    from ..evaluation import evaluate_model, format_results
    from ..models import unwrap_model

    model = from_pretrained(path)
    if torch.cuda.is_available():
        model = model.to("cuda")
    tokenizer = load_tokenizer(path, getattr(unwrap_model(model).config, "_name_or_path", None))
    batches = data_batches(tokenizer, data, args.seq_len, args.batch_size, args.max_tokens)
    shown = tqdm(batches, desc="evaluating", unit="batch")
    results = {"model": args.model, **evaluate_model(model, shown, args.devices, args.max_tokens)}
    print(json.dumps(results) if args.json else format_results(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("eval", add_parser))
