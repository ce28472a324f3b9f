"""Held-out evaluation: loss, perplexity and routing metrics of a (pruned) MoE model on data.

Used by `occult-ft eval`, the demo and the quality study. `data_batches` turns a data source into
padded batches with labels (`occult_ft.data.make_batches`); `evaluate_model` runs the model over
them with its routers recording; `measure_checkpoint` loads a saved checkpoint and measures its own
routing as a `RoutingReport` (the model card's comm_complexity figure draws it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import describe_checkpoint
from .checkpoint.load import from_pretrained, load_tokenizer
from .data import DataError, load_text_dataset, make_batches
from .metrics import contiguous_expert_device, random_placement_comm_complexity, routing_report
from .models import find_moe_layers, unwrap_model
from .plots import comm_complexity_figure
from .profiling import profile_model
from .routing import PruningConfig, apply_pruning, pruned_routers, set_recording

__all__ = [
    "FIGURE_NAME",
    "load_data",
    "data_batches",
    "evaluate_model",
    "format_results",
    "measure_checkpoint",
    "make_comm_complexity_figure",
]


def load_data(data: str, skip_invalid_rows: bool = False):
    """The raw dataset behind a --data value (checked before any model is loaded; rows that do not fit
    its layout are an error, or skipped and counted with `skip_invalid_rows`)."""

    if data == "embedded":
        return load_text_dataset("embedded", split="eval")
    return load_text_dataset(data, skip_invalid_rows=skip_invalid_rows)


def data_batches(
    tokenizer, data, seq_len: int, batch_size: int, max_tokens: int | None = None, response_only: bool = True
) -> list[dict]:
    """Tokenised `data` (a --data value or a loaded dataset) as padded batches of `input_ids`,
    `attention_mask` and `labels` (`occult_ft.data.make_batches`); enough rows for `max_tokens` real
    (unpadded) tokens. `response_only=False` keeps instruction prompts in the labels (and keeps rows
    whose prompt fills `seq_len`): for routing statistics every token counts."""

    if tokenizer is None:
        raise DataError("the model has no tokenizer; save one beside the model (tokenizer.save_pretrained)")
    ds = load_data(data) if isinstance(data, str) else data
    return make_batches(tokenizer, ds, seq_len, batch_size, max_tokens, response_only)


def _recording_pruning(model, num_devices: int | None) -> PruningConfig:
    """The model's pruning (its D must be `num_devices` when given); an unpruned model gets a
    recording-only one for D = `num_devices` (default 4), its routing unchanged."""
    routers = pruned_routers(model)
    pruning = routers[0][1].occult_config if routers else None
    if pruning is not None and num_devices is not None and num_devices != pruning.num_devices:
        raise ValueError(
            f"--devices {num_devices} disagrees with the model's pruning for {pruning.num_devices} devices; drop --devices"
        )
    if pruning is None:
        pruning = PruningConfig(num_devices or 4)
        apply_pruning(model, pruning)  # record only: the routing is unchanged
    return pruning


def evaluate_model(model, batches, num_devices: int | None = None, max_tokens: int | None = None) -> dict:
    """Loss, perplexity and routing metrics of `model` over `batches`.

    Args:
        model: a transformers MoE model (pruned routers installed or not; PEFT wrappers are fine).
        batches: dicts with `input_ids` (B, S), `attention_mask` (B, S) and `labels` (B, S, -100 = ignored).
        num_devices: D for the metrics; must match the model's pruning when it has one (default: that D, else 4).
        max_tokens: stop after this many real tokens.
    """
    import torch

    pruning = _recording_pruning(model, num_devices)
    d = pruning.num_devices
    layers = find_moe_layers(model)
    e, k = layers[0].num_experts, layers[0].top_k
    device = next(unwrap_model(model).parameters()).device
    model.eval()
    set_recording(model, True, keep_graph=False)
    tally = _Tally({layer.index: [] for layer in layers})
    with torch.no_grad():
        for batch in batches:
            tally.add(model, {key: value.to(device) for key, value in batch.items()})
            if max_tokens is not None and tally.tokens >= max_tokens:
                break
    set_recording(model, False)
    if tally.tokens == 0:
        raise ValueError("the data gave no tokens; check that it is not empty")
    report = routing_report({i: torch.cat(v) for i, v in tally.ids.items()}, tally.expert_device, d, e)
    loss = tally.nll / tally.labelled if tally.labelled else float("nan")
    return {
        "tokens": tally.tokens,
        "labelled_tokens": tally.labelled,
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)) if tally.labelled else float("nan"),
        "num_devices": d,
        "max_devices_per_token": pruning.max_devices_per_token,
        "criterion": pruning.criterion if pruning.active else None,
        "top_k": k,
        "comm_complexity": report.comm_complexity,
        "intra_share": report.intra_share,
        "removed_mass": tally.removed / tally.routed if tally.routed else 0.0,
        "load_imbalance": report.load_imbalance,
        "devices_histogram": report.devices_histogram,
        "random_placement_comm_complexity": random_placement_comm_complexity(e, k, d),
        "layers": [
            {
                "layer": m.layer,
                "comm_complexity": m.comm_complexity,
                "intra_share": m.intra_share,
                "load_imbalance": m.load_imbalance,
                "devices_histogram": m.devices_histogram,
            }
            for m in report.layers
        ],
    }


@dataclass
class _Tally:
    """What `evaluate_model` sums over its batches: the summed next-token loss over labelled positions,
    the real (unpadded) tokens, and per MoE layer the recorded top-k of every real token, the layer's
    expert -> device map and the router mass its budget removed."""

    ids: dict[int, list]  # MoE layer index -> (T_b, K) top-k of each batch's real tokens
    expert_device: dict[int, Any] = field(default_factory=dict)
    nll: float = 0.0
    labelled: int = 0
    tokens: int = 0
    removed: float = 0.0
    routed: int = 0  # real tokens x pruned routers: the denominator of removed_mass

    def add(self, model, batch: dict) -> None:
        import torch.nn.functional as F

        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]  # position s predicts token s + 1
        self.nll += F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        ).item()
        self.labelled += int((labels != -100).sum())
        mask_T = batch["attention_mask"].flatten().bool()
        for layer, router in pruned_routers(model):
            rec = router.occult_record
            assert rec is not None  # recording is on
            self.ids[layer.index].append(rec.topk_ids[mask_T].cpu())
            self.expert_device[layer.index] = router.occult_expert_device.cpu()
            self.removed += rec.removed_mass[mask_T].double().sum().item()
            self.routed += int(mask_T.sum())
        self.tokens += int(mask_T.sum())


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
        lines.append(
            f"  layer {m['layer']:>3}: comm_complexity {m['comm_complexity']:.3f}  intra_share "
            f"{m['intra_share']:.3f}  load_imbalance {m['load_imbalance']:.2f}"
        )
    return "\n".join(lines)


def measure_checkpoint(
    checkpoint_dir: str | os.PathLike,
    data: Any = "embedded",
    devices: int | None = None,
    max_tokens: int = 2048,
    seq_len: int = 128,
    batch_size: int = 8,
):
    """`RoutingReport` of a checkpoint's own (placed, pruned) routing on `data`.

    The checkpoint (written by `save_pruned`, the trainer or `occult-ft prune`) is loaded with
    `occult_ft.from_pretrained`, its placement and pruned routing active, and run over `max_tokens`
    tokens of `data`. Its experts are stored placed, so device d holds experts [d*E/D, (d+1)*E/D).
    The report's `extra` carries `model` (the folder name), `max_devices_per_token`,
    `max_nodes_per_token` and `criterion` (None when unpruned), which `occult_ft.plots.plot_report` puts in the title and reference lines:

        report = measure_checkpoint("out")
        comm_complexity_figure(report, "out/comm_complexity.png")

    Args:
        checkpoint_dir: the checkpoint directory (full or LoRA adapter).
        data: what to route (a `--data` value: a text/JSONL file, a dataset, or "embedded" for the
            shipped eval text).
        devices: D (default: the `num_devices` the checkpoint records).
        max_tokens, seq_len, batch_size: how much data, in which shape.

    Raises:
        ValueError: the directory is missing, or neither it nor `devices` gives D.
    """

    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path):
        raise ValueError(
            f"checkpoint directory {path!r} does not exist; pass the folder written by save/train"
        )
    if devices is not None and (not isinstance(devices, int) or devices < 1):
        raise ValueError(f"devices={devices!r} must be a positive int (the expert-parallel size)")
    summary = describe_checkpoint(path)
    block = summary.block
    devices = devices or (block.num_devices if block is not None else None)
    if not devices:
        raise ValueError(
            f"checkpoint {path!r} records no num_devices; pass devices=D (the expert-parallel size)"
        )
    model = from_pretrained(path)
    tokenizer = load_tokenizer(path, summary.base_model)
    batches = data_batches(tokenizer, data, seq_len, batch_size, max_tokens)
    profile = profile_model(model, batches, model_name=path, max_tokens=max_tokens, progress=False)
    num_experts = find_moe_layers(model)[0].num_experts
    report = routing_report(
        profile.topk_ids(), contiguous_expert_device(num_experts, int(devices)), int(devices), num_experts
    )
    pruning = block.pruning if block is not None and summary.pruned else None
    report.extra["model"] = os.path.basename(os.path.abspath(path))
    report.extra["max_devices_per_token"] = pruning.max_devices_per_token if pruning else None
    report.extra["max_nodes_per_token"] = pruning.max_nodes_per_token if pruning else None
    report.extra["criterion"] = pruning.criterion if pruning else None
    return report


FIGURE_NAME = "comm_complexity.png"
"""File name of the comm_complexity figure a model card shows."""


def make_comm_complexity_figure(
    checkpoint_dir: str | os.PathLike, data: Any = "embedded", max_tokens: int = 2048
) -> str:
    """Measure the checkpoint's routing on `data` (`evaluation.measure_checkpoint`) and write its
    comm_complexity figure into the directory (`comm_complexity.png`), for the card; returns the PNG's path."""

    report = measure_checkpoint(checkpoint_dir, data=data, max_tokens=max_tokens)
    path = os.path.join(os.fspath(checkpoint_dir), FIGURE_NAME)
    comm_complexity_figure(report, path)
    return path
