"""The quality study on a task where fine-tuning matters (`occult-ft study --task months`).

On held-out embedded text, standard fine-tuning barely moves the loss, so "pruned fine-tuning keeps its
quality" cannot fail there. This study uses a synthetic instruction task of `occult_ft.studies.tasks` instead
(the base model never saw instruction rows): response-only loss and exact match on held-out rows, for

    base model | standard fine-tuning | per budget M and criterion: zero-shot pruning, pruned
    fine-tuning | per budget M: pruned fine-tuning distilled from the unpruned model (`distill_coef`)

every fine-tuning repeated over several seeds (the seed orders the training batches; rows, placement
and similarity tables are the same). Each row reports mean +- sample standard deviation over seeds of
the loss, exact match, `comm_complexity` and removed router mass, and the share of standard
fine-tuning's gain it keeps, per seed against the standard run of the same seed:

    gain kept (loss) = (L_base - L_run) / (L_base - L_standard)
    gain kept (EM)   = (EM_run - EM_base) / (EM_standard - EM_base)

A difference between two rows is called real when the mean of its per-seed (paired) differences lies
outside the 95% interval of a paired t test, |mean| > t_(0.975, n-1) * sd / sqrt(n); with one seed
nothing is called real.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..apply import placed_copy
from ..checkpoint.load import load_model_and_tokenizer
from ..evaluation import data_batches, evaluate_model
from ..fileio import atomic_write_text
from ..placement import compute_placement
from ..profiling import profile_model
from ..routing import PruningConfig
from .finetune import finetune_embedded, results_dir
from .tasks import exact_match, task_split

__all__ = [
    "TASK_SETTINGS",
    "run_task_study",
    "finetuning_plan",
    "summarize_runs",
    "format_task_table",
    "paired_difference",
    "merge_results",
]

# sizes that fit 2 shared CPU cores (about a minute per fine-tuning); the CLI flags override them
TASK_SETTINGS: dict[str, Any] = {
    "steps": 150,
    "batch_size": 8,
    "seq_len": 48,
    "learning_rate": 3e-3,
    "profile_tokens": 16384,
    "train_rows": 4000,
    "eval_rows": 256,
}
# two-sided 95% Student t quantiles by degrees of freedom (n - 1); above 10, 1.96 (normal)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_difference(a: list[float], b: list[float]) -> dict:
    """Mean and sample sd of a[i] - b[i] and whether the mean is outside the paired-t 95% interval."""
    if len(a) != len(b) or not a:
        raise ValueError(
            f"paired_difference needs two equally long non-empty lists, got {len(a)} and {len(b)}"
        )
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    sd = statistics.stdev(d) if n > 1 else 0.0
    real = n > 1 and abs(mean) > _T975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "n": n, "real": bool(real)}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return sum(values) / len(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _task_batches(tokenizer, rows, seq_len: int, batch_size: int = 64, response_only: bool = True):
    from datasets import Dataset

    return data_batches(tokenizer, Dataset.from_list(rows), seq_len, batch_size, response_only=response_only)


def _measure(model, batches, devices: int) -> dict:
    r = evaluate_model(model, batches, devices)
    out = {k: r[k] for k in ("loss", "comm_complexity", "removed_mass")}
    out["exact_match"] = exact_match(model, batches)
    return out


def summarize_runs(runs: list[dict], standard: str = "standard fine-tuning") -> list[dict]:
    """One row per setting (in first-seen order) from per-seed runs: mean and sd of each metric, gain
    kept per seed against `standard`, and the paired difference of the loss to `standard` and, for
    distilled rows, to the undistilled run of the same budget and criterion."""
    settings: dict[str, list[dict]] = {}
    for r in runs:
        settings.setdefault(r["setting"], []).append(r)
    base = settings["base model"][0]
    std = {r["seed"]: r for r in settings[standard]}
    seeds = sorted(std)

    def per_seed(name: str, key: str) -> list[float]:
        rs = settings[name]
        by_seed = {r["seed"]: r[key] for r in rs}
        return [by_seed.get(s, rs[0][key]) for s in seeds]  # seed-independent rows repeat

    rows = []
    for name, rs in settings.items():
        first = rs[0]
        row = {k: first.get(k) for k in ("setting", "kind", "budget", "criterion", "distill_coef")}
        row["seeds"] = sorted({r["seed"] for r in rs if r["seed"] is not None})
        for key in ("loss", "exact_match", "comm_complexity", "removed_mass"):
            row[key], row[f"{key}_sd"] = _mean_sd([r[key] for r in rs])
        loss, em = per_seed(name, "loss"), per_seed(name, "exact_match")
        std_loss, std_em = per_seed(standard, "loss"), per_seed(standard, "exact_match")
        kept = [(base["loss"] - x) / (base["loss"] - s) for x, s in zip(loss, std_loss)]
        row["gain_kept"], row["gain_kept_sd"] = _mean_sd(kept)
        if all(s != base["exact_match"] for s in std_em):
            kept_em = [(x - base["exact_match"]) / (s - base["exact_match"]) for x, s in zip(em, std_em)]
            row["em_kept"], row["em_kept_sd"] = _mean_sd(kept_em)
        if first["kind"] in ("pruned", "distilled"):
            row["vs_standard"] = paired_difference(loss, std_loss)
            row["em_vs_standard"] = paired_difference(em, std_em)
        if first["kind"] == "distilled":
            plain = f"prune to {first['budget']}, {first['criterion']}, fine-tuned"
            if plain in settings:
                row["vs_undistilled"] = paired_difference(loss, per_seed(plain, "loss"))
                row["em_vs_undistilled"] = paired_difference(em, per_seed(plain, "exact_match"))
        rows.append(row)
    return rows


def _pm(mean: float, sd: float, fmt: str, seeds: int) -> str:
    return fmt.format(mean) + (f" ± {fmt.format(sd)}" if seeds > 1 else "")


def _diff(d: dict | None, fmt: str) -> str:
    if d is None:
        return ""
    return f"{fmt.format(d['mean'])} ± {fmt.replace('+', '').format(d['sd'])}" + (
        " (real)" if d["real"] else ""
    )


def format_task_table(result: dict) -> str:
    """The study's Markdown table: mean ± sd over seeds of every setting, gain kept and paired differences."""
    n = len(result["seeds"])
    head = (
        "| setting | loss | exact match | comm_complexity | removed mass | gain kept (loss) | gain kept (EM) "
        "| Δ loss vs standard | Δ EM vs standard | Δ loss vs undistilled |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in result["summary"]:
        seeds = len(r["seeds"]) or 1
        cells = [
            r["setting"],
            _pm(r["loss"], r["loss_sd"], "{:.4f}", seeds),
            _pm(r["exact_match"], r["exact_match_sd"], "{:.3f}", seeds),
            _pm(r["comm_complexity"], r["comm_complexity_sd"], "{:.3f}", seeds),
            _pm(r["removed_mass"], r["removed_mass_sd"], "{:.3f}", seeds),
            _pm(r["gain_kept"], r["gain_kept_sd"], "{:.1%}", n),
            _pm(r["em_kept"], r["em_kept_sd"], "{:.1%}", n) if "em_kept" in r else "",
            _diff(r.get("vs_standard"), "{:+.4f}"),
            _diff(r.get("em_vs_standard"), "{:+.3f}"),
            _diff(r.get("vs_undistilled"), "{:+.4f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge_results(*results: dict) -> dict:
    """One study result from runs of the same study over different seeds (e.g. parallel processes).

    The seed-independent rows (base model, zero-shot pruning) are taken from the first result; every
    fine-tuning run of every result is kept. Raises ValueError when the results differ in task or
    settings (other than output_dir) or share a seed.
    """
    if not results:
        raise ValueError("merge_results needs at least one study result")
    first = results[0]

    def same(r: dict) -> tuple:
        settings = {k: v for k, v in r["settings"].items() if k != "output_dir"}
        return (
            r["task"],
            json.dumps(settings, sort_keys=True),
            r["train_rows"],
            r["eval_rows"],
            r["distill_coef"],
        )

    seeds: list[int] = []
    for r in results:
        if same(r) != same(first):
            raise ValueError(f"study results differ in task or settings: {same(r)} vs {same(first)}")
        if set(r["seeds"]) & set(seeds):
            raise ValueError(
                f"seeds {sorted(set(r['seeds']) & set(seeds))} appear in two results; merge disjoint seeds"
            )
        seeds += r["seeds"]
    runs = [run for run in first["runs"] if run["seed"] is None]
    runs += [run for r in results for run in r["runs"] if run["seed"] is not None]
    merged = {**first, "seeds": seeds, "runs": runs, "summary": summarize_runs(runs)}
    merged["wall_seconds"] = sum(r["wall_seconds"] for r in results)  # summed over processes
    return merged


def finetuning_plan(budgets, criteria, distill_criterion: str, distill_coef: float, distill_budgets=None):
    """The fine-tunings of one seed, in order: (setting, kind, budget, criterion, distill_coef) for the
    standard (unpruned) run, every budget x criterion pruned, then the distilled runs (`distill_coef` > 0;
    `distill_budgets`, default `budgets`, with `distill_criterion`)."""
    plan = [("standard fine-tuning", "standard", None, "score", 0.0)]
    plan += [(f"prune to {m}, {c}, fine-tuned", "pruned", m, c, 0.0) for m in budgets for c in criteria]
    if distill_coef > 0:
        name = f"{distill_criterion}, distilled ({distill_coef:g})"
        plan += [
            (f"prune to {m}, {name}", "distilled", m, distill_criterion, distill_coef)
            for m in (budgets if distill_budgets is None else distill_budgets)
        ]
    return plan


def run_task_study(
    settings,
    task: str = "months",
    seeds=(0, 1, 2),
    budgets=(1, 2, 3),
    criteria=("score", "similarity"),
    distill_coef: float = 1.0,
    distill_budgets=None,
    train_mode: str = "full",
    train_rows: int = TASK_SETTINGS["train_rows"],
    eval_rows: int = TASK_SETTINGS["eval_rows"],
    verbose: bool = True,
) -> dict:
    """Run the task study (see the module docstring); writes `study_<task>_results.json` and returns it.

    Args:
        settings: a `occult_ft.studies.demo.DemoSettings` (devices, steps, batch_size, seq_len, learning_rate,
            profile_tokens, output_dir; `criterion` is the criterion of the distilled runs).
        task: one of `occult_ft.studies.tasks.TASKS`.
        seeds: training seeds; every fine-tuning runs once per seed.
        budgets / criteria: the pruned settings (zero-shot and fine-tuned).
        distill_coef: `OccultConfig.distill_coef` of the distilled rows; 0 leaves them out.
        distill_budgets: budgets of the distilled rows (default: `budgets`).
        train_mode: `OccultConfig.train_mode` of every fine-tuning. `full` by default: with the MoE blocks
            only (`moe`, the text study's setting) attention stays frozen and cannot learn to find the
            month digits; 100 such steps reached a response loss of 1.13 and no exact answer.
        train_rows / eval_rows: rows of the task for training and for the held-out measurement.
    """

    s = settings
    seeds = _checked_seeds(s, seeds, (*budgets, *(distill_budgets or ())), distill_coef)
    say = print if verbose else (lambda *a, **k: None)
    start = time.perf_counter()
    results_dir(s)
    setup = _TaskSetup.build(s, task, train_rows, eval_rows)
    runs = _RunLog(say)
    say(
        f"task {task!r}: {len(setup.train)} training rows, {len(setup.held_out)} held-out rows, seeds {seeds}"
    )
    runs.record("base model", "base", None, setup.measure(placed_copy(setup.model, setup.placement)))
    for m in budgets:
        for crit in criteria:
            pruned = placed_copy(setup.model, setup.placement, PruningConfig(s.devices, m, crit), setup.sim)
            runs.record(
                f"prune to {m}, {crit}, no fine-tuning", "zero-shot", None, setup.measure(pruned), m, crit
            )
    plan = finetuning_plan(budgets, criteria, s.criterion, distill_coef, distill_budgets)
    results_path = os.path.join(s.output_dir, f"study_{task}_results.json")
    for done, seed in enumerate(seeds):
        for setting, kind, m, crit, coef in plan:
            run_dir = os.path.join(s.output_dir, "runs", f"{kind}-{m}-{crit}-seed{seed}")
            trainer, run = finetune_embedded(
                s, setup.placement_path, run_dir, m, crit,
                dataset=setup.data_path, seed=seed, distill_coef=coef, train_mode=train_mode,
            )  # fmt: skip
            measured = setup.measure(trainer.model)
            runs.record(setting, kind, seed, measured, m, crit, coef, run["train_seconds"])
            del trainer
        out = {  # written after every seed: a cut-short study keeps its seeds
            "task": task,
            "settings": asdict(s),
            "seeds": seeds[: done + 1],
            "train_rows": len(setup.train),
            "eval_rows": len(setup.held_out),
            "distill_coef": distill_coef,
            "train_mode": train_mode,
            "runs": runs.rows,
            "summary": summarize_runs(runs.rows),
            "wall_seconds": time.perf_counter() - start,
        }
        atomic_write_text(results_path, json.dumps(out, indent=1))
    say(
        f"\nQuality study, task {task!r}: {s.devices} devices, {s.steps} steps per fine-tuning, seeds {seeds}"
    )
    say(format_task_table(out))
    say(f"\nwall time: {out['wall_seconds']:.0f} s")
    return out


def _checked_seeds(s, seeds, budgets, distill_coef: float) -> list[int]:
    """The distinct seeds in order, once every budget and `distill_coef` is known to be valid (before
    anything loads or is written)."""
    out = list(dict.fromkeys(int(x) for x in seeds))
    if not out:
        raise ValueError("seeds is empty; pass at least one seed, e.g. seeds=(0, 1, 2)")
    for m in budgets:
        PruningConfig(s.devices, m, s.criterion)
    if not distill_coef >= 0:
        raise ValueError(f"distill_coef={distill_coef!r} must be >= 0 (0 leaves the distilled rows out)")
    return out


@dataclass
class _TaskSetup:
    """What every row of a task study shares: the task's rows (its training rows also written as the
    fine-tuning dataset), the embedded model, its `search` placement (profiled on the training rows,
    saved for the fine-tunings) and the held-out batches every row is measured on."""

    settings: Any
    train: list[dict]
    held_out: list[dict]
    data_path: str
    model: Any
    placement: Any
    placement_path: str
    sim: Any
    eval_batches: list

    @classmethod
    def build(cls, s, task: str, train_rows: int, eval_rows: int) -> _TaskSetup:
        train, held_out = task_split(task, train_rows, eval_rows)
        data_path = os.path.join(s.output_dir, f"{task}-train.jsonl")
        atomic_write_text(data_path, "".join(json.dumps(r) + "\n" for r in train))
        model, tokenizer = load_model_and_tokenizer("embedded")
        model.eval()
        prof_batches = _task_batches(tokenizer, train, s.seq_len, 16, response_only=False)
        profile = profile_model(
            model, prof_batches, model_name="embedded", max_tokens=s.profile_tokens, progress=False
        )
        placement = compute_placement(profile, s.devices, algorithm="search")
        placement_path = os.path.join(s.output_dir, "placement-search.json")
        placement.save(placement_path)
        sim = profile.similarity()  # original expert order: placed_copy reorders it
        eval_batches = _task_batches(tokenizer, held_out, s.seq_len)
        return cls(s, train, held_out, data_path, model, placement, placement_path, sim, eval_batches)

    def measure(self, model) -> dict:
        return _measure(model, self.eval_batches, self.settings.devices)


class _RunLog:
    """The study's rows in the order they were measured, each printed as it is added."""

    def __init__(self, say):
        self.rows: list[dict] = []
        self._say = say

    def record(self, setting, kind, seed, measured, budget=None, criterion=None, coef=0.0, seconds=None):
        self.rows.append(
            {
                "setting": setting,
                "kind": kind,
                "seed": seed,
                "budget": budget,
                "criterion": criterion,
                "distill_coef": coef,
                **measured,
                "train_seconds": seconds,
            }
        )
        self._say(
            f"  {setting:<46} seed {'-' if seed is None else seed}: loss {measured['loss']:.4f}  "
            f"exact match {measured['exact_match']:.3f}  comm_complexity {measured['comm_complexity']:.3f}"
        )
