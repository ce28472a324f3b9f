"""Redundant experts (EPLB's replicas) on a trained checkpoint's own pruned routing.

    python benchmarks/redundant_experts.py CHECKPOINT [--replicas 0,4,8,12,16] [--devices 4]

The copies are placed (`occult_ft.placement.replicas.place_replicas`) on a profile of the training split
(16,384 tokens of seq_len 128: the tiny recipe's `profile_tokens`), then the eval split is measured as
`occult-ft analyze CHECKPOINT --data embedded --devices D` profiles it (seq_len 256, batch 8), with the
copies counted (`routing_report(copies=...)`): device load imbalance (worst layer, mean over layers) and
comm_complexity, held out and on the profiled tokens. R = 0 is `analyze`'s own report.
Results: docs/device-balance.md#redundant-experts-eplbs-replicas.
"""

from __future__ import annotations

import argparse
import json
import time

from occult_ft.checkpoint.load import from_pretrained, load_tokenizer, resolve_model_path
from occult_ft.data import load_text_dataset
from occult_ft.evaluation import data_batches
from occult_ft.metrics import contiguous_expert_device, routing_report
from occult_ft.placement.replicas import place_replicas
from occult_ft.profiling import profile_model

PROFILE_TOKENS = 16384


def replica_counts(text: str) -> list[int]:
    """--replicas: comma-separated whole numbers >= 0 (each a multiple of --devices, checked when placed)."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers; use e.g. 0,4,8"
        ) from None
    if any(r < 0 for r in counts):
        raise argparse.ArgumentTypeError(f"{text!r} has a negative count; use counts >= 0, e.g. 0,4,8")
    return counts


def positive(text: str) -> int:
    """--devices: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer; use e.g. 4")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint")
    parser.add_argument(
        "--replicas",
        type=replica_counts,
        default="0,4,8,12,16",
        help="redundant experts R (extra slots in all, multiples of --devices), comma-separated",
    )
    parser.add_argument("--devices", type=positive, default=4, help="devices D the experts are split over")
    args = parser.parse_args()
    if any(r % args.devices for r in args.replicas):
        parser.error(
            f"--replicas {args.replicas} must be multiples of --devices {args.devices} (R/D copies per device)"
        )
    model = from_pretrained(args.checkpoint)
    tokenizer = load_tokenizer(resolve_model_path(args.checkpoint))
    train_rows = load_text_dataset("embedded", split="train")
    train = profile_model(
        model, data_batches(tokenizer, train_rows, 128, 8, PROFILE_TOKENS, False), max_tokens=PROFILE_TOKENS
    )
    held = profile_model(
        model, data_batches(tokenizer, load_text_dataset("embedded", split="eval"), 256, 8, None, False)
    )
    num_experts = next(iter(train.layers.values())).coactivation.shape[0]
    expert_device = contiguous_expert_device(num_experts, args.devices)
    out = {}
    for r in args.replicas:
        start = time.perf_counter()
        copies = {
            i: place_replicas(ids, expert_device, args.devices, r) for i, ids in train.topk_ids().items()
        }
        seconds = time.perf_counter() - start
        report = routing_report(held.topk_ids(), expert_device, args.devices, num_experts, copies=copies)
        fit = routing_report(train.topk_ids(), expert_device, args.devices, num_experts, copies=copies)
        out[r] = dict(
            worst=round(report.load_imbalance, 4),
            mean=round(report.mean_load_imbalance or 0.0, 4),
            comm_complexity=round(report.comm_complexity, 4),
            layers=[round(m.load_imbalance, 4) for m in report.layers],
            profiled_worst=round(fit.load_imbalance, 4),
            profiled_mean=round(fit.mean_load_imbalance or 0.0, 4),
            place_seconds=round(seconds, 1),
            tokens=held.num_tokens,
        )
        print(r, out[r], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
