"""The generation benchmark: expert-parallel prefill and decode of occult_ft and transformers' native EP.

`run_generate_bench(settings)` prepares, from the embedded OLMoE (trained routers), the checkpoints the
contenders load: the model placed for D devices (occult placement from a router profile on its corpus),
and the same placement pruned to 2 and 1 devices per token (criterion `score`); then, in `rounds`
rounds whose order rotates (round r starts r places later, odd rounds run backwards), launches each
contender on D processes (`torchrun`, `occult_ft.bench.generate_worker`; with `link_rate` inside the
emulated cluster of `occult_ft.bench.cluster`, built once and torn down at the end). Every rank
greedily generates `new_tokens` tokens (`min_new_tokens` = `max_new_tokens`, so every rank makes the
same forward calls) for its own `batch` prompts of `prompt_len` tokens of the corpus, `warmup + iters`
times. Contenders (`GENERATE_CONTENDERS`):

    occult_ep              the placed checkpoint, `occult_ft.from_pretrained(expert_parallel_size=D)`:
                           flat (de-duplicated) exchange, exact for prefill, capacity-bounded for decode
    occult_ep_budget2 / 1  the pruned checkpoints, the same way
    occult_ep_per_expert   the placed checkpoint, one row per (token, expert) through occult_ft's exchange
    hf_native_ep           the embedded model loaded with transformers' `DistributedConfig(ep_size=D)`

and `occult_ep[_per_expert|_two_stage][_budgetM][_exact]` (`_exact`: decode steps exact too). Per
contender:

    prefill_tokens_per_s   D x batch x prompt_len / median prefill forward (a forward ends when its
                           slowest rank does)
    decode_ms_per_token    median decode forward, ms: one new token for every sequence of every rank
    prefill_vs_per_expert / decode_vs_per_expert
                           prefill tokens/s over occult_ep_per_expert's; its decode ms over ours
    tokens_match           whether rank 0's generated tokens equal those of the contender that must
                           give them (`same_tokens_as`: the unpruned checkpoint for every contender
                           without a budget); pruned contenders route otherwise and are not compared

Shape legend: D processes (= expert-parallel size), B sequences per rank, P prompt tokens.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..apply import placed_copy
from ..checkpoint import save_pruned
from ..checks import check_positive_int
from ..embedded import embedded_data_path, embedded_model_path
from ..fileio import read_text
from ..layout import ExpertLayout
from ..placement import compute_placement
from ..profiling import profile_model
from ..routing import PruningConfig
from .cluster import EmulatedCluster, parse_rate
from .launch import launch_workers

__all__ = [
    "GENERATE_CONTENDERS",
    "GenerateSettings",
    "generate_contender",
    "default_contenders",
    "run_generate_bench",
    "format_generate_report",
]

GENERATE_CONTENDERS = (
    "occult_ep",
    "occult_ep_budget2",
    "occult_ep_budget1",
    "occult_ep_per_expert",
    "hf_native_ep",
)
_OCCULT = re.compile(r"^occult_ep((?:_per_expert|_two_stage|_budget\d+|_exact)*)$")


@dataclass(frozen=True)
class GenerateSettings:
    """The measurement (the model is the embedded OLMoE: 32 experts top-4, hidden 128, 4 layers).

    Args:
        devices: D processes (the expert-parallel size). nodes: N nodes they are read as (two-stage
            contenders; with `link_rate`, the emulated cluster's nodes).
        link_rate: run in an emulated cluster whose links have this tc rate (e.g. "1gbit"); None: the
            host's own loopback.
        batch: sequences per rank. prompt_len: prompt tokens per sequence. new_tokens: generated per sequence.
        iters / warmup / rounds: timed generate calls per launch, untimed ones first, rounds of all
            contenders.
        device: "cpu", "cuda" or "auto" (CUDA with one GPU per process when present).
        threads: torch threads per process. seed: placement profile order. timeout_s: per launch.
    """

    devices: int = 4
    nodes: int = 1
    link_rate: str | None = None
    batch: int = 4
    prompt_len: int = 128
    new_tokens: int = 16
    iters: int = 3
    warmup: int = 1
    rounds: int = 2
    device: str = "auto"
    threads: int = 1
    seed: int = 0
    timeout_s: float = 1800.0

    def __post_init__(self):
        for name in ("devices", "nodes", "batch", "prompt_len", "new_tokens", "iters", "rounds", "threads"):
            check_positive_int(name, getattr(self, name))
        if self.devices < 2:
            raise ValueError(f"devices={self.devices} must be at least 2 (expert-parallel processes)")
        ExpertLayout(32, self.devices, self.nodes)  # the embedded model's 32 experts
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens={self.new_tokens} must be at least 2 (a prefill and a decode step)")
        if self.prompt_len + self.new_tokens > 512:
            raise ValueError(
                f"prompt_len + new_tokens = {self.prompt_len + self.new_tokens} exceeds the embedded model's "
                "512 positions"
            )
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if self.link_rate is not None:
            parse_rate(self.link_rate)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: use auto, cpu or cuda")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return (
                "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= self.devices else "cpu"
            )
        return self.device


def generate_contender(name: str, settings: GenerateSettings) -> dict:
    """What contender `name` runs (module docstring); a one-line ValueError for an unknown name."""
    if name == "hf_native_ep":
        return {"name": name, "kind": name, "ours": False, "checkpoint": "original"}
    match = _OCCULT.match(name)
    if not match:
        raise ValueError(
            f"unknown contender {name!r}; choose from {', '.join(GENERATE_CONTENDERS)} or "
            "occult_ep[_per_expert|_two_stage][_budgetM][_exact]"
        )
    parts = match.group(1)
    spec: dict[str, Any] = {"name": name, "kind": "occult_ep", "exchange": "flat", "capacity": "auto"}
    if "_per_expert" in parts:
        spec["exchange"], spec["capacity"] = "per_expert", None
    if "_two_stage" in parts:
        if settings.nodes < 2:
            raise ValueError(f"{name} needs nodes > 1 (got nodes={settings.nodes}); pass --nodes 2")
        spec["exchange"], spec["capacity"] = "two_stage", None
    if "_exact" in parts:
        spec["capacity"] = None
    budget = re.search(r"_budget(\d+)", parts)
    spec["checkpoint"] = "placed"
    if budget:
        m = int(budget.group(1))
        if not 1 <= m < settings.devices:
            raise ValueError(
                f"{name}: a budget of {m} devices must be between 1 and devices - 1 = {settings.devices - 1}"
            )
        spec["max_devices_per_token"] = m
        spec["checkpoint"] = f"budget{m}"
    spec["ours"] = spec["exchange"] != "per_expert"
    return spec


def default_contenders(settings: GenerateSettings) -> list[str]:
    """`GENERATE_CONTENDERS` less the budgets that do not restrict D devices (budget 2 on 2 devices)."""
    return [
        n
        for n in GENERATE_CONTENDERS
        if not (m := re.search(r"_budget(\d+)$", n)) or int(m.group(1)) < settings.devices
    ]


def _corpus_rows(rows: int, seq_len: int, tokenizer) -> torch.Tensor:
    """(rows, seq_len) consecutive token windows of the embedded training corpus."""
    ids: list[int] = []
    for doc in read_text(embedded_data_path("train")).split("\n\n"):
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= rows * seq_len:
            break
    if len(ids) < rows * seq_len:
        raise ValueError(f"the embedded corpus holds {len(ids)} tokens < {rows * seq_len} the prompts need")
    return torch.tensor(ids[: rows * seq_len]).reshape(rows, seq_len)


def _prepare(settings: GenerateSettings, specs: dict[str, dict], tmp: str) -> tuple[dict[str, str], str]:
    """The checkpoints the contenders load ({"original", "placed", "budgetM"} -> directory) and the
    prompts file ((D x B, P) token ids; rank r takes rows [r * B, (r + 1) * B))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    model = AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
    prompts = _corpus_rows(settings.devices * settings.batch, settings.prompt_len, tokenizer)
    prompts_path = os.path.join(tmp, "prompts.pt")
    torch.save(prompts, prompts_path)
    dirs = {"original": embedded_model_path()}
    wanted = {s["checkpoint"] for s in specs.values()} - {"original"}
    if not wanted:
        return dirs, prompts_path
    profile_rows = _corpus_rows(64, 128, tokenizer)
    batches = [{"input_ids": profile_rows[i : i + 8]} for i in range(0, profile_rows.shape[0], 8)]
    profile = profile_model(model, batches, "embedded", progress=False)
    placement = compute_placement(profile, settings.devices, settings.nodes, algorithm="occult")
    for name in sorted(wanted):
        budget = int(name[len("budget") :]) if name.startswith("budget") else None
        pruning = PruningConfig(settings.devices, budget, "score") if budget is not None else None
        placed = placed_copy(model, placement, pruning)
        dirs[name] = save_pruned(placed, os.path.join(tmp, name), tokenizer, placement=placement)
    return dirs, prompts_path


def _launch(settings, contender: dict, checkpoint: str, prompts: str, tmp: str, cluster) -> dict:
    """One contender on D processes (in `cluster` when given): the per-rank results, or {"error": why}."""
    out = tempfile.mkdtemp(prefix=f"{contender['name']}-", dir=tmp)
    spec = {
        **asdict(settings),
        "device": settings.resolved_device(),
        "contender": contender,
        "checkpoint": checkpoint,
        "prompts": prompts,
    }
    module = "occult_ft.bench.generate_worker"
    return launch_workers(module, spec, out, settings.devices, settings.threads, settings.timeout_s, cluster)


def _summarise(runs: list[dict], settings: GenerateSettings) -> dict:
    """One contender's launches -> median prefill and decode forward times (slowest rank of each)."""
    prefill, decode = [], []
    for run in runs:
        ranks = run["ranks"]
        for call in range(settings.warmup, settings.warmup + settings.iters):
            per_rank = [r["forwards"][call] for r in ranks]
            steps = min(len(f) for f in per_rank)
            prefill.append(max(f[0] for f in per_rank))
            decode += [max(f[i] for f in per_rank) for i in range(1, steps)]
    median_prefill = statistics.median(prefill)
    return {
        "prefill_s": median_prefill,
        "prefill_tokens_per_s": settings.devices * settings.batch * settings.prompt_len / median_prefill,
        "decode_ms_per_token": 1000.0 * statistics.median(decode),
        "prefill_s_runs": [round(s, 5) for s in prefill],
        "decode_ms_quartiles": [1000.0 * statistics.quantiles(decode, n=4)[i] for i in (0, 2)]
        if len(decode) > 1
        else None,
        "tokens": runs[0]["ranks"][0]["tokens"],
        "syncs_per_decode_layer": runs[0]["ranks"][0].get("syncs_per_decode_layer"),
    }


def _compare(rows: list[dict]) -> None:
    measured = {r["contender"]: r for r in rows if r["measured"]}
    per_expert = measured.get("occult_ep_per_expert")
    reference = next(
        (
            r
            for r in measured.values()
            if r["checkpoint"] != "original" and "max_devices_per_token" not in r and r["ours"]
        ),
        None,
    )
    for row in measured.values():
        if per_expert is not None:
            row["prefill_vs_per_expert"] = row["prefill_tokens_per_s"] / per_expert["prefill_tokens_per_s"]
            row["decode_vs_per_expert"] = per_expert["decode_ms_per_token"] / row["decode_ms_per_token"]
        if "max_devices_per_token" not in row and reference is not None:
            row["same_tokens_as"] = reference["contender"]
            row["tokens_match"] = row["tokens"] == reference["tokens"]


def run_generate_bench(
    settings: GenerateSettings, contenders=None, progress=None, workdir: str | None = None
) -> dict:
    """Measure `contenders` (default `GENERATE_CONTENDERS`) and return the report (module docstring).

    Args:
        progress: optional callable(str) told about each phase and launch.
        workdir: keep the checkpoints and every launch's log there (default: a temporary directory,
            removed at the end).
    """
    names = list(contenders or default_contenders(settings))
    specs = {n: generate_contender(n, settings) for n in names}
    results: dict[str, list[dict]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    emulated = (
        EmulatedCluster(settings.nodes, settings.devices // settings.nodes, settings.link_rate)
        if settings.link_rate is not None
        else None
    )
    tmp = tempfile.mkdtemp(prefix="occult-generate-") if workdir is None else workdir
    os.makedirs(tmp, exist_ok=True)
    try:
        if progress:
            progress("preparing the placed and pruned checkpoints of the embedded model")
        dirs, prompts = _prepare(settings, specs, tmp)
        with emulated if emulated is not None else contextlib.nullcontext():
            for r in range(settings.rounds):
                shift = r % len(names)
                order = names[shift:] + names[:shift]
                if r % 2:
                    order.reverse()
                for name in (n for n in order if n not in errors):
                    if progress:
                        progress(f"round {r + 1}/{settings.rounds}: {name}")
                    got = _launch(
                        settings, specs[name], dirs[specs[name]["checkpoint"]], prompts, tmp, emulated
                    )
                    if "error" in got:
                        errors[name] = got["error"]
                    else:
                        results[name].append(got)
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for name in names:
        info = {k: v for k, v in specs[name].items() if k != "name"}
        if name in errors or not results[name]:
            rows.append({"contender": name, **info, "measured": False, "reason": errors.get(name, "no run")})
        else:
            rows.append({"contender": name, **info, **_summarise(results[name], settings), "measured": True})
    _compare(rows)
    return {
        "settings": asdict(settings),
        "model": "the embedded OLMoE (32 experts top-4, hidden 128, 4 layers), float32",
        "device": settings.resolved_device(),
        "network": emulated.describe() if emulated is not None else "the host's loopback (unshaped)",
        "contenders": rows,
        "notes": _notes(settings),
    }


def _notes(settings: GenerateSettings) -> list[str]:
    notes = [
        "occult_ep contenders: occult_ft.from_pretrained(DIR, expert_parallel_size=D), placement occult "
        "from a router profile of the corpus, budgets pruned with criterion score",
        "hf_native_ep: AutoModelForCausalLM.from_pretrained(embedded, distributed_config="
        "DistributedConfig(fsdp_size=D, ep_size=D, ep_implementation='all_to_all')): FSDP2 gathers the dense "
        "weights in every forward, which transformers needs for its EP",
        "greedy generate, min_new_tokens = max_new_tokens, each rank its own prompts; times per forward "
        "(hooks on the model), the slowest rank of each forward, medians over all launches",
    ]
    if settings.resolved_device() == "cpu" and settings.link_rate is None:
        notes.append(
            "one host's loopback over gloo is not a network: transfer is memory copies; pass --link-rate "
            "for the communication-bound setting"
        )
    return notes


def format_generate_report(report: dict) -> str:
    """The report as text: the setting, one row per contender, notes."""
    s = report["settings"]
    lines = [
        f"generate: {report['model']}, {s['devices']} processes ({report['device']}), {s['batch']} prompts "
        f"of {s['prompt_len']} tokens per rank, {s['new_tokens']} new tokens, {s['rounds']} rounds x "
        f"{s['iters']} generate calls after {s['warmup']} warm-up",
        f"network: {report['network']}",
        "",
        f"{'contender':<26} {'prefill tok/s':>13} {'vs per-expert':>13} {'decode ms/tok':>13} "
        f"{'vs per-expert':>13} {'tokens':>8}",
    ]
    for r in report["contenders"]:
        if not r["measured"]:
            lines.append(f"{r['contender']:<26} not measured: {r['reason']}")
            continue
        pv, dv = r.get("prefill_vs_per_expert"), r.get("decode_vs_per_expert")
        match = r.get("tokens_match")
        tokens = "pruned" if match is None else ("same" if match else "DIFFER")
        lines.append(
            f"{r['contender']:<26} {r['prefill_tokens_per_s']:>13.0f} {'-' if pv is None else f'{pv:.2f}x':>13} "
            f"{r['decode_ms_per_token']:>13.2f} {'-' if dv is None else f'{dv:.2f}x':>13} {tokens:>8}"
        )
    lines.append("")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)
