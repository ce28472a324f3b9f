"""The train-step benchmark: whole training steps (forward, backward, optimizer) of the tools users
choose between, on the same model, data and global batch, side by side.

`run_train_step(settings)` saves one model (`settings.model`: "random", OLMoE-shaped and seeded, on
random tokens, DeepSeek-V3-shaped with `shared_experts`; or "embedded", the shipped OLMoE with trained
routers, on its own corpus, so that the routing is real and skewed) with `norm_topk_prob=True` (the gate convention every contender shares,
DeepSpeed's included) and the token rows of every step, then, in `rounds` rounds whose order rotates
(round r starts r places later and odd rounds run backwards), launches each contender on D processes
(`torchrun`, `occult_ft.bench.step_worker`) for `warmup + steps` optimizer steps of `grad_accum`
micro-batches each. With `link_rate` the D processes run in an emulated cluster
(`occult_ft.bench.cluster`: `nodes` network namespaces of D / nodes processes, links shaped to that
rate; one node: its loopback shaped), set up once and torn down at the end. Per contender it reports:

    tokens_per_s       global tokens per optimizer step / median step time (a step ends when its
                       slowest rank does)
    step_s / spread    median and [25th, 75th] percentile of the timed steps of all rounds
    vs_best_other      tokens_per_s / that of the fastest contender that is not occult_ft's de-duplicated EP
    split_ms           the step split, per step and mean over ranks: compute (everything else),
                       exposed_exchange (blocked in an exchange collective or its wait(), other ranks
                       already there), waiting (blocked in one before the last rank of its group issued
                       it: `step_report.waiting_by_rank`), dense_allreduce (gradient reductions inside backward),
                       other_collectives; with `exchange_share` = (exposed_exchange + waiting) / step
    phases_ms          finer, per step, mean over ranks: attention_dense (forward outside the MoE blocks),
                       router, exchange_fwd (+ _wait), local_experts_fwd (MoE blocks minus router and
                       exchange), backward_rest (the step minus forward and optimizer: backward, clipping,
                       data), exchange_bwd (+ _wait), dense_allreduce, other_collectives, optimizer
    peak_mb            peak memory per rank (CPU: what training added to the process's peak RSS, the
                       interpreter, torch and transformers excluded; CUDA: max allocated)
    losses / loss_vs_dp the global mean loss per step, and its largest difference from data parallel
    syncs_per_layer    host synchronisations inside one MoE block forward (`HostSyncCounter`)
    load_imbalance / comm_complexity   what `OccultTrainer` logged for the timed steps (occult_ep
                       contenders): max / mean tokens a device received and devices per token, mean over
                       micro-batches and MoE layers

Waiting and transfer are told apart from when each rank issued each exchange collective (one
machine, one clock); `barrier=True` instead puts a barrier before each exchange collective (the
barrier is the waiting), a diagnostic run whose step times include the barriers. Collectives that
torch runs from C++ (the autograd backward of functional collectives used by transformers' EP) are
not seen by the clock: they stay inside compute (and backward_rest).

`cost_model` predicts, from the routing of the same model on the first step's tokens, the exchange of
the same step (forward and backward) on a cluster shape (default 4 x 8 GPUs on InfiniBand, `4x8-ib`),
for the same global batch and for the same tokens per device (that routing repeated); only the
exchange is predicted.

Shape legend: D processes (= expert-parallel size), E experts, K top-k, T tokens per step, S sequence
length, B sequences per rank and step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..checks import check_positive_int
from ..dispatch import EXCHANGES
from ..embedded import embedded_data_path, embedded_model_path
from ..fileio import read_text
from ..layout import ExpertLayout
from ..models import find_moe_layers
from .cluster import EmulatedCluster, parse_rate
from .costmodel import (
    get_cluster,
    predict_exchange_ms,
    predict_two_stage_exchange_ms,
    pruned_topk,
    rows_matrix,
    two_stage_rows,
)
from .launch import launch_workers
from .step_report import compare_contenders, summarise_contender
from .step_worker import KINDS

__all__ = [
    "StepSettings",
    "Contender",
    "DEFAULT_CONTENDERS",
    "SHAPES",
    "contender_spec",
    "run_train_step",
]

SHAPES = {
    "olmoe32": dict(experts=32, top_k=4),
    "olmoe64": dict(experts=64, top_k=8),
    "embedded": dict(model="embedded"),
}
"""Model shapes: OLMoE-shaped random models (hidden 512, 8 layers) with 32 experts top-4 and 64 experts
top-8, and the embedded model (hidden 128, 4 layers, 32 experts top-4, trained routers)."""
MODELS = ("random", "embedded")

DEFAULT_CONTENDERS = (
    "data_parallel",
    "occult_ep",
    "occult_ep_budget2",
    "occult_ep_budget1",
    "occult_ep_per_expert",
    "hf_native_ep",
    "deepspeed_moe",
)


@dataclass(frozen=True)
class StepSettings:
    """The model, the step and the measurement.

    Args:
        hidden / layers / experts / top_k / expert_width / heads / vocab: the OLMoE-shaped model.
        shared_experts: above 0, this many shared experts (one shared MLP of shared_experts x
            expert_width) in every MoE block: the random model is then DeepSeek-V3-shaped (its block
            adds the shared MLP after the experts, which `exchange_overlap_shared` runs beside the
            combine; MLA attention). 0: none.
        model: "random" (that shape, seeded, random tokens) or "embedded" (the shipped model on its
            corpus; the shape fields are then taken from it by `run_train_step`).
        seq_len: S. micro_batch_tokens: global tokens per micro-batch (T = D x B x S).
        grad_accum: micro-batches per optimizer step (the dense gradients are reduced once per step).
        devices: D processes (expert-parallel size of the EP contenders, replicas of data parallel).
        nodes: N nodes the D processes are read as (the two-stage contender crosses them); with
            `link_rate`, the emulated cluster's nodes.
        link_rate: run in an emulated cluster whose links have this tc rate (e.g. "1gbit"); None: the
            host's own loopback.
        steps / warmup / rounds: timed steps, untimed steps first, rounds of all contenders.
        learning_rate: AdamW, constant. dtype: float32 (CPU) or bfloat16 (CUDA).
        device: "cpu", "cuda" or "auto" (CUDA with one GPU per process when present).
        barrier: the diagnostic mode (waiting vs transfer; see the module docstring).
        count_syncs: also count host synchronisations per MoE layer (one extra forward).
        threads: torch threads per process. seed: model and data. timeout_s: per launch.
    """

    hidden: int = 512
    layers: int = 8
    experts: int = 64
    top_k: int = 8
    expert_width: int = 256
    heads: int = 8
    vocab: int = 8192
    shared_experts: int = 0
    seq_len: int = 256
    micro_batch_tokens: int = 2048
    grad_accum: int = 4
    devices: int = 4
    nodes: int = 1
    link_rate: str | None = None
    model: str = "random"
    steps: int = 5
    warmup: int = 2
    rounds: int = 2
    learning_rate: float = 1e-4
    dtype: str = "float32"
    device: str = "auto"
    barrier: bool = False
    count_syncs: bool = True
    threads: int = 1
    seed: int = 0
    timeout_s: float = 3600.0

    def __post_init__(self):
        for name in ("hidden", "layers", "experts", "top_k", "expert_width", "heads", "vocab", "seq_len"):
            check_positive_int(name, getattr(self, name))
        if self.devices < 2:
            raise ValueError(f"devices={self.devices} must be at least 2 (processes of the step)")
        ExpertLayout(self.experts, self.devices, self.nodes)
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}; choose top_k <= experts")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}")
        per_step = self.devices * self.seq_len
        if self.micro_batch_tokens % per_step:
            raise ValueError(
                f"micro_batch_tokens={self.micro_batch_tokens} must be a multiple of devices x seq_len = "
                f"{per_step} (every rank trains whole sequences)"
            )
        self._check_run()

    def _check_run(self) -> None:
        """The step and the measurement: micro-batches, model, link rate, steps, dtype, device."""
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(
                f"grad_accum={self.grad_accum!r} must be a positive integer (micro-batches per step)"
            )
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: use {' or '.join(MODELS)}")
        shared = self.shared_experts
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"shared_experts={shared!r} must be a count >= 0 (0: no shared MLP)")
        if shared and self.model != "random":
            raise ValueError(
                f"shared_experts={shared} shapes the random model; the {self.model} model has its own blocks: drop it"
            )
        if self.link_rate is not None:
            parse_rate(self.link_rate)
        if self.steps < 1 or self.warmup < 0 or self.rounds < 1:
            raise ValueError(
                f"steps={self.steps}, warmup={self.warmup}, rounds={self.rounds}: need >= 1, >= 0, >= 1"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: use float32 or bfloat16")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: use auto, cpu or cuda")

    @property
    def batch_per_rank(self) -> int:
        """B, sequences per rank and micro-batch."""
        return self.micro_batch_tokens // (self.devices * self.seq_len)

    @property
    def tokens_per_step(self) -> int:
        """Global tokens per optimizer step (grad_accum micro-batches)."""
        return self.micro_batch_tokens * self.grad_accum

    def resolved_device(self) -> str:
        if self.device == "auto":
            return (
                "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= self.devices else "cpu"
            )
        return self.device


_GRAMMAR = "occult_ep[_per_expert|_two_stage][_budgetM][_chunksN][_overlap][_shared][_capacity][_embedding_ddp][_balanced]"
# name suffix of an occult_ep contender -> (field, value; int: the digits that follow the suffix)
_SUFFIXES: dict[str, tuple[str, Any]] = {
    "_per_expert": ("exchange", "per_expert"),
    "_two_stage": ("exchange", "two_stage"),
    "_budget": ("budget", int),
    "_chunks": ("chunks", int),
    "_overlap": ("overlap", True),
    "_shared": ("shared", True),
    "_capacity": ("capacity", True),
    "_embedding_ddp": ("embedding_ddp", True),
    "_balanced": ("balanced", True),
}
BALANCED_BIAS_RATE = 0.0007
"""`device_bias_rate` of a `_balanced` contender: the tiny recipe's (docs/device-balance.md)."""


