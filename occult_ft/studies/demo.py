"""The whole Occult pipeline on the embedded default model, and the quality study built from it.

`run_demo` (behind `occult-ft demo`, the README's main job): profile the shipped OLMoE base model on
the shipped corpus -> place its experts on D devices (sequential, the paper's greedy, our default)
-> prune to `max_devices_per_token` devices without training -> fine-tune with pruning
(`OccultTrainer`) -> evaluate on held-out text -> save the pruned checkpoint and reload it with
`occult_ft.from_pretrained`. It prints one summary table and returns the numbers.

`run_quality_study` (behind `occult-ft study`): on the same model and held-out text, eval loss and
`comm_complexity` for the base model, standard (unpruned) fine-tuning, zero-shot pruning and pruned
fine-tuning to 1 and 2 devices with the score and similarity criteria. With a task
(`occult-ft study --task months`) it runs the multi-seed study of `occult_ft.studies.task_study` instead.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from ..apply import placed_copy
from ..checkpoint.load import from_pretrained, load_model_and_tokenizer
from ..data import load_text_dataset, spread_rows
from ..evaluation import data_batches, evaluate_model
from ..fileio import atomic_write_text
from ..metrics import random_placement_comm_complexity, routing_report
from ..models import find_moe_layers
from ..placement import compute_placement
from ..profiling import profile_model
from ..routing import PruningConfig
from .finetune import DemoSettings, finetune_embedded, results_dir
from .task_study import run_task_study

__all__ = ["run_demo", "run_quality_study", "format_rows"]


def _eval_batches(tokenizer, s: DemoSettings):
    return data_batches(tokenizer, "embedded", s.seq_len, 16, s.eval_tokens)


def _evaluate(model, batches, devices: int, progress: bool = True) -> dict:
    r = evaluate_model(model, tqdm(batches, desc="evaluating", unit="batch", disable=not progress), devices)
    return {
        k: r[k]
        for k in ("loss", "perplexity", "comm_complexity", "intra_share", "removed_mass", "load_imbalance")
    }


def _prepare(s: DemoSettings):
    """Base model, eval batches, profile and the three placements (saved under output_dir)."""

    results_dir(s)
    torch.manual_seed(s.seed)
    model, tokenizer = load_model_and_tokenizer("embedded")
    model.eval()

    train_text = spread_rows(load_text_dataset("embedded", split="train"))  # every source, not the first
    prof_batches = data_batches(tokenizer, train_text, s.seq_len, 16, s.profile_tokens)
    profile = profile_model(
        model, prof_batches, model_name="embedded", max_tokens=s.profile_tokens, progress=s.progress
    )
    profile.save(os.path.join(s.output_dir, "profile.safetensors"))
    placements = {}
    for algo in tqdm(
        ("sequential", "occult", "search"), desc="placing", unit="algorithm", disable=not s.progress
    ):
        t = time.perf_counter()
        # no timed lower bound (3 s a layer each): the demo compares algorithms; `occult-ft place` proves gaps
        placements[algo] = compute_placement(profile, s.devices, algorithm=algo, bound_time_limit=0)
        placements[algo].metrics["seconds"] = time.perf_counter() - t
        placements[algo].save(os.path.join(s.output_dir, f"placement-{algo}.json"))
    return model, tokenizer, _eval_batches(tokenizer, s), profile, placements


def _placement_rows(model, eval_batches, placements, devices: int, progress: bool = True) -> list[dict]:
    """comm_complexity of the base model's held-out routing under each placement (exact: a permutation)."""

    routing = profile_model(model, eval_batches, progress=progress).topk_ids()
    layer = find_moe_layers(model)[0]
    e, k = layer.num_experts, layer.top_k
    rows = [
        {
            "setting": "random placement (expected)",
            "comm_complexity": random_placement_comm_complexity(e, k, devices),
        }
    ]
    for algo, pl in placements.items():
        rep = routing_report(routing, {i: pl.expert_device(i) for i in routing}, devices, e)
        rows.append(
            {
                "setting": f"placement: {algo}",
                "comm_complexity": rep.comm_complexity,
                "intra_share": rep.intra_share,
                "placement_seconds": pl.metrics["seconds"],
            }
        )
    return rows


def format_rows(rows: list[dict], title: str) -> str:
    cols = [
        ("loss", "eval loss", "{:.4f}"),
        ("comm_complexity", "comm_cx", "{:.3f}"),
        ("intra_share", "intra", "{:.3f}"),
        ("removed_mass", "removed", "{:.3f}"),
        ("train_tokens_per_second", "train tok/s", "{:.0f}"),
    ]
    width = max(len(r["setting"]) for r in rows) + 2
    lines = [title, f"{'setting':<{width}}" + "".join(f"{c[1]:>13}" for c in cols)]
    for r in rows:
        cells = "".join(f"{(c[2].format(r[c[0]]) if r.get(c[0]) is not None else '-'):>13}" for c in cols)
        lines.append(f"{r['setting']:<{width}}{cells}")
    return "\n".join(lines)


