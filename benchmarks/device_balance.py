"""Device load balance after the demo's pruned fine-tuning, with and without the balance loss acting on
device load.

    python benchmarks/device_balance.py [--steps 150] [--coefs 0.01,0.1] [--json out.json]

The demo's run (`occult-ft demo`): the embedded OLMoE, search placement on 4 devices, budget 2 with the
similarity criterion, 150 steps. Each variant fine-tunes it once, then the held-out routing is measured
on 4 devices: comm_complexity, device load imbalance (max / mean rows per device; the worst layer and
the mean over layers) and eval loss. Variants, per balance_loss_coef:

    expert term    the loss before this change: E * sum_e f_e P_e over the pruned routing (experts only)
    device term    the loss now: (expert term + K * device term) / 2 (`occult_ft.trainer.losses`)

Issue 15's target (budget 2, 4 devices, after the demo's fine-tuning): load imbalance <= 1.25 with
comm_complexity no more than 3% above the expert-term run; the placement part (a load-bounded
placement) is another change, so this measures the loss alone on the demo's placement.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from unittest import mock

import torch

from occult_ft.checkpoint.load import load_model_and_tokenizer
from occult_ft.data import load_text_dataset
from occult_ft.evaluation import data_batches, evaluate_model
from occult_ft.fileio import atomic_write_text
from occult_ft.metrics import contiguous_expert_device, routing_report
from occult_ft.models import find_moe_layers
from occult_ft.placement import compute_placement
from occult_ft.profiling import profile_model
from occult_ft.studies.finetune import DemoSettings, finetune_embedded
from occult_ft.trainer import trainer as trainer_module


def _expert_term_only(balance_loss):
    def wrapped(records, mask_T=None, expert_device=None, num_devices=None):
        return balance_loss(records, mask_T)

    return wrapped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--coefs", default="0.01", help="balance_loss_coef values (comma-separated)")
    ap.add_argument("--variants", default="expert,device", help="expert (the loss before), device (now)")
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = args.output_dir or tempfile.mkdtemp(prefix="occult-balance-")
    s = DemoSettings(output_dir=out, steps=args.steps)
    torch.manual_seed(s.seed)
    model, tokenizer = load_model_and_tokenizer("embedded")
    model.eval()
    train_text = load_text_dataset("embedded", split="train")
    profile = profile_model(
        model,
        data_batches(tokenizer, train_text, s.seq_len, 16, s.profile_tokens),
        model_name="embedded",
        max_tokens=s.profile_tokens,
        progress=False,
    )
    placement = compute_placement(profile, s.devices, algorithm="search")
    placement_path = os.path.join(out, "placement-search.json")
    placement.save(placement_path)
    eval_batches = data_batches(tokenizer, "embedded", s.seq_len, 16, s.eval_tokens)
    results = []
    for coef in [float(c) for c in args.coefs.split(",")]:
        for variant in args.variants.split(","):
            patch = (
                mock.patch.object(
                    trainer_module, "balance_loss", _expert_term_only(trainer_module.balance_loss)
                )
                if variant == "expert"
                else mock.patch.object(trainer_module, "balance_loss", trainer_module.balance_loss)
            )
            with patch:
                trainer, run = finetune_embedded(
                    s,
                    placement_path,
                    os.path.join(out, f"{variant}-{coef}"),
                    s.max_devices_per_token,
                    s.criterion,
                    balance_loss_coef=coef,
                )
            tuned = trainer.model.eval()
            ev = evaluate_model(tuned, eval_batches, s.devices)
            routing = profile_model(tuned, eval_batches, progress=False).topk_ids()
            e = find_moe_layers(tuned)[0].num_experts  # the fine-tuned model is placed: contiguous blocks
            rep = routing_report(routing, contiguous_expert_device(e, s.devices), s.devices, e)
            row = {
                "variant": variant,
                "balance_loss_coef": coef,
                "eval_loss": ev["loss"],
                "comm_complexity": rep.comm_complexity,
                "load_imbalance_worst_layer": rep.load_imbalance,
                "load_imbalance_mean": rep.mean_load_imbalance,
                "train_tokens_per_second": run["train_tokens_per_second"],
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    base = next((r for r in results if r["variant"] == "expert"), None)
    for r in results:
        if base:
            r["comm_complexity_vs_expert_term"] = r["comm_complexity"] / base["comm_complexity"] - 1
        print(
            f"{r['variant']:>7} coef {r['balance_loss_coef']:<6} eval loss {r['eval_loss']:.4f}  comm_complexity "
            f"{r['comm_complexity']:.3f}  load imbalance mean {r['load_imbalance_mean']:.3f} worst "
            f"{r['load_imbalance_worst_layer']:.3f}"
        )
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