@dataclass(frozen=True)
class Contender:
    """One tool of the train-step benchmark and how it runs.

    Args:
        kind: the runner (`KINDS`): data_parallel, occult_ep, hf_native_ep or deepspeed_moe.
        exchange / budget / chunks / overlap / capacity: occult_ep only: its exchange (`OccultConfig.exchange`),
            device budget M (`max_devices_per_token`), pipelined chunks (None: `OccultConfig`'s default), the own
            rows computed while the exchanges travel (`exchange_overlap_local`), and capacity-bounded buffers.
        shared: occult_ep only: the blocks' shared MLP run while the combine travels
            (`exchange_overlap_shared`; needs `StepSettings.shared_experts`).
        embedding_ddp: occult_ep only: the input embedding's gradient left to DDP, reduced after backward
            (`embedding_gradient_overlap=False`; the default reduces it apart, mostly during the last
            micro-batch).
        balanced: occult_ep with a budget only: the device bias (`device_bias_rate` BALANCED_BIAS_RATE),
            fitted on the first micro-batch (`device_bias_init="first_batch"`).
        name: the label in the report; default: the canonical name of the fields (`from_name` keeps
            the spelling the user gave). Not compared: two contenders with the same fields are equal.
    """

    kind: str = "occult_ep"
    exchange: str = "flat"
    budget: int | None = None
    chunks: int | None = None
    overlap: bool = False
    shared: bool = False
    capacity: bool = False
    embedding_ddp: bool = False
    balanced: bool = False
    name: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self._canonical_name())
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: use one of {', '.join(KINDS)}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r}: use one of {', '.join(EXCHANGES)}")
        options = (
            self.exchange != "flat",
            self.budget is not None,
            self.chunks is not None,
            self.overlap,
            self.shared,
            self.capacity,
            self.embedding_ddp,
            self.balanced,
        )
        if self.kind != "occult_ep" and any(options):
            raise ValueError(
                f"{self.kind} takes no exchange, budget, chunks, overlap, shared, capacity, embedding_ddp or "
                "balancing (occult_ep does)"
            )
        if self.balanced and self.budget is None:
            raise ValueError(
                f"{self.name}: the device bias balances a budget; add _budget2 (or 1) before _balanced"
            )
        for label, value in (("budget", self.budget), ("chunks", self.chunks)):
            if value is not None and value < 1:
                raise ValueError(f"{self.name}: {label}={value} must be at least 1")

    def _canonical_name(self) -> str:
        if self.kind != "occult_ep":
            return self.kind
        name = "occult_ep" + ("" if self.exchange == "flat" else f"_{self.exchange}")
        name += "" if self.budget is None else f"_budget{self.budget}"
        name += "" if self.chunks is None else f"_chunks{self.chunks}"
        name += "_overlap" if self.overlap else ""
        name += "_shared" if self.shared else ""
        name += "_capacity" if self.capacity else ""
        name += "_embedding_ddp" if self.embedding_ddp else ""
        return name + ("_balanced" if self.balanced else "")

    @property
    def ours(self) -> bool:
        """occult_ft's de-duplicated expert parallelism (the per-expert exchange is the others' way)."""
        return self.kind == "occult_ep" and self.exchange != "per_expert"

    @classmethod
    def from_name(cls, name: str) -> Contender:
        """The contender a command-line name spells: data_parallel, hf_native_ep, deepspeed_moe, or
        occult_ep followed by any of _per_expert or _two_stage, _budget{M}, _chunks{N}, _overlap, _shared,
        _capacity, _embedding_ddp, _balanced."""
        if name in KINDS and name != "occult_ep":
            return cls(kind=name, name=name)
        if not name.startswith("occult_ep"):
            raise _unknown(name)
        chosen: dict[str, Any] = {}
        rest = name[len("occult_ep") :]
        while rest:
            suffix = next((s for s in _SUFFIXES if rest.startswith(s)), None)
            if suffix is None:
                raise _unknown(name)
            rest = rest[len(suffix) :]
            key, value = _SUFFIXES[suffix]
            if value is int:  # the digits after _budget / _chunks
                digits = len(rest) - len(rest.lstrip("0123456789"))
                if not digits:
                    raise ValueError(f"contender {name!r}: {suffix} needs a number, e.g. {suffix}2")
                value, rest = int(rest[:digits]), rest[digits:]
            if key in chosen:
                raise ValueError(f"contender {name!r} sets its {key} twice; keep one of them")
            chosen[key] = value
        return cls(name=name, **chosen)

    def check(self, settings: StepSettings) -> Contender:
        """`self` when it can run with `settings`; a one-line error otherwise."""
        if self.exchange == "two_stage" and settings.nodes < 2:
            raise ValueError(f"{self.name} needs nodes > 1 (got nodes={settings.nodes}); pass --nodes 2")
        for suffix, on in (("_overlap", self.overlap), ("_shared", self.shared)):
            if on and (self.exchange == "two_stage" or self.capacity):
                raise ValueError(
                    f"{self.name}: {suffix} runs the exact flat and per_expert exchanges; drop it"
                )
        if self.shared and not settings.shared_experts:
            raise ValueError(
                f"{self.name}: _shared runs the blocks' shared MLP beside the combine; the model has none: "
                "pass --shared-experts N"
            )
        if settings.shared_experts and self.kind in ("hf_native_ep", "deepspeed_moe"):
            raise ValueError(
                f"{self.name} is built for the OLMoE block; with --shared-experts run data_parallel and occult_ep "
                "contenders"
            )
        if self.budget is not None:
            m, per_device = self.budget, settings.experts // settings.devices
            if m > settings.devices:
                raise ValueError(f"{self.name}: a budget of {m} devices exceeds devices={settings.devices}")
            if m * per_device < settings.top_k:
                raise ValueError(
                    f"{self.name}: a budget of {m} devices holds {m * per_device} experts < "
                    f"top_k={settings.top_k}; raise the budget"
                )
        return self

    def spec(self) -> dict[str, Any]:
        """The contender as the worker reads it (`step_worker.run_occult_ep`) and the report's row shows it."""
        if self.kind != "occult_ep":
            return {"name": self.name, "kind": self.kind, "ours": False}
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "exchange": self.exchange}
        if self.budget is not None:
            out["max_devices_per_token"] = self.budget
        if self.chunks is not None:
            out["chunks"] = self.chunks
        if self.overlap:
            out["overlap"] = True
        if self.shared:
            out["overlap_shared"] = True
        if self.capacity:
            out["capacity"] = "auto"
        if self.embedding_ddp:
            out["embedding_gradient_overlap"] = False
        if self.balanced:
            out["device_bias_rate"] = BALANCED_BIAS_RATE
        return out | {"ours": self.ours}


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown contender {name!r}; choose from {', '.join(DEFAULT_CONTENDERS)} or {_GRAMMAR}"
    )


