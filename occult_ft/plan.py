"""Per-GPU memory plan of an Occult fine-tuning run, before any GPU is touched (`occult-ft plan`).

What each GPU holds (weights, gradients, optimizer states, activations, communication buffers) and how
each is counted: docs/recipes.md, "The memory plan". Parameter counts come from the model built on the
`meta` device from its config (every architecture counted exactly); `tests/test_plan.py` checks
weights, gradients and optimizer states against what `OccultTrainer` really allocates.

    count_params / ModelCounts     parameters split the way memory is (routed experts, MoE rest, the rest)
    Setup / _setup                 what of an `OccultConfig` and the launch the memory depends on
    Plan / _plan                   bytes per category and per GPU; `_optimizer_bytes` the optimizer's share
    _suggestions / _smallest_fitting   what to change when a run does not fit
    check_fits_before_loading / plan_for_config   the entry points (`occult-ft train`, `occult-ft plan`)

Legend: E routed experts per layer, D = `expert_parallel_size`, G GPUs per node; B = bytes.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .configs import as_config, load_model_config, shipped_config_path
from .integrations.deepspeed import read_deepspeed_config
from .integrations.peft import lora_targets
from .models.arch import decoder_layers
from .models.family import auto_model_class
from .models.registry import find_moe_layers, get_arch

__all__ = [
    "GIB",
    "COMPENSATED_OPTIMS",
    "ModelCounts",
    "Plan",
    "count_params",
    "load_model_config",
    "check_fits_before_loading",
    "plan_for_config",
    "shipped_config_path",
]

GIB = 1024**3
HEADROOM = 0.10  # kept free for the CUDA context, allocator fragmentation and temporary buffers
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
#: `optim` values whose optimizer is `torch.optim.AdamW`, which OccultTrainer replaces by
#: `CompensatedAdamW` (occult_ft.trainer.optim.choose_optimizer): float32 moments, compensated 16-bit weights
COMPENSATED_OPTIMS = ("adamw_torch", "adamw_torch_fused")


# ---- the model's parameters -------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """Elements and tensors of a set of parameters."""

    numel: int = 0
    tensors: int = 0

    def __add__(self, other: Group) -> Group:
        return Group(self.numel + other.numel, self.tensors + other.tensors)


@dataclass(frozen=True)
class ModelCounts:
    """Parameters of one model split the way memory is, and the widths the activation estimate needs.

    Args:
        expert: routed-expert tensors (sharded by expert parallelism).
        moe_other: the rest of the MoE blocks (routers, shared experts).
        rest: everything else (embeddings, attention, dense MLPs, norms, head).
        router: the routers alone (copied by LoRA's `modules_to_save`).
        lora_replicated / lora_expert: the LoRA adapters `occult_ft.integrations.peft` adds at rank 1
            (they scale linearly with the rank).
        layer_elems: saved activation elements per token of each decoder layer (estimate).
        hidden, vocab, num_experts, top_k: model widths.
    """

    expert: Group
    moe_other: Group
    rest: Group
    router: Group
    lora_replicated: Group
    lora_expert: Group
    layer_elems: tuple[int, ...]
    hidden: int
    vocab: int
    num_experts: int
    top_k: int

    @property
    def total(self) -> Group:
        return self.expert + self.moe_other + self.rest


def _linear_outs(module: nn.Module, skip=()) -> tuple[int, int]:
    """(sum of Linear out_features, sum of gate_proj out_features) under `module`, skipping `skip` modules."""
    skipped = {id(m) for s in skip for m in s.modules()}
    outs = gates = 0
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and id(m) not in skipped:
            outs += m.out_features
            gates += m.out_features if name.endswith("gate_proj") else 0
    return outs, gates


def count_params(model_config) -> ModelCounts:
    """Count the parameters of `model_config`'s model, built on the meta device (no memory, exact)."""
    get_arch(model_config)  # an unsupported or refused model type: one line, nothing built
    with torch.device("meta"):
        model = auto_model_class(model_config).from_config(model_config)
    layers = find_moe_layers(model)
    expert_ids = {id(p) for layer in layers for p in layer.experts.parameters()}
    block_ids = {id(p) for layer in layers for p in layer.moe_parameters()}
    router_ids = {id(p) for layer in layers for p in layer.router.parameters()}
    groups = {"expert": Group(), "moe_other": Group(), "rest": Group(), "router": Group()}
    for p in model.parameters():  # unique parameters: tied embeddings count once
        key = "expert" if id(p) in expert_ids else "moe_other" if id(p) in block_ids else "rest"
        groups[key] += Group(p.numel(), 1)
        if id(p) in router_ids:
            groups["router"] += Group(p.numel(), 1)

    lora_rep, lora_exp = _lora_counts(model, layers)
    hidden = int(model.get_input_embeddings().embedding_dim)
    elems = _layer_elems(model, layers, hidden)
    return ModelCounts(
        expert=groups["expert"],
        moe_other=groups["moe_other"],
        rest=groups["rest"],
        router=groups["router"],
        lora_replicated=lora_rep,
        lora_expert=lora_exp,
        layer_elems=tuple(elems),
        hidden=hidden,
        vocab=int(model.get_output_embeddings().weight.shape[0]),
        num_experts=layers[0].num_experts,
        top_k=layers[0].top_k,
    )


def _lora_counts(model: nn.Module, layers: list) -> tuple[Group, Group]:
    """LoRA at rank 1 on the replicated Linears and on the fused expert tensors: A (r, in) + B (out, r)
    per Linear; r * E * (a + b) per fused expert tensor (E, a, b)."""
    targets = lora_targets(model)
    lora_rep = Group()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets["target_modules"]:
            lora_rep += Group(m.in_features + m.out_features, 2)
    lora_exp = Group()
    wanted = {t.rsplit(".", 1)[-1] for t in targets["target_parameters"]}
    for layer in layers:
        for pname, p in layer.experts.named_parameters(recurse=False):
            if pname in wanted and p.dim() == 3:
                lora_exp += Group(p.shape[0] * (p.shape[1] + p.shape[2]), 2)
    return lora_rep, lora_exp


def _layer_elems(model: nn.Module, layers: list, hidden: int) -> list[int]:
    """Per decoder layer, the activation elements one token keeps for backward."""
    arch = layers[0].arch
    _, decoder = decoder_layers(model)
    moe_by_index = {layer.index: layer for layer in layers}
    elems = []
    for index, dec in enumerate(decoder):
        moe = moe_by_index.get(index)
        if arch.block_attr is not None:  # the feed-forward module: the MoE block or the dense MLP
            ffn = [m for m in (getattr(dec, arch.block_attr, None),) if isinstance(m, nn.Module)]
        else:  # Gemma 4: router and experts on the decoder layer, beside its dense MLP
            ffn = [
                m
                for m in (getattr(dec, n, None) for n in ("mlp", arch.router_attr, "experts"))
                if m is not None
            ]
        attn_out, _ = _linear_outs(dec, skip=ffn)
        per_token = 2 * hidden + attn_out  # residual + norm output, q/k/v/attention outputs
        routed = (moe.experts, moe.router) if moe is not None else ()
        outs = gates = 0
        for module in ffn:
            o, g = _linear_outs(module, skip=routed)  # dense MLPs and shared experts
            outs, gates = outs + o, gates + g
        per_token += hidden + outs + gates  # norm output, projections, silu(gate) * up
        if moe is not None:
            per_token += _routed_elems(moe, hidden)
        elems.append(per_token)
    return elems


def _routed_elems(moe, hidden: int) -> int:
    """A token's routed-expert activations: router scores and probabilities, and per routed copy the
    dispatched input, projections and activation product."""
    pair = hidden
    for p in moe.experts.parameters():
        if p.dim() == 3:
            pair += p.shape[1] + p.shape[2] - hidden + min(p.shape[1], p.shape[2]) // 2
    return 2 * moe.num_experts + moe.top_k * pair


# ---- the run's settings -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What of an `OccultConfig` (and the launch) the memory depends on; suggestions vary it."""

    gpus: int
    gpu_memory_gb: float
    ep: int
    train_mode: str
    lora_r: int
    weight_bytes: int
    act_bytes: int
    optim: str
    zero_stage: int | None  # None = no DeepSpeed
    buckets: tuple[int, int]  # DeepSpeed reduce / all-gather bucket elements
    batch: int
    grad_accum: int
    seq_len: int
    checkpointing: bool
    budget: int | None
    nodes: int = 1  # machines of the launch (gpus = nodes * gpus_per_node)
    gpus_per_node: int | None = None
    exchange: str = "flat"  # the expert-parallel exchange: flat, or two_stage over `ep_nodes` nodes
    ep_nodes: int = 1  # the nodes the expert-parallel group spans (OccultConfig.nodes)
    node_budget: int | None = None  # max_nodes_per_token


def _setup(args, model_config, gpus: int, gpu_memory_gb: float, gpus_per_node: int | None = None) -> Setup:
    ep = int(getattr(args, "expert_parallel_size", 1) or 1)
    _check_launch(gpus, ep, gpus_per_node, gpu_memory_gb)
    weight_bytes = _weight_bytes(args, model_config)
    mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    stage, buckets = _deepspeed_zero(args)
    optim = str(getattr(args, "optim", "adamw_torch"))
    return Setup(
        gpus=gpus,
        gpu_memory_gb=float(gpu_memory_gb),
        ep=ep,
        train_mode=args.train_mode,
        lora_r=int(args.lora_r),
        weight_bytes=weight_bytes,
        act_bytes=2 if (mixed or weight_bytes == 2) else weight_bytes,
        optim=optim.split(".")[-1].lower(),
        zero_stage=stage,
        buckets=buckets,
        batch=int(args.per_device_train_batch_size),
        grad_accum=int(args.gradient_accumulation_steps),
        seq_len=int(args.tokens_per_row() if hasattr(args, "tokens_per_row") else args.seq_len),
        checkpointing=bool(args.gradient_checkpointing),
        budget=getattr(args, "max_devices_per_token", None),
        nodes=gpus // gpus_per_node if gpus_per_node else 1,
        gpus_per_node=gpus_per_node,
        exchange=str(getattr(args, "exchange", "flat") or "flat"),
        ep_nodes=int(getattr(args, "nodes", 1) or 1),
        node_budget=getattr(args, "max_nodes_per_token", None),
    )


def _check_launch(gpus, ep: int, gpus_per_node, gpu_memory_gb) -> None:
    """The launch's GPUs (a multiple of the expert-parallel size), GPUs per node (a divisor), memory (> 0)."""
    if not isinstance(gpus, int) or gpus < 1 or gpus % ep:
        raise ValueError(
            f"gpus={gpus!r} must be a positive multiple of expert_parallel_size={ep}; set --gpus {ep}"
        )
    if gpus_per_node is not None and (
        not isinstance(gpus_per_node, int) or gpus_per_node < 1 or gpus % gpus_per_node
    ):
        raise ValueError(
            f"gpus_per_node={gpus_per_node!r} must be a positive divisor of the {gpus} GPUs; e.g. --gpus-per-node 8"
        )
    if not gpu_memory_gb or gpu_memory_gb <= 0:
        raise ValueError(f"gpu_memory_gb={gpu_memory_gb!r} must be > 0, e.g. 80 for an H100")


def _weight_bytes(args, model_config) -> int:
    """Bytes per weight: model_dtype, or with "auto" the checkpoint's dtype (float32 when it names none)."""
    dtype = getattr(args, "model_dtype", "auto") or "auto"
    if dtype == "auto":
        dtype = (
            getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or "float32"
        )
    return _DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 4)