def run_demo(settings: DemoSettings | None = None, verbose: bool = True) -> dict:
    """Profile, place, prune, fine-tune, evaluate and save the embedded model; returns the results."""

    s = settings or DemoSettings()
    start = time.perf_counter()
    say = print if verbose else (lambda *a, **k: None)
    say(f"[1/5] profiling the embedded OLMoE and placing its experts on {s.devices} devices")
    model, tokenizer, eval_batches, profile, placements = _prepare(s)
    rows = _placement_rows(model, eval_batches, placements, s.devices, s.progress)
    say("[2/5] evaluating the base model")
    base = _evaluate(placed_copy(model, placements["search"]), eval_batches, s.devices, s.progress)
    rows.append({"setting": "base model (search placement)", **base})
    say(f"[3/5] pruning to {s.max_devices_per_token} devices per token without training ({s.criterion})")
    pruning = PruningConfig(s.devices, s.max_devices_per_token, s.criterion)
    sim = profile.similarity()  # original expert order: placed_copy reorders it
    zero = _evaluate(
        placed_copy(model, placements["search"], pruning, sim), eval_batches, s.devices, s.progress
    )
    rows.append({"setting": f"pruned to {s.max_devices_per_token}, no fine-tuning", **zero})
    say(f"[4/5] pruned fine-tuning: {s.steps} steps")
    out = os.path.join(s.output_dir, "model")
    trainer, run = finetune_embedded(
        s, os.path.join(s.output_dir, "placement-search.json"), out, s.max_devices_per_token, s.criterion
    )
    tuned = _evaluate(trainer.model, eval_batches, s.devices, s.progress)
    rows.append(
        {
            "setting": f"pruned to {s.max_devices_per_token}, fine-tuned",
            **tuned,
            "train_tokens_per_second": run["train_tokens_per_second"],
        }
    )
    say(f"[5/5] reloading {out} with occult_ft.from_pretrained")
    reloaded = _evaluate(from_pretrained(out), eval_batches, s.devices, s.progress)
    if (
        abs(reloaded["loss"] - tuned["loss"]) > 1e-4
        or abs(reloaded["comm_complexity"] - tuned["comm_complexity"]) > 1e-6
    ):
        raise RuntimeError(
            f"the saved checkpoint does not reproduce the trained model: {reloaded} vs {tuned}"
        )
    rows.append({"setting": "reloaded checkpoint", **reloaded})
    result = {
        "settings": asdict(s),
        "rows": rows,
        "checkpoint": out,
        "wall_seconds": time.perf_counter() - start,
        "log_history": run["log_history"],
    }
    atomic_write_text(os.path.join(s.output_dir, "demo_results.json"), json.dumps(result, indent=1))
    say(
        format_rows(
            rows,
            f"\nOccult demo: embedded OLMoE, {s.devices} devices, held-out eval ({s.eval_tokens} tokens)",
        )
    )
    say(
        f"\ncheckpoint: {out}  (occult_ft.from_pretrained('{out}'))   wall time: {result['wall_seconds']:.0f} s"
    )
    return result


def run_quality_study(
    settings: DemoSettings | None = None,
    budgets=(2, 1),
    criteria=("score", "similarity"),
    verbose: bool = True,
    task: str = "text",
    **task_options,
) -> dict:
    """Eval loss and comm_complexity for base, standard fine-tuning, zero-shot pruning and pruned
    fine-tuning (every budget x criterion), all on the search placement.

    `task="text"` (default) is the held-out embedded text; any task of `occult_ft.studies.tasks.TASKS` runs
    `occult_ft.studies.task_study.run_task_study` instead (budgets, criteria and `task_options` such as seeds and
    distill_coef passed on)."""

    if task != "text":
        return run_task_study(
            settings or DemoSettings(output_dir=f"occult-study-{task}"),
            task=task,
            budgets=budgets,
            criteria=criteria,
            verbose=verbose,
            **task_options,
        )
    if task_options:
        raise ValueError(f"{sorted(task_options)} apply to a study task, not to task='text'; pass task=")
    s = settings or DemoSettings(output_dir="occult-study")
    start = time.perf_counter()
    say = print if verbose else (lambda *a, **k: None)
    model, tokenizer, eval_batches, profile, placements = _prepare(s)
    rows = _placement_rows(model, eval_batches, placements, s.devices, s.progress)
    placement_path = os.path.join(s.output_dir, "placement-search.json")
    sim = profile.similarity()  # original expert order: placed_copy reorders it
    rows.append(
        {
            "setting": "base model",
            **_evaluate(placed_copy(model, placements["search"]), eval_batches, s.devices, s.progress),
        }
    )
    say("standard fine-tuning (no pruning)")
    rows.append(
        _finetuned_row(s, placement_path, "standard fine-tuning", "ft-unpruned", None, "score", eval_batches)
    )
    for m in budgets:
        for crit in criteria:
            pruning = PruningConfig(s.devices, m, crit)
            zero = _evaluate(
                placed_copy(model, placements["search"], pruning, sim), eval_batches, s.devices, s.progress
            )
            rows.append({"setting": f"prune to {m}, {crit}, no fine-tuning", **zero})
            say(f"pruned fine-tuning: {m} device(s), {crit}")
            setting = f"prune to {m}, {crit}, fine-tuned"
            rows.append(_finetuned_row(s, placement_path, setting, f"ft-{m}-{crit}", m, crit, eval_batches))
    result = {"settings": asdict(s), "rows": rows, "wall_seconds": time.perf_counter() - start}
    atomic_write_text(os.path.join(s.output_dir, "study_results.json"), json.dumps(result, indent=1))
    say(
        format_rows(
            rows, f"\nQuality study: embedded OLMoE, {s.devices} devices, {s.steps} steps per fine-tuning"
        )
    )
    say(f"\nwall time: {result['wall_seconds']:.0f} s")
    return result


def _finetuned_row(
    s: DemoSettings, placement_path: str, setting: str, run_name: str, budget, criterion: str, eval_batches
):
    """One fine-tuning of the study (`finetune_embedded` into output_dir/run_name; budget None: standard
    fine-tuning) and its row `setting`: the held-out figures and the training throughput."""
    trainer, run = finetune_embedded(
        s, placement_path, os.path.join(s.output_dir, run_name), budget, criterion
    )
    return {
        "setting": setting,
        **_evaluate(trainer.model, eval_batches, s.devices, s.progress),
        "train_tokens_per_second": run["train_tokens_per_second"],
    }