def contender_spec(name: str, settings: StepSettings) -> dict:
    """What contender `name` runs with `settings`, as the worker reads it (`Contender.spec`)."""
    return Contender.from_name(name).check(settings).spec()


def embedded_settings(settings: StepSettings) -> StepSettings:
    """`settings` with the shape fields of the embedded model (`model="embedded"`); unchanged otherwise."""
    if settings.model != "embedded":
        return settings
    from dataclasses import replace

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(embedded_model_path())
    if settings.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len={settings.seq_len} exceeds the embedded model's {config.max_position_embeddings} positions"
        )
    return replace(
        settings,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        expert_width=config.intermediate_size,
        heads=config.num_attention_heads,
        vocab=config.vocab_size,
    )


def _embedded_rows(rows: int, seq_len: int) -> torch.Tensor:
    """(rows, seq_len) consecutive token windows of the embedded training corpus."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    text = read_text(embedded_data_path("train"))
    ids: list[int] = []
    for doc in text.split("\n\n"):
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= rows * seq_len:
            break
    if len(ids) < rows * seq_len:
        raise ValueError(f"the embedded corpus holds {len(ids)} tokens < {rows * seq_len} the steps need")
    return torch.tensor(ids[: rows * seq_len]).reshape(rows, seq_len)


def random_model(settings: StepSettings):
    """The OLMoE-shaped random model of `settings` (seeded with `settings.seed`): what `--train` measures
    unless the model is the embedded one; DeepSeek-V3-shaped with `settings.shared_experts`."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, OlmoeConfig, PretrainedConfig

    common: dict[str, Any] = dict(
        vocab_size=settings.vocab,
        hidden_size=settings.hidden,
        intermediate_size=settings.expert_width,  # DeepSeek-V3: a dense layer's width (there is none)
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.heads,
        num_experts_per_tok=settings.top_k,
        norm_topk_prob=True,
        max_position_embeddings=max(4096, settings.seq_len),
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    config: PretrainedConfig
    if settings.shared_experts:
        config = DeepseekV3Config(**common, **_deepseek_fields(settings))
    else:
        config = OlmoeConfig(**common, num_experts=settings.experts)
    torch.manual_seed(settings.seed)
    return AutoModelForCausalLM.from_config(config)


def _deepseek_fields(settings: StepSettings) -> dict[str, Any]:
    """DeepSeek-V3-shaped: the same experts, top-k, widths and vocabulary, every layer MoE with
    `shared_experts` shared experts (one MLP, added after the experts), one routing group, no scaling;
    MLA attention with the heads of `settings` (query and value heads of hidden / heads, a quarter of
    that rotary, the key-value latent hidden / 4)."""
    head = settings.hidden // settings.heads
    return dict(
        moe_intermediate_size=settings.expert_width,
        n_routed_experts=settings.experts,
        n_shared_experts=settings.shared_experts,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=max(1, settings.hidden // 4),
        qk_nope_head_dim=head,
        qk_rope_head_dim=max(2, head // 4),
        v_head_dim=head,
    )


def random_rows(settings: StepSettings, rows: int) -> torch.Tensor:
    """(rows, seq_len) random token ids of the random model's data (seeded with `settings.seed` + 1)."""
    gen = torch.Generator().manual_seed(settings.seed + 1)
    return torch.randint(2, settings.vocab, (rows, settings.seq_len), generator=gen)


def _save_model_and_data(settings: StepSettings, tmp: str) -> tuple[str, str, object]:
    from transformers import AutoModelForCausalLM

    model_dir = os.path.join(tmp, "model")
    rows = (
        settings.micro_batch_tokens
        // settings.seq_len
        * settings.grad_accum
        * (settings.warmup + settings.steps)
    )
    data_path = os.path.join(tmp, "data.pt")
    if settings.model == "embedded":
        model = AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
        model.config.norm_topk_prob = True  # the shared gate convention; the selection is unchanged
        model.save_pretrained(model_dir)
        torch.save(_embedded_rows(rows, settings.seq_len), data_path)
        return model_dir, data_path, model
    model = random_model(settings)
    model.save_pretrained(model_dir)
    torch.save(random_rows(settings, rows), data_path)
    return model_dir, data_path, model


def _launch(
    settings: StepSettings,
    contender: Contender,
    model_dir: str,
    data_path: str,
    tmp: str,
    cluster: EmulatedCluster | None = None,
) -> dict:
    """One contender on D processes (in `cluster` when given); returns the per-rank results, or
    {"error": why}."""
    out = tempfile.mkdtemp(prefix=f"{contender.name}-", dir=tmp)
    spec = {
        **asdict(settings),
        "device": settings.resolved_device(),
        "contender": contender.spec(),
        "model_dir": model_dir,
        "data": data_path,
        "out": out,
        "batch_per_rank": settings.batch_per_rank,
        "grad_accum": settings.grad_accum,
        "num_layers": settings.layers,
    }
    module = "occult_ft.bench.step_worker"
    return launch_workers(module, spec, out, settings.devices, settings.threads, settings.timeout_s, cluster)


def run_train_step(
    settings: StepSettings, contenders=None, clusters=("4x8-ib",), progress=None, workdir: str | None = None
) -> dict:
    """Measure `contenders` (default `DEFAULT_CONTENDERS`) and return the report (module docstring).

    Args:
        settings: the model, step and measurement.
        contenders: `Contender`s or their names (`Contender.from_name`).
        clusters: cost-model cluster shapes for the predicted exchange of the same step.
        progress: optional callable(str) told about each launch.
        workdir: keep the model, data and every launch's log there (default: a temporary directory,
            removed at the end).
    """
    settings = embedded_settings(settings)
    specs = _chosen(contenders or DEFAULT_CONTENDERS, settings)
    names = list(specs)
    for cluster in clusters:
        get_cluster(cluster)
    results: dict[str, list[dict]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    emulated = (
        EmulatedCluster(settings.nodes, settings.devices // settings.nodes, settings.link_rate)
        if settings.link_rate is not None
        else None
    )
    tmp = tempfile.mkdtemp(prefix="occult-step-") if workdir is None else workdir
    os.makedirs(tmp, exist_ok=True)
    try:
        model_dir, data_path, model = _save_model_and_data(settings, tmp)
        routing = _routing(model, data_path, settings)
        del model
        with emulated if emulated is not None else contextlib.nullcontext():
            _rounds(settings, names, specs, model_dir, data_path, tmp, emulated, results, errors, progress)
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    for name in names:
        if name in errors or not results[name]:
            row: dict[str, Any] = {"contender": name, "measured": False, "reason": errors.get(name, "no run")}
        else:
            row = {
                **summarise_contender(name, results[name], settings.warmup, settings.tokens_per_step),
                "measured": True,
            }
        rows.append(row | {k: v for k, v in specs[name].spec().items() if k != "name"})
    compare_contenders(rows)
    return {
        "settings": asdict(settings),
        "device": settings.resolved_device(),
        "network": emulated.describe() if emulated is not None else "the host's loopback (unshaped)",
        "tokens_per_step": settings.tokens_per_step,
        "contenders": rows,
        "cost_model": _cost_model(routing, settings, clusters),
        "notes": _notes(settings),
    }


def _chosen(contenders, settings: StepSettings) -> dict[str, Contender]:
    """Name -> contender, each checked against `settings` (names read by `Contender.from_name`)."""
    specs: dict[str, Contender] = {}
    for given in contenders:
        contender = given if isinstance(given, Contender) else Contender.from_name(given)
        if contender.name in specs:
            raise ValueError(f"contender {contender.name!r} is named twice; name it once")
        specs[contender.name] = contender.check(settings)
    return specs


def _rounds(settings, names, specs, model_dir, data_path, tmp, cluster, results, errors, progress) -> None:
    """Every contender once per round, the order rotating (module docstring)."""
    for r in range(settings.rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        if r % 2:
            order.reverse()
        for name in order:
            if name in errors:
                continue
            if progress:
                progress(f"round {r + 1}/{settings.rounds}: {name}")
            got = _launch(settings, specs[name], model_dir, data_path, tmp, cluster)
            if "error" in got:
                errors[name] = got["error"]
            else:
                results[name].append(got)


@torch.no_grad()
def _routing(model, data_path: str, settings: StepSettings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(scores_TE, topk_ids_TK) of every MoE layer of the saved model on the first micro-batch's tokens
    (the cost model's routing; `_cost_model` repeats it for more tokens)."""
    layers = find_moe_layers(model)
    rows = settings.micro_batch_tokens // settings.seq_len
    ids = torch.load(data_path, weights_only=True)[:rows]
    captured: dict[int, list] = {layer.index: [] for layer in layers}
    handles = []
    for layer in layers:

        def hook(module, args, output, index=layer.index, arch=layer.arch):
            logits_TE, _, ids_TK = output
            captured[index].append((arch.selection_scores(module, logits_TE).float(), ids_TK.long()))

        handles.append(layer.router.register_forward_hook(hook))
    try:
        model.eval()
        for start in range(0, ids.shape[0], 8):
            model(input_ids=ids[start : start + 8])
    finally:
        for handle in handles:
            handle.remove()
    return [
        (torch.cat([c[0] for c in captured[i]]), torch.cat([c[1] for c in captured[i]]))
        for i in sorted(captured)
    ]


def _repeat(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of `x` repeated as often as needed (the step's routing standing in for more
    tokens of the same data)."""
    reps = -(-rows // x.shape[0])
    return x.repeat(reps, *([1] * (x.dim() - 1)))[:rows]


def _cost_model(routing, settings: StepSettings, clusters) -> dict:
    """Predicted exchange of one training step (forward dispatch + combine, and the same again in
    backward, over all MoE layers) on each cluster, for the same global batch and for the same tokens
    per device as measured here (the step's routing repeated, spread over the cluster's devices)."""
    bytes_per_row = settings.hidden * (2 if settings.dtype == "bfloat16" else 4)
    out: dict[str, Any] = {"bytes_per_row": bytes_per_row, "clusters": []}
    for name in clusters:
        shape = get_cluster(name)
        d = shape.num_devices
        entry = {**shape.to_dict(), "num_devices": d}
        if settings.experts % d:
            entry["skipped"] = f"{d} devices do not divide the {settings.experts} experts"
            out["clusters"].append(entry)
            continue
        per_device = settings.experts // d
        dev_E = torch.arange(settings.experts) // per_device
        variants: dict[str, int | None] = {"per_expert": None, "dedup": None}  # label -> device budget
        for m in (1, 2, 4, 8):
            if m < d and m * per_device >= settings.top_k:
                variants[f"dedup_budget{m}"] = m
        for label, tokens in (
            ("same_global_batch", settings.micro_batch_tokens),
            ("same_tokens_per_device", settings.micro_batch_tokens // settings.devices * d),
        ):
            preds = {}
            for kind, budget in variants.items():
                total = 0.0
                for scores, ids in routing:
                    ids_t, scores_t = _repeat(ids, tokens), _repeat(scores, tokens)
                    if budget is not None:
                        ids_t = pruned_topk(scores_t, ids_t, dev_E, d, budget)
                    rows_DD = rows_matrix(ids_t, dev_E, d, dedup=kind != "per_expert")
                    total += 2 * predict_exchange_ms(rows_DD, bytes_per_row, shape)  # forward + backward
                preds[kind] = total
            if shape.nodes > 1:
                total = 0.0
                for _, ids in routing:
                    s1, s2 = two_stage_rows(_repeat(ids, tokens), dev_E, d, shape.nodes)
                    total += 2 * predict_two_stage_exchange_ms(s1, s2, bytes_per_row, shape)
                preds["two_stage"] = total
            entry[label] = {"tokens": tokens, "exchange_ms_per_step": preds}
        out["clusters"].append(entry)
    return out


def _notes(settings: StepSettings) -> list[str]:
    if settings.model == "embedded":
        model = "the embedded OLMoE (trained routers) on its corpus"
    elif settings.shared_experts:
        model = (
            f"DeepSeek-V3-shaped (MLA, {settings.shared_experts} shared expert(s) added after the routed ones), "
            "random weights and tokens"
        )
    else:
        model = "OLMoE-shaped, random weights and tokens"
    notes = [
        f"model: {model}, norm_topk_prob=True (the gate convention of every contender, DeepSpeed's "
        "included); aux/balance losses off everywhere so the losses compare",
        "occult_ep contenders: OccultTrainer, placement sequential, criterion score, train_mode full",
        "deepspeed_moe: deepspeed.moe.layer.MoE(ep_size=D, drop_tokens=False) per MoE block, same weights, "
        "DeepSpeed engine with ZeRO 0",
        "hf_native_ep: DistributedConfig(fsdp_size=D, ep_size=D, ep_implementation='all_to_all') + Trainer",
        f"{settings.grad_accum} micro-batches per optimizer step; the dense gradients are reduced on the last",
        "dense_allreduce: DDP's buckets (its default all-reduce as a Python hook), DeepSpeed's all-reduce, "
        "FSDP's reduce-scatter, issued inside backward; waiting: blocked in an exchange before the last "
        "rank of its group issued it",
        "the backward of transformers EP's functional all-to-all runs from C++: inside compute",
    ]
    if settings.resolved_device() == "cpu" and settings.link_rate is None:
        notes.append(
            "one host's loopback over gloo is not a network: transfer is memory copies, waiting dominates; "
            "see the cost model for a cluster, or pass link_rate (--link-rate) for an emulated one"
        )
    if settings.barrier:
        notes.append("diagnostic mode: a barrier before each exchange collective (step times include them)")
    return notes
