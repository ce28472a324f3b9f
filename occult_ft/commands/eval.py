"""`occult-ft eval MODEL --data DATA [--devices D] [--json]`: quality and routing of a (pruned) model.

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
"""

from __future__ import annotations

import json

from ..evaluation import evaluate_model, format_results
from ._common import add_model_data_args, data_batches, load_data, positive_int, standalone

__all__ = ["add_parser", "run"]


def add_parser(sub):
    p = sub.add_parser(
        "eval",
        help="loss, perplexity and routing metrics of a (pruned) model on held-out data",
        description=__doc__,
    )
    add_model_data_args(p)
    p.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="expert-parallel size D for the routing metrics (default: the model's own, else 4)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import torch

    from ..checkpoint.load import from_pretrained, load_tokenizer

    data = load_data(args.data)
    model = from_pretrained(args.model)
    if torch.cuda.is_available():
        model = model.to("cuda")
    from ..models import unwrap_model

    tokenizer = load_tokenizer(args.model, getattr(unwrap_model(model).config, "_name_or_path", None))
    batches = data_batches(tokenizer, data, args.seq_len, args.batch_size, args.max_tokens)
    results = {"model": args.model, **evaluate_model(model, batches, args.devices, args.max_tokens)}
    print(json.dumps(results) if args.json else format_results(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("eval", add_parser))
