"""Host synchronisations per MoE layer forward: the pruned router and each exchange, counted on CPU.

    python benchmarks/host_syncs.py

A tiny OLMoE (32 experts, top-4) sharded on one rank ("occult_ep" kernel), its first MoE block run once
per setting (budget none / 2 / 1 on 4 devices, score and similarity criteria, every exchange and the
capacity-bounded mode) under `occult_ft.bench.syncs.HostSyncCounter`, which counts every Python-level
read of a device value (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, boolean-mask indexing, ...).
The call sites are printed, so a new read shows where it is. On CUDA the same check is
`torch.cuda.set_sync_debug_mode` (tests/test_gpu.py).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from occult_ft.bench.syncs import HostSyncCounter
from occult_ft.dispatch import configure_exchange, shard_experts
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.routing import PruningConfig, apply_pruning


def main() -> int:
    print(f"{'budget':>6} {'criterion':>10} {'exchange':>10} {'capacity':>8}  syncs  sites")
    for budget in (None, 2, 1):
        for criterion in ("score", "similarity"):
            for exchange, capacity in (("flat", None), ("per_expert", None), ("flat", 256)):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(
                    tiny_config("olmoe", num_experts=32, num_experts_per_tok=4)
                )
                layers = find_moe_layers(model)
                similarity = {m.index: torch.rand(32, 32) for m in layers}
                config = PruningConfig(num_devices=4, max_devices_per_token=budget, criterion=criterion)
                apply_pruning(model, config, similarity)
                shard_experts(model)
                configure_exchange(model, exchange, 1, capacity)
                hidden = torch.randn(4, 64, model.config.hidden_size)
                layers[0].block(hidden)  # warm up
                with HostSyncCounter() as counter:
                    layers[0].block(hidden)
                print(
                    f"{str(budget):>6} {criterion:>10} {exchange:>10} {str(capacity):>8}  {counter.count:>5}  "
                    f"{dict(counter.by_site)}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
