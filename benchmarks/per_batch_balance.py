"""Device balance per micro-batch on the step benchmark's random model under a device budget, and what
balancing each micro-batch would cost.

    python benchmarks/per_batch_balance.py [--layers 2] [--micro-batches 16] [--budget 2] [--devices 4]

The model is `occult-ft bench --train`'s OLMoE-shaped random model (its seed, 64 experts top-8, hidden
512; `--layers` as the bench's `--num-layers`), its experts in the original order on D devices, every
token limited to `--budget` devices (criterion score); the data are its random micro-batches of 2,048
tokens. For every micro-batch after the first it measures the device load imbalance (max / mean rows a
device receives) of each layer under three device biases:

- none;
- fitted on the first micro-batch (`device_bias_init="first_batch"`), then kept, as training starts;
- fitted on that micro-batch itself (`fit_router_device_bias` on it): the most that balancing each
  batch could reach, and the time that fit takes (one forward, then `FIT_ITERATIONS` + 1 rule steps,
  each pruning every layer's kept router outputs once).

Results: docs/cluster.md (the device bias in the step benchmark).
"""

from __future__ import annotations

import argparse
import time

import torch

from occult_ft.bench.step import BALANCED_BIAS_RATE, StepSettings, random_model, random_rows
from occult_ft.metrics import load_imbalance
from occult_ft.routing import apply_pruning, fit_router_device_bias, pruned_routers
from occult_ft.routing.config import PruningConfig
from occult_ft.routing.rules import FIT_ITERATIONS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="MoE layers (the bench's --num-layers)")
    parser.add_argument("--micro-batches", type=int, default=16, help="micro-batches of 2,048 tokens (>= 2)")
    parser.add_argument("--budget", type=int, default=2, help="max_devices_per_token")
    parser.add_argument("--devices", type=int, default=4, help="D, the expert-parallel size")
    args = parser.parse_args()
    if args.micro_batches < 2:
        parser.error(f"--micro-batches {args.micro_batches}: the first fits the bias; use 2 or more")
    settings = StepSettings(layers=args.layers, devices=args.devices)
    model = random_model(settings).eval()
    layers = apply_pruning(
        model,
        PruningConfig(num_devices=args.devices, max_devices_per_token=args.budget),
        device_bias={i: torch.zeros(args.devices) for i in range(args.layers)},
    )
    routers = [router for _, router in pruned_routers(model)]
    for router in routers:
        router.occult_recording = True
    rows = settings.micro_batch_tokens // settings.seq_len
    batches = random_rows(settings, rows * args.micro_batches).split(rows)

    def set_bias(bias: list[torch.Tensor]) -> None:
        for router, row in zip(routers, bias, strict=True):
            router._buffers["occult_device_bias"].copy_(row)

    @torch.no_grad()
    def imbalances(batch: torch.Tensor) -> list[float]:
        model(input_ids=batch)
        return [
            load_imbalance(r.occult_record.topk_ids, r.occult_expert_device, args.devices) for r in routers
        ]

    zeros = [torch.zeros(args.devices) for _ in routers]
    fitted = fit_router_device_bias(model, lambda: model(input_ids=batches[0]), BALANCED_BIAS_RATE)
    first = [fitted[layer.index].clone() for layer in layers]
    seen: dict[str, list[list[float]]] = {"none": [], "first_batch": [], "own_batch": []}
    fit_s, forward_s = [], []
    for batch in batches[1:]:
        set_bias(zeros)
        start = time.perf_counter()
        seen["none"].append(imbalances(batch))
        forward_s.append(time.perf_counter() - start)
        set_bias(first)
        seen["first_batch"].append(imbalances(batch))
        set_bias(zeros)
        start = time.perf_counter()
        fit_router_device_bias(model, lambda b=batch: model(input_ids=b), BALANCED_BIAS_RATE)
        fit_s.append(time.perf_counter() - start)
        seen["own_batch"].append(imbalances(batch))
    print(
        f"random model, {args.layers} layers, budget {args.budget} of {args.devices} devices, "
        f"{len(batches) - 1} micro-batches of {rows * settings.seq_len} tokens: device load imbalance per layer"
    )
    for name, values in seen.items():
        table = torch.tensor(values)
        mean = ", ".join(f"{x:.3f}" for x in table.mean(0).tolist())
        worst = ", ".join(f"{x:.3f}" for x in table.max(0).values.tolist())
        print(f"  bias {name:<12} mean over micro-batches [{mean}], worst [{worst}]")
    fit, forward = sum(fit_s) / len(fit_s), sum(forward_s) / len(forward_s)
    per_step = (fit - forward) / ((FIT_ITERATIONS + 1) * len(routers))
    print(
        f"fit on one micro-batch: {1000 * fit:.0f} ms (a forward: {1000 * forward:.0f} ms; "
        f"{1000 * per_step:.1f} ms per rule step and layer)"
    )


if __name__ == "__main__":
    main()