def _deepspeed_zero(args) -> tuple[int | None, tuple[int, int]]:
    """(ZeRO stage, (reduce, all-gather) bucket elements) of the run's DeepSpeed config; (None, (0, 0))
    without DeepSpeed. A bucket size given as a string ("auto") counts as DeepSpeed's default 5e8."""
    if not getattr(args, "deepspeed", None):
        return None, (0, 0)
    zero = read_deepspeed_config(args.deepspeed).get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if str(zero.get("stage", 0)).isdigit() else 0
    reduce_size, allgather_size = (
        int(float(zero.get(k, 5e8))) if not isinstance(zero.get(k), str) else int(5e8)
        for k in ("reduce_bucket_size", "allgather_bucket_size")
    )
    return stage, (reduce_size, allgather_size)


# ---- the plan ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Memory per GPU of one run. `breakdown_bytes` keys: weights, gradients, optimizer_states,
    activations (an estimate), communication_buffers."""

    setup: Setup
    params_total: int
    params_per_gpu: int
    trainable_per_gpu: int
    breakdown_bytes: dict[str, int]
    notes: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = field(default=(), compare=False)

    @property
    def per_gpu_bytes(self) -> int:
        return sum(self.breakdown_bytes.values())

    @property
    def per_gpu_gb(self) -> float:
        return self.per_gpu_bytes / GIB

    @property
    def usable_gb(self) -> float:
        return self.setup.gpu_memory_gb * (1 - HEADROOM)

    @property
    def fits(self) -> bool:
        return self.per_gpu_gb <= self.usable_gb

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "per_gpu_gb": round(self.per_gpu_gb, 3),
            "gpu_memory_gb": self.setup.gpu_memory_gb,
            "usable_gb": round(self.usable_gb, 3),
            "breakdown": {k: round(v / GIB, 3) for k, v in self.breakdown_bytes.items()},
            "breakdown_bytes": dict(self.breakdown_bytes),
            "params_total": self.params_total,
            "params_per_gpu": self.params_per_gpu,
            "trainable_per_gpu": self.trainable_per_gpu,
            "setup": dataclasses.asdict(self.setup),
            "notes": list(self.notes),
            "suggestions": list(self.suggestions),
        }


def _optimizer_bytes(s: Setup, trainable: Group, param_bytes: int) -> int:
    """Bytes of the optimizer's state for `trainable` parameters stored in `param_bytes` each."""
    if s.zero_stage is not None and s.act_bytes == 2:
        return 12 * trainable.numel  # DeepSpeed mixed precision: fp32 master + fp32 moments
    if "8bit" in s.optim:
        return (
            2 * trainable.numel + 8 * trainable.tensors
        )  # int8 moments (+ per-tensor quantisation, approx.)
    if s.optim.startswith("sgd"):
        return 0
    if s.optim in COMPENSATED_OPTIMS:  # CompensatedAdamW: fp32 moments (+ compensation for 16-bit weights)
        compensation = param_bytes if param_bytes < 4 else 0
        return (8 + compensation) * trainable.numel + 4 * trainable.tensors
    return 2 * param_bytes * trainable.numel + 4 * trainable.tensors  # exp_avg, exp_avg_sq, step


