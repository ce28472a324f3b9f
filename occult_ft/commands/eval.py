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
import math

from ._common import add_model_data_args, data_batches, load_data, positive_int, standalone

__all__ = ["add_parser", "run", "evaluate_model", "format_results"]


def add_parser(sub):
    p = sub.add_parser("eval", help="loss, perplexity and routing metrics of a (pruned) model on held-out data",
                       description=__doc__)
    add_model_data_args(p)
    p.add_argument("--devices", type=positive_int, default=None,
                   help="expert-parallel size D for the routing metrics (default: the model's own, else 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def evaluate_model(model, batches, num_devices: int | None = None, max_tokens: int | None = None) -> dict:
    """Loss, perplexity and routing metrics of `model` over `batches`.

    Args:
        model: a transformers MoE model (pruned routers installed or not; PEFT wrappers are fine).
        batches: dicts with `input_ids` (B, S), `attention_mask` (B, S) and `labels` (B, S, -100 = ignored).
        num_devices: D for the metrics; must match the model's pruning when it has one (default: that D, else 4).
        max_tokens: stop after this many real tokens.
    """
    import torch
    import torch.nn.functional as F

    from ..metrics import random_placement_comm_complexity, routing_report
    from ..models import find_moe_layers, unwrap_model
    from ..routing import PruningConfig, apply_pruning, pruned_routers, set_recording

    routers = pruned_routers(model)
    pruning = routers[0][1].occult_config if routers else None
    if pruning is not None and num_devices is not None and num_devices != pruning.num_devices:
        raise ValueError(
            f"--devices {num_devices} disagrees with the model's pruning for {pruning.num_devices} devices; drop --devices"
        )
    if pruning is None:
        pruning = PruningConfig(num_devices or 4)
        apply_pruning(model, pruning)  # record only: the routing is unchanged
    d = pruning.num_devices
    layers = find_moe_layers(model)
    e, k = layers[0].num_experts, layers[0].top_k
    device = next(unwrap_model(model).parameters()).device
    model.eval()
    set_recording(model, True, keep_graph=False)
    ids: dict[int, list] = {layer.index: [] for layer in layers}
    expert_device: dict[int, torch.Tensor] = {}
    nll, labelled, tokens, removed, routed = 0.0, 0, 0, 0.0, 0
    with torch.no_grad():
        for batch in batches:
            batch = {key: value.to(device) for key, value in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:]
            nll += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                   reduction="sum").item()
            labelled += int((labels != -100).sum())
            mask_T = batch["attention_mask"].flatten().bool()
            for layer, router in pruned_routers(model):
                rec = router.occult_record
                ids[layer.index].append(rec.topk_ids[mask_T].cpu())
                expert_device[layer.index] = router.occult_expert_device.cpu()
                removed += rec.removed_mass[mask_T].double().sum().item()
                routed += int(mask_T.sum())
            tokens += int(mask_T.sum())
            if max_tokens is not None and tokens >= max_tokens:
                break
    set_recording(model, False)
    if tokens == 0:
        raise ValueError("the data gave no tokens; check that it is not empty")
    report = routing_report({i: torch.cat(v) for i, v in ids.items()}, expert_device, d, e)
    loss = nll / labelled if labelled else float("nan")
    return {
        "tokens": tokens,
        "labelled_tokens": labelled,
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)) if labelled else float("nan"),
        "num_devices": d,
        "max_devices_per_token": pruning.max_devices_per_token,
        "criterion": pruning.criterion if pruning.active else None,
        "top_k": k,
        "comm_complexity": report.comm_complexity,
        "intra_share": report.intra_share,
        "removed_mass": removed / routed if routed else 0.0,
        "load_imbalance": report.load_imbalance,
        "devices_histogram": report.devices_histogram,
        "random_placement_comm_complexity": random_placement_comm_complexity(e, k, d),
        "layers": [
            {"layer": m.layer, "comm_complexity": m.comm_complexity, "intra_share": m.intra_share,
             "load_imbalance": m.load_imbalance, "devices_histogram": m.devices_histogram}
            for m in report.layers
        ],
    }


def format_results(results: dict) -> str:
    budget = results["max_devices_per_token"]
    lines = [
        f"model: {results['model']}",
        f"tokens: {results['tokens']} ({results['labelled_tokens']} labelled)",
        f"loss: {results['loss']:.4f}   perplexity: {results['perplexity']:.2f}",
        f"devices: {results['num_devices']}   max_devices_per_token: {budget if budget is not None else 'none'}"
        + (f" ({results['criterion']})" if results["criterion"] else ""),
        f"comm_complexity: {results['comm_complexity']:.3f} (top-k {results['top_k']}; random placement "
        f"{results['random_placement_comm_complexity']:.3f})",
        f"intra_share: {results['intra_share']:.3f}   removed_mass: {results['removed_mass']:.4f}   "
        f"load_imbalance: {results['load_imbalance']:.2f}",
        f"devices/token histogram: {results['devices_histogram']}",
    ]
    for m in results["layers"]:
        lines.append(f"  layer {m['layer']:>3}: comm_complexity {m['comm_complexity']:.3f}  intra_share "
                     f"{m['intra_share']:.3f}  load_imbalance {m['load_imbalance']:.2f}")
    return "\n".join(lines)


def _tokenizer_for(path: str, model):
    from transformers import AutoTokenizer

    from ..models import unwrap_model

    for source in (path, getattr(unwrap_model(model).config, "_name_or_path", None)):
        if not source:
            continue
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, KeyError):
            continue
    raise ValueError(f"found no tokenizer for {path!r}; save one beside the model (tokenizer.save_pretrained)")


def run(args) -> int:
    import torch

    from ..checkpoint import from_pretrained

    data = load_data(args.data)
    model = from_pretrained(args.model)
    if torch.cuda.is_available():
        model = model.to("cuda")
    tokenizer = _tokenizer_for(args.model, model)
    batches = data_batches(tokenizer, data, args.seq_len, args.batch_size, args.max_tokens)
    results = {"model": args.model, **evaluate_model(model, batches, args.devices, args.max_tokens)}
    print(json.dumps(results) if args.json else format_results(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("eval", add_parser))
