"""Cost of the router self-check (occult_ft/models/selfcheck.py) on a real model, one command.

    python benchmarks/selfcheck_cost.py [--model embedded] [--repeats 20]

Loads the model, then times `check_model_routing` (what the first `find_moe_layers` call on a model runs:
the model's own router and the registry's maths on 64 random tokens of one MoE layer, as loaded and on a
randomised copy) with its per-model cache cleared before every repeat, and prints the first call (cold)
and the median and maximum of the repeats, next to one forward pass of 64 tokens for scale. Also times a
DeepSeek-V3-sized router (256 experts x 7168, the widest of the recipes) built alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from occult_ft.models import find_moe_layers
from occult_ft.models.selfcheck import check_layer_routing, check_model_routing

_CACHE = "_occult_routing_checked"


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _deepseek_v3_layer():
    """One MoE layer of DeepSeek-V3's width (router 256 x 7168, top-8 in 4 of 8 groups), tiny experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from occult_ft.models import tiny_config

    config = tiny_config("deepseek_v3", hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8)
    config.n_group, config.topk_group = 8, 4
    config.moe_intermediate_size = config.intermediate_size = 8
    config.num_attention_heads = config.num_key_value_heads = 1
    config.q_lora_rank, config.kv_lora_rank = 8, 8
    config.qk_nope_head_dim = config.qk_rope_head_dim = config.v_head_dim = 8
    config.num_hidden_layers, config.first_k_dense_replace = 1, 0
    config.vocab_size = 16
    assert isinstance(config, AutoConfig.for_model("deepseek_v3").__class__)
    model = AutoModelForCausalLM.from_config(config)
    return find_moe_layers(model, check=False)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded", help="model dir/Hub id, or 'embedded'")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    from occult_ft.checkpoint.load import load_model_and_tokenizer

    path = args.model
    if path == "embedded":
        from occult_ft.embedded import embedded_model_path

        path = embedded_model_path()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    model, _ = load_model_and_tokenizer(path)
    model.eval()
    layers = find_moe_layers(model, check=False)

    def check():
        model.__dict__.pop(_CACHE, None)
        check_model_routing(model, layers)

    cold = _time(check)
    runs = [_time(check) for _ in range(args.repeats)]
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    with torch.no_grad():
        model(ids)
        forward = statistics.median(_time(lambda: model(ids)) for _ in range(5))
    wide = _deepseek_v3_layer()
    wide_runs = [_time(lambda: check_layer_routing(wide)) for _ in range(max(3, args.repeats // 4))]
    print(
        f"model: {path} ({model.config.model_type}, {len(layers)} MoE layers, {layers[0].num_experts} experts)"
    )
    print(f"self-check, first call: {cold * 1e3:.1f} ms")
    print(
        f"self-check, median of {len(runs)}: {statistics.median(runs) * 1e3:.1f} ms (max {max(runs) * 1e3:.1f} ms)"
    )
    print(f"one forward pass of 64 tokens: {forward * 1e3:.1f} ms")
    print(
        f"DeepSeek-V3-wide router (256 x 7168, top-8, groups): median {statistics.median(wide_runs) * 1e3:.1f} ms"
    )
    print(f"torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