def _exchange_bytes(c: ModelCounts, s: Setup, tokens: int) -> int:
    """Send + receive rows of one layer's dispatch (0 without expert parallelism): a token reaches at most
    min(k, D, M) devices, and with the two-stage exchange also min(k, N, node budget) nodes."""
    if s.ep <= 1:
        return 0
    reach = min(c.top_k, s.ep, s.budget or s.ep)
    comm = 2 * tokens * reach * c.hidden * s.act_bytes
    if s.exchange == "two_stage" and s.ep_nodes > 1:  # + the inter-node stage: one row per node reached
        reach_nodes = min(c.top_k, s.ep_nodes, s.node_budget or s.ep_nodes)
        comm += 2 * tokens * reach_nodes * c.hidden * s.act_bytes
    return comm


def _plan(c: ModelCounts, s: Setup) -> Plan:
    notes = []
    w = s.weight_bytes
    expert = Group(c.expert.numel // s.ep, c.expert.tensors)  # E/D experts per GPU
    replicated = c.moe_other + c.rest
    weights = w * (expert.numel + replicated.numel)
    dp_rep, dp_exp = s.gpus, s.gpus // s.ep  # ZeRO partitions: all ranks / the expert-data-parallel group
    # trainable parts: (parameters, bytes per element, ranks that share their ZeRO partition)
    if s.train_mode == "full":
        parts = [(replicated, w, dp_rep), (expert, w, dp_exp)]
    elif s.train_mode == "moe":
        parts = [(c.moe_other, w, dp_rep), (expert, w, dp_exp)]
    else:  # lora: adapters (fp32) + a trainable copy of every router (weights' dtype)
        # expert LoRA factors shard with their experts (E/D per GPU, reduced over the expert-data-parallel
        # group); attention LoRA and the routers are replicated
        lora_rep = Group(s.lora_r * c.lora_replicated.numel, c.lora_replicated.tensors)
        lora_exp = Group(s.lora_r * c.lora_expert.numel // s.ep, c.lora_expert.tensors)
        weights += 4 * (lora_rep.numel + lora_exp.numel) + w * c.router.numel
        parts = [(lora_rep, 4, dp_rep), (lora_exp, 4, dp_exp), (c.router, w, dp_rep)]
    stage = -1 if s.zero_stage is None else s.zero_stage
    ceil = lambda n, div: -(-n // div)  # noqa: E731 - DeepSpeed pads its partitions
    grads = sum(ceil(4 * g.numel, div) if stage >= 2 else b * g.numel for g, b, div in parts)
    optim = sum(ceil(_optimizer_bytes(s, g, b), div if stage >= 1 else 1) for g, b, div in parts)
    trainable = sum(g.numel for g, _, _ in parts)
    if stage >= 3:
        notes.append("ZeRO-3 also partitions the weights; expert parallelism refuses stage 3")
        weights = ceil(weights, s.gpus)

    tokens = s.batch * s.seq_len
    if s.checkpointing:
        per_token = len(c.layer_elems) * c.hidden + max(c.layer_elems)
    else:
        per_token = sum(c.layer_elems)
    acts = tokens * (per_token + 2 * c.hidden) * s.act_bytes + tokens * c.vocab * (s.act_bytes + 8)
    comm = _exchange_bytes(c, s, tokens)
    if s.gpus_per_node and s.ep > s.gpus_per_node and s.ep_nodes != s.ep // s.gpus_per_node:
        notes.append(
            f"expert_parallel_size={s.ep} spans {s.ep // s.gpus_per_node} nodes of {s.gpus_per_node} GPUs but the "
            f"run says nodes={s.ep_nodes}; set nodes: {s.ep // s.gpus_per_node} so that node budgets and the "
            "two-stage exchange follow the machines"
        )
    if s.gpus > 1 and stage < 0:  # DDP's gradient buckets: a copy of the replicated trainable gradients
        comm += sum(b * g.numel for g, b, div in parts if div == dp_rep)
    elif s.gpus > 1:
        comm += 2 * (s.buckets[0] + (s.buckets[1] if stage >= 1 else 0))  # DeepSpeed's bf16 buckets
    return Plan(
        setup=s,
        params_total=c.total.numel,
        params_per_gpu=expert.numel + replicated.numel,
        trainable_per_gpu=trainable,
        breakdown_bytes={
            "weights": weights,
            "gradients": grads,
            "optimizer_states": optim,
            "activations": acts,
            "communication_buffers": comm,
        },
        notes=tuple(notes),
    )


def _suggestions(c: ModelCounts, s: Setup, plan: Plan) -> tuple[list[str], list[str]]:
    """Concrete changes that bring the run under the GPU's memory, each with its planned total, and
    notes on the usual changes left out because they would need more memory, not less."""
    out, left_out = [], []

    def option(text: str, why_not: str = "", **change):
        p = _plan(c, dataclasses.replace(s, **change))
        if p.per_gpu_gb >= plan.per_gpu_gb:  # makes it worse: say why instead of suggesting it
            left_out.append(
                f"not suggested: {text} ({p.per_gpu_gb:.1f} GB per GPU, not less than {plan.per_gpu_gb:.1f} GB"
                + (f": {why_not})" if why_not else ")")
            )
            return
        verdict = "fits" if p.fits else "still too big"
        out.append(f"{text}: {p.per_gpu_gb:.1f} GB per GPU ({verdict})")

    if s.train_mode != "lora":
        option("train_mode: lora (learning_rate 2.0e-4), expert_parallel_size 1", train_mode="lora", ep=1)
    if s.zero_stage is None or s.zero_stage < 2:
        option(
            "DeepSpeed ZeRO-2 (--deepspeed with zero_optimization.stage 2)",
            f"DeepSpeed keeps fp32 master weights and optimizer states, and partitions the expert ones only "
            f"over the expert-data-parallel group, of {max(s.gpus // s.ep, 1)} GPU"
            + ("s" if s.gpus // s.ep > 1 else "")
            + " here",
            zero_stage=2,
            buckets=(int(5e8), int(5e8)),
        )
    if s.ep * 2 <= c.num_experts and c.num_experts % (s.ep * 2) == 0:
        d = s.ep * 2
        option(
            f"expert_parallel_size {d} and devices {d} on {max(s.gpus, d)} GPUs", ep=d, gpus=max(s.gpus, d)
        )
    if s.zero_stage is not None and s.zero_stage >= 1:
        option(f"{2 * s.gpus} GPUs (more data-parallel ranks share the ZeRO partitions)", gpus=2 * s.gpus)
    if not s.checkpointing:
        option("activation_checkpointing: true", checkpointing=True)
    smallest = _smallest_fitting(c, s)
    if smallest is not None:
        out.append(smallest)
    batch, accum = s.batch, s.grad_accum
    while batch > 1:
        batch, accum = batch // 2, accum * 2
        if _plan(c, dataclasses.replace(s, batch=batch)).fits or batch == 1:
            option(
                f"per_device_train_batch_size {batch} with gradient_accumulation_steps {accum}", batch=batch
            )
            break
    return out, left_out


def _smallest_fitting(c: ModelCounts, s: Setup) -> str | None:
    """The fewest GPUs (up to 64x as many) on which some expert parallelism / ZeRO-2 / LoRA fits."""
    modes = [s.train_mode] + (["lora"] if s.train_mode != "lora" else [])
    for gpus in (s.gpus * 2**i for i in range(7)):
        for mode in modes:
            eps = [d for d in range(1, c.num_experts + 1) if c.num_experts % d == 0 and gpus % d == 0]
            eps = sorted(eps, reverse=True)
            for ep in eps:
                for stage in dict.fromkeys([s.zero_stage, 2]):
                    change = dict(gpus=gpus, train_mode=mode, ep=ep, zero_stage=stage, checkpointing=True)
                    if stage is not None and s.zero_stage is None:
                        change["buckets"] = (int(5e8), int(5e8))
                    p = _plan(c, dataclasses.replace(s, **change))
                    if p.fits:
                        zero = "no DeepSpeed" if stage is None else f"DeepSpeed ZeRO-{stage}"
                        return (
                            f"smallest setup that fits: {gpus} GPU{'s' if gpus > 1 else ''}, train_mode {mode}, "
                            f"expert_parallel_size {ep}, "
                            f"{zero}, gradient checkpointing: {p.per_gpu_gb:.1f} GB per GPU"
                        )
    return None


def check_fits_before_loading(occult_config) -> Plan | None:
    """On a GPU run, the plan of `occult_config` on this launch (WORLD_SIZE GPUs of this GPU's memory);
    raises a one-line ValueError with the plan's first suggestion when it cannot fit. Nothing but the
    model's config is read. Returns None on CPU runs (nothing to plan against)."""
    import torch

    if getattr(occult_config, "use_cpu", False) or not torch.cuda.is_available():
        return None
    gpus = int(os.environ.get("WORLD_SIZE", "1") or 1)
    device = int(os.environ.get("LOCAL_RANK", "0") or 0) % max(1, torch.cuda.device_count())
    memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    plan = plan_for_config(
        occult_config, load_model_config(occult_config.model_name_or_path), gpus, memory_gb
    )
    if not plan.fits:
        fix = plan.suggestions[0] if plan.suggestions else "use more GPUs, LoRA or a smaller batch"
        raise ValueError(
            f"this run needs about {plan.per_gpu_gb:.1f} GB per GPU (`occult-ft plan` shows the breakdown) but "
            f"the GPUs have {memory_gb:.0f} GB ({plan.usable_gb:.0f} usable); {fix}"
        )
    return plan


def plan_for_config(
    occult_config, model_config, gpus: int, gpu_memory_gb: float, gpus_per_node: int | None = None
) -> Plan:
    """The per-GPU memory plan of training `model_config`'s model with `occult_config` on `gpus` GPUs.

    Args:
        occult_config: an `OccultConfig` (or any object with its fields).
        model_config: the model's `PretrainedConfig`, or its config.json as a dict.
        gpus: processes/GPUs of the launch (a multiple of `expert_parallel_size`).
        gpu_memory_gb: memory of one GPU in GB (2**30 bytes).
        gpus_per_node: GPUs per machine of a multi-node launch (gpus / gpus_per_node nodes), or None.
    """
    model_config = as_config(model_config)
    counts = count_params(model_config)
    setup = _setup(occult_config, model_config, gpus, gpu_memory_gb, gpus_per_node)
    plan = _plan(counts, setup)
    if not plan.fits:
        suggestions, left_out = _suggestions(counts, setup, plan)
        plan = dataclasses.replace(plan, suggestions=tuple(suggestions), notes=(*plan.notes, *left_out))
    return plan
