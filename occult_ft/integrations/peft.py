"""LoRA fine-tuning of placed, pruned MoE models through PEFT.

What LoRA wraps in an MoE model (PEFT >= 0.17; see the ecosystem facts):

- routed experts: their fused 3-D tensors (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)) are not
  `nn.Linear`, so they are adapted through `target_parameters=["mlp.experts.gate_up_proj",
  "mlp.experts.down_proj"]` (one low-rank update per expert);
- attention: the usual `q_proj`, `k_proj`, `v_proj`, `o_proj` linears, those the model has
  (DeepSeek's MLA has only `q_proj` and `o_proj` of them);
- the router stays *fully* trainable through `modules_to_save=["mlp.<router attr>"]` (`mlp.gate`, or
  `mlp.router` for GPT-OSS, read from the architecture registry): pruning changes which experts a
  token reaches, and the router has to adapt to that. The pruned router class installed by
  `occult_ft.routing.apply_pruning` survives the copy PEFT makes of it.

Under expert parallelism (`occult_ft.trainer.expert_parallel`) the expert LoRA factors shard with the
experts. PEFT's `ParamWrapper` keeps, per adapter, `lora_A.weight` of shape (r * E, in), expert-major
(`reshape(E, r, in)`), and `lora_B.weight` of shape (out, r * E), expert-minor (`reshape(out, r, E)`);
its forward folds `W + scaling * B_e @ A_e` for every expert e of the (possibly sharded) base tensor.
`shard_expert_lora` cuts both factors to the experts [start, start + P) and sets the wrapper's
`num_experts` to P, so the delta is computed for the local experts only; `gather_expert_lora` undoes
it for saving (the standard PEFT layout of a single-process run), `shard_adapter_weights` cuts a saved
adapter for loading into a sharded model.

`peft` is imported only when a function here runs.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging

from ..models import base_experts
from ..models.arch import moe_blocks
from ..models.registry import find_moe_layers, get_arch, unwrap_model

__all__ = [
    "seeded_lora_init",
    "adopt_local_expert_lora",
    "ATTENTION_PROJECTIONS",
    "is_peft_model",
    "lora_targets",
    "build_lora_config",
    "apply_lora",
    "expert_lora_wrappers",
    "shard_expert_lora",
    "gather_expert_lora",
    "shard_adapter_weights",
]

logger = logging.get_logger(__name__)

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")  # up_proj: experts without a gate (NemotronH)


def is_peft_model(model: nn.Module) -> bool:
    """True for a PEFT-wrapped model (also inside DDP/DeepSpeed wrappers)."""
    model = unwrap_model(model, keep_peft=True)
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def lora_targets(model: nn.Module, attention: bool = True) -> dict[str, list[str]]:
    """The PEFT targets of an MoE model.

    Args:
        model: a supported transformers MoE model.
        attention: also adapt the attention projections the model has.

    Returns:
        {"target_modules": [...], "target_parameters": [...], "modules_to_save": [...]}, e.g. for OLMoE
        `q_proj..o_proj`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj` and `mlp.gate`.
    """
    base = unwrap_model(model)
    arch = get_arch(base)
    find_moe_layers(base)  # an unsupported model, or one without MoE layers, fails here
    prefix = f"{arch.block_attr}." if arch.block_attr else ""  # "mlp.", or "" (Gemma 4: the decoder layer)
    kinds: dict[str, set[bool]] = {}  # module name -> whether the modules of that name are Linear
    for name, module in base.named_modules():
        kinds.setdefault(name.rsplit(".", 1)[-1], set()).add(isinstance(module, nn.Linear))
    linear_names = {name for name, linear in kinds.items() if linear == {True}}  # PEFT adapts every match
    modules = [name for name in ATTENTION_PROJECTIONS if name in linear_names] if attention else []
    params = [f"{prefix}experts.{name}" for name in _EXPERT_WEIGHTS if name in arch.expert_params]
    return {
        "target_modules": modules,
        "target_parameters": params,
        "modules_to_save": [f"{prefix}{arch.router_attr}"],
    }


def build_lora_config(
    model: nn.Module, r: int = 16, alpha: float = 32.0, dropout: float = 0.0, attention: bool = True
):
    """A `peft.LoraConfig` for `model` with the targets of `lora_targets`.

    Raises:
        ImportError: naming the extra to install when peft is missing.
        ValueError: for dropout != 0 (PEFT's `target_parameters` LoRA has no dropout).
    """
    if dropout:
        raise ValueError(
            f"lora_dropout={dropout!r}: PEFT's LoRA on the fused expert tensors (target_parameters) does not "
            "support dropout; set lora_dropout=0"
        )
    try:
        from peft import LoraConfig
    except ImportError:
        raise ImportError(
            "train_mode='lora' needs peft; install it with `pip install occult-ft[peft]`"
        ) from None
    targets = lora_targets(model, attention=attention)
    return LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; a float scales the same
        lora_dropout=dropout,
        target_modules=targets["target_modules"] or None,
        target_parameters=targets["target_parameters"],
        modules_to_save=targets["modules_to_save"],
        task_type="CAUSAL_LM",
    )


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.0,
    attention: bool = True,
    seed: int | None = None,
    config: Any = None,
):
    """Wrap `model` with LoRA adapters (call after placement and `apply_pruning`).

    Args:
        config: a `peft.PeftConfig` used as given (TRL's `peft_config`) instead of the one
            `build_lora_config(model, r, alpha, dropout, attention)` builds.
        seed: draw the random LoRA factors (`lora_A`) from `torch.manual_seed(seed)`, leaving the global
            random state as it was; the adapter then starts the same however many processes run and
            whatever they drew before (placement profiling, data loading). None: the global state.

    Returns:
        The `peft.PeftModel`; only the adapters and the routers are trainable.
    """
    given = config is not None
    if config is None:
        config = build_lora_config(model, r, alpha, dropout, attention)
    peft_model = _wrap(model, config, seed)
    if given:  # a user's config may reach the routers (PEFT resolves "all-linear" and "gate" to them)
        redone = _without_router_lora(peft_model)
        if redone is not None:
            peft_model = _wrap(*redone, seed)
    return peft_model


def _wrap(model: nn.Module, config, seed: int | None):
    """`get_peft_model`, with the LoRA factors drawn as `apply_lora`'s `seed` says."""
    from peft import get_peft_model

    if seed is None:
        return get_peft_model(model, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    seeded_lora_init(peft_model, seed)
    return peft_model


def _without_router_lora(peft_model) -> tuple[nn.Module, Any] | None:
    """(base model, config) to wrap again when PEFT put LoRA on the routers, else None.

    PEFT >= 0.18 resolves `target_modules="all-linear"`, and a v4-style `"gate"` target, on a transformers
    v5 MoE model to `target_parameters` that include the router's weight (`gate.weight`), wrapping the
    router in a `ParamWrapper`. occult_ft places and prunes the routers itself and trains them whole
    (`lora_targets`: `modules_to_save`), so the config PEFT resolved is taken with the router targets
    removed and the routers in `modules_to_save`, and the model (LoRA removed, `unload`) is wrapped
    again; everything else the user's config targets stays."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = unwrap_model(peft_model)
    arch = get_arch(base)
    routers = {
        f"{path}.{arch.router_attr}": getattr(block, arch.router_attr)
        for _, path, block in moe_blocks(arch, base)
    }
    wrapped = [name for name, router in routers.items() if isinstance(router, BaseTunerLayer)]
    if not wrapped:
        return None
    adapter = peft_model.active_adapter
    config = copy.deepcopy(peft_model.peft_config[adapter])
    # the routers' own module and parameter names (a wrapped router keeps its base under base_layer)
    names = set(routers) | {
        f"{path}.{name}"
        for path, router in routers.items()
        for name, _ in getattr(router, "base_layer", router).named_parameters(recurse=False)
    }

    def hits_router(target: str) -> bool:
        return any(name == target or name.endswith("." + target) for name in names)

    for field_name in ("target_modules", "target_parameters"):
        targets = getattr(config, field_name, None)
        if isinstance(targets, (set, list, tuple)):
            setattr(config, field_name, type(targets)(t for t in targets if not hits_router(t)) or None)
    prefix = f"{arch.block_attr}." if arch.block_attr else ""
    keep = list(config.modules_to_save or [])
    if not any(hits_router(t) for t in keep):
        keep.append(f"{prefix}{arch.router_attr}")
    config.modules_to_save = keep
    logger.warning(
        f"peft_config put LoRA on the routers ({wrapped[0]}, ...; PEFT resolves 'all-linear' and a 'gate' target "
        "to the router's weight on MoE models): occult_ft places and prunes the routers and trains them "
        f"whole instead (modules_to_save {keep}); the other targets are kept"
    )
    return peft_model.unload(), config


@torch.no_grad()
def seeded_lora_init(peft_model: nn.Module, seed: int) -> None:
    """Draw every `lora_A` again from a generator seeded by (`seed`, module name), with PEFT's default
    distribution (kaiming-uniform with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), so the adapter starts the
    same whatever the world size and whatever each process holds. An expert-parallel rank whose experts
    module already holds only its block of P of E experts (read sharded from disk) gets rows
    [start * r, (start + P) * r) of the full (r * E, in) draw: the factors a single process would give
    those experts. `lora_B` stays zero (PEFT's default), so the model is unchanged at start."""
    import zlib

    for name, module in unwrap_model(peft_model, keep_peft=True).named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict):
            continue
        shard = (
            getattr(base_experts(module), "occult_shard", None) if hasattr(module, "parameter_name") else None
        )
        for adapter, linear in lora_a.items():
            rows, fan_in = cast(torch.Tensor, linear.weight).shape
            start, full_rows = 0, rows
            if shard is not None and getattr(module, "occult_lora_shard", None) is None:
                per_rank = rows // shard.experts_per_device
                start, full_rows = (
                    shard.rank * shard.experts_per_device * per_rank,
                    per_rank * shard.num_experts,
                )
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}/{adapter}".encode()))
            bound = 1.0 / fan_in**0.5
            full = (torch.rand(full_rows, fan_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound
            cast(torch.Tensor, linear.weight).copy_(full[start : start + rows].to(linear.weight.dtype))


def _expert_delta_weight(self, adapter_name, *args, **kwargs) -> torch.Tensor:
    """PEFT's `ParamWrapper.get_delta_weight` of the multi-expert case, for any number of experts: with one
    expert left on a rank PEFT takes its `nn.Linear` path, a 2-D (out, in) delta that does not fit a
    (1, in, out) expert tensor (GPT-OSS's layout)."""
    a = self.lora_A[adapter_name].weight
    b = self.lora_B[adapter_name].weight
    a_ERI = a.reshape(self.num_experts, -1, a.shape[-1])
    b_ORE = b.reshape(b.shape[0], -1, self.num_experts)
    equation = "o r e, e r i -> e o i" if self._did_swap_in_out_features else "o r e, e r i -> e i o"
    delta = torch.einsum(equation, b_ORE, a_ERI) * self.scaling[adapter_name]
    param = self.get_param()
    return delta.to(param.device, param.dtype) if param.dtype.is_floating_point else delta.to(param.device)


def _keep_expert_delta(wrapper: Any) -> None:
    """A 3-D expert wrapper left with one expert computes its delta per expert, as with several."""
    if int(wrapper.num_experts) == 1 and getattr(wrapper, "_param_ndim", 3) == 3:
        wrapper.get_delta_weight = _expert_delta_weight.__get__(wrapper)


def adopt_local_expert_lora(experts: nn.Module) -> list[nn.Parameter]:
    """Mark the expert LoRA factors of an experts module that was sharded before LoRA was applied (its
    factors already cover only this rank's experts) as shards of the full-E factors, like
    `shard_expert_lora` does after cutting: `occult_lora_shard = (E, start)`, factors marked as expert
    shards. Returns the factors."""

    shard: Any = base_experts(experts).occult_shard  # an ExpertShard set by shard_experts
    factors = []
    for wrapper in expert_lora_wrappers(experts):
        wrapper.occult_lora_shard = (shard.num_experts, shard.rank * shard.experts_per_device)
        _keep_expert_delta(wrapper)
        for adapter in wrapper.lora_A.keys():
            for which in ("lora_A", "lora_B"):
                weight = getattr(wrapper, which)[adapter].weight
                weight.occult_expert_shard = True
                factors.append(weight)
    return factors


# ---- expert parallelism: the expert LoRA factors shard with the experts -----------------------------
def expert_lora_wrappers(experts: nn.Module) -> list[Any]:
    """PEFT's `ParamWrapper`s around a fused experts module, outermost first ([] without LoRA).

    PEFT nests one wrapper per targeted parameter (`experts` -> wrapper(down_proj) -> wrapper(gate_up_proj)
    -> the transformers experts module); each has `parameter_name`, `lora_A`, `lora_B` and `num_experts`.
    """
    wrappers = []
    module: Any = experts  # PEFT ParamWrappers: attributes set at run time
    while hasattr(module, "parameter_name") and isinstance(getattr(module, "base_layer", None), nn.Module):
        wrappers.append(module)
        module = module.base_layer
    return wrappers


def _factor_blocks(wrapper: Any, adapter: str, num_experts: int):
    """(A_ERI, B_ORE) views of one adapter's factors: A (r * E, in) -> (E, r, in), B (out, r * E) -> (out, r, E)."""
    a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    return a.reshape(num_experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, num_experts)


def _replace_weight(linear: nn.Linear, value: torch.Tensor, attr: str, size: int) -> nn.Parameter:
    old = linear.weight
    new = nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)
    new.occult_expert_shard = True  # type: ignore[attr-defined]
    linear.weight = new
    setattr(linear, attr, size)  # keep nn.Linear's in/out_features true to the new shape
    return new


@torch.no_grad()
def shard_expert_lora(experts: nn.Module, start: int, count: int) -> list[nn.Parameter]:
    """Cut every adapter's expert LoRA factors of one experts module to the experts [start, start + count).

    Args:
        experts: the module at `<layer>.mlp.experts` of a PEFT model (a chain of `ParamWrapper`s), holding
            the factors of all E experts.
        start / count: this rank's expert block (start = rank * P, count = P).

    Returns:
        the new factor parameters (marked `occult_expert_shard = True`, like the expert shards).
    """
    new = []
    for wrapper in expert_lora_wrappers(experts):
        num_experts = int(wrapper.num_experts)
        if getattr(wrapper, "occult_lora_shard", None) is not None:
            raise ValueError(f"{wrapper.parameter_name}: the expert LoRA factors are already sharded")
        if start < 0 or count < 1 or start + count > num_experts:
            raise ValueError(
                f"expert block [{start}, {start + count}) does not fit the {num_experts} experts of the LoRA factors"
            )
        for adapter in list(wrapper.lora_A.keys()):
            a_ERI, b_ORE = _factor_blocks(wrapper, adapter, num_experts)
            rank = a_ERI.shape[1]
            a = a_ERI[start : start + count].reshape(count * rank, a_ERI.shape[-1])
            b = b_ORE[:, :, start : start + count].reshape(b_ORE.shape[0], rank * count)
            new.append(_replace_weight(wrapper.lora_A[adapter], a, "out_features", count * rank))
            new.append(_replace_weight(wrapper.lora_B[adapter], b, "in_features", count * rank))
        wrapper.num_experts = count
        wrapper.occult_lora_shard = (num_experts, start)
        _keep_expert_delta(wrapper)
    return new


def _all_gather(tensor: torch.Tensor, group, num_devices: int) -> list[torch.Tensor]:
    if num_devices == 1:
        return [tensor.detach().clone()]
    tensor = tensor.detach().contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(num_devices)]
    dist.all_gather(pieces, tensor, group=group)
    return pieces


def gather_expert_lora(
    experts: nn.Module, group, num_devices: int
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(sharded factor, full factor) for every expert LoRA factor of one sharded experts module (collective).

    Every rank of `group` (the EP group, D = `num_devices` ranks, rank p holding expert block p) must call
    it. The full factors have the single-process layout: A (r * E, in), B (out, r * E).
    """
    out = []
    for wrapper in expert_lora_wrappers(experts):
        if getattr(wrapper, "occult_lora_shard", None) is None:
            continue
        local = int(wrapper.num_experts)
        for adapter in wrapper.lora_A.keys():
            a_PRI, b_ORP = _factor_blocks(wrapper, adapter, local)
            a_pieces = _all_gather(a_PRI, group, num_devices)
            b_pieces = _all_gather(b_ORP, group, num_devices)
            a = torch.cat(a_pieces, dim=0)  # (E, r, in)
            b = torch.cat(b_pieces, dim=2)  # (out, r, E)
            out.append((wrapper.lora_A[adapter].weight, a.reshape(-1, a.shape[-1])))
            out.append((wrapper.lora_B[adapter].weight, b.reshape(b.shape[0], -1)))
    return out


def shard_adapter_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved adapter's weights (PEFT file keys, full-E expert factors) cut to this rank's expert block.

    `model` is the sharded PEFT model; keys that are not sharded expert factors are returned unchanged.
    """
    top = unwrap_model(model, keep_peft=True)
    names = {id(p): n for n, p in top.named_parameters()}
    out = dict(weights)
    for layer in find_moe_layers(top):
        for wrapper in expert_lora_wrappers(layer.experts):
            shard = getattr(wrapper, "occult_lora_shard", None)
            if shard is None:
                continue
            num_experts, start = shard
            count = int(wrapper.num_experts)
            for adapter in wrapper.lora_A.keys():
                for which in ("lora_A", "lora_B"):
                    name = names[id(getattr(wrapper, which)[adapter].weight)]
                    key = name.replace(f".{which}.{adapter}.", f".{which}.")
                    if key not in out:
                        continue
                    full = out[key]
                    if which == "lora_A":
                        block = full.reshape(num_experts, -1, full.shape[-1])[start : start + count]
                        out[key] = block.reshape(-1, full.shape[-1])
                    else:
                        block = full.reshape(full.shape[0], -1, num_experts)[:, :, start : start + count]
                        out[key] = block.reshape(full.shape[0], -1)
    return out
