"""Cost of the profiling hooks next to the forward pass itself, measured side by side in one run.

    python benchmarks/profile_overhead.py [--model embedded] [--tokens 16384]

Runs the same batches through the model plainly and under `occult_ft.profiling.RoutingRecorder`,
alternating the two, and prints the median time per batch of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from occult_ft.profiling import RoutingRecorder


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded", help="model dir/Hub id, or 'embedded'")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    from occult_ft.checkpoint.load import load_model_and_tokenizer

    path = args.model
    if path == "embedded":
        from occult_ft.embedded import embedded_model_path

        path = embedded_model_path()
    model, _ = load_model_and_tokenizer(path)
    model.eval()
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (args.batch, args.seq_len))
    plain, hooked = [], []
    with torch.no_grad():
        model(batch)  # warm-up
        for _ in range(args.repeats):
            t = time.perf_counter()
            model(batch)
            plain.append(time.perf_counter() - t)
            with RoutingRecorder(model) as rec:
                rec.mask_T = torch.ones(batch.numel(), dtype=torch.bool)
                t = time.perf_counter()
                model(batch)
                hooked.append(time.perf_counter() - t)
    p, h = statistics.median(plain), statistics.median(hooked)
    print(
        f"forward {p * 1e3:.1f} ms, forward + profiling hooks {h * 1e3:.1f} ms: overhead {100 * (h / p - 1):.1f}% "
        f"({args.batch}x{args.seq_len} tokens, median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
