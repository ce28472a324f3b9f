"""The architecture registry: the only place in occult_ft that knows HF module paths and router maths.

Every model type of the transformers MoE family (`occult_ft.models.family.moe_family`) is either
registered here with a `MoEArch` (its router convention, `occult_ft.models.arch`; the entries are in
`occult_ft.models.entries`) or refused with one line that says what is missing. `get_arch` answers for
a model, a config or a model type before any weight loads; `find_moe_layers` finds the routed MoE blocks
of a built model (the language model's decoder layers; dense layers are skipped) and, the first time it
sees a model with real weights, runs the router self-check (`occult_ft.models.selfcheck`): the registry's
maths and the model's own router must choose the same experts with the same gate weights.

Shape legend: T tokens, E routed experts, K experts per token (top-k), H hidden size.

Adding an architecture: write one `MoEArch(...)` in `entries.py` (a few fields: the router attribute,
its scoring, renormalisation, scaling, correction bias, group routing; see `MoEArch`), a tiny config in
`tiny.py`, and run `tests/test_family.py`: the self-check tells whether the fields are right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .arch import (
    EXPERT_COUNT_FIELDS,
    NATIVE_ROUTING_FIELDS,
    TOP_K_FIELDS,
    MoEArch,
    UnsupportedModelError,
    config_num_experts,
    config_top_k,
    moe_blocks,
    text_config,
)
from .entries import CORE_MODEL_TYPES, ENTRIES, REFUSED
from .family import loads_as
from .selfcheck import check_model_routing
from .tiny import tiny_config

__all__ = [
    "MoEArch",
    "MoELayer",
    "UnsupportedModelError",
    "base_experts",
    "register_arch",
    "refuse_model_type",
    "get_arch",
    "lookup_arch",
    "refusal",
    "config_num_experts",
    "config_top_k",
    "text_config",
    "EXPERT_COUNT_FIELDS",
    "TOP_K_FIELDS",
    "NATIVE_ROUTING_FIELDS",
    "CORE_MODEL_TYPES",
    "supported_model_types",
    "refused_model_types",
    "representative_model_types",
    "find_moe_layers",
    "moe_layer_indices",
    "unwrap_model",
    "tiny_config",
]


@dataclass(frozen=True)
class MoELayer:
    """One MoE block of a model, found by `find_moe_layers`.

    Args:
        index: index of the decoder layer (`decoder.layers[index]`), stable across save/reload.
        name: dotted module path of the MoE block (e.g. `model.layers.3.mlp`).
        block, router, experts: the modules themselves (router resolved through PEFT wrappers).
    """

    index: int
    name: str
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    arch: MoEArch

    @property
    def num_experts(self) -> int:
        return self.arch.num_experts(self.router)

    @property
    def top_k(self) -> int:
        return self.arch.top_k(self.router)

    def moe_parameters(self) -> list[nn.Parameter]:
        """The parameters of the MoE part of the layer: the whole block (router, routed and shared
        experts), or, where the decoder layer itself holds router and experts (Gemma 4), those two and
        the shared modules the entry names."""
        if self.arch.block_attr is not None:
            return list(self.block.parameters())
        modules = [getattr(self.block, self.arch.router_attr), self.experts]
        modules += [getattr(self.block, name) for name in self.arch.shared_attrs if hasattr(self.block, name)]
        return [p for module in modules for p in module.parameters()]

    def router_inputs(self) -> tuple:
        """What the block passes to its router after the hidden states (`MoEArch.router_args`)."""
        return tuple(getattr(self.block, name, None) for name in self.arch.router_args)

    def expert_tensors(self) -> list[tuple[str, str, int]]:
        """Every tensor of the layer indexed by expert: (kind, dotted path under the block, expert dim),
        kind one of `router`, `block`, `experts`; the expert dim is 0, or the last one for a router or
        block vector stored as (1, E) (ERNIE's bias). Tensors the config leaves out (a bias) are skipped."""
        out = []
        groups = (
            ("router", self.arch.router_params, self.router, f"{self.arch.router_attr}."),
            ("block", self.arch.block_params, self.block, ""),
            ("experts", self.arch.expert_params, base_experts(self.experts), "experts."),
        )
        for kind, names, owner, prefix in groups:
            for name in names:
                tensor = _tensor_at(owner, name)
                if tensor is not None:
                    last = kind != "experts" and tensor.dim() > 1 and tensor.shape[0] == 1
                    out.append((kind, prefix + name, tensor.dim() - 1 if last else 0))
        return out

    def tensor(self, path: str) -> torch.Tensor:
        """The tensor at a path of `expert_tensors` (the active router copy under PEFT)."""
        head, _, rest = path.partition(".")
        if head == self.arch.router_attr and rest:
            found = _tensor_at(self.router, rest)
        elif head == "experts" and rest:
            found = _tensor_at(base_experts(self.experts), rest)
        else:
            found = _tensor_at(self.block, path)
        if found is None:
            raise KeyError(f"layer {self.index} has no tensor {path!r}; pass a path of expert_tensors()")
        return found


def base_experts(experts: nn.Module) -> nn.Module:
    """The transformers experts module inside PEFT's `ParamWrapper`s (`experts` itself without LoRA)."""
    while hasattr(experts, "parameter_name") and isinstance(getattr(experts, "base_layer", None), nn.Module):
        experts = cast(nn.Module, experts.base_layer)
    return experts


def _tensor_at(owner: nn.Module, path: str) -> torch.Tensor | None:
    obj: Any = owner
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


# ---- the registry -----------------------------------------------------------------------------------
_REGISTRY: dict[str, MoEArch] = {}
_BY_NAME: dict[str, MoEArch] = {}  # model types and aliases
_REFUSED: dict[str, str] = {}


def register_arch(arch: MoEArch) -> MoEArch:
    """Add an architecture to the registry; a second entry for one `model_type` (or alias) is an error."""
    for name in (arch.model_type, *arch.aliases):
        if name in _BY_NAME or name in _REFUSED:
            raise ValueError(f"model_type {name!r} is already registered; edit its entry instead")
    _REGISTRY[arch.model_type] = arch
    for name in (arch.model_type, *arch.aliases):
        _BY_NAME[name] = arch
    return arch


def refuse_model_type(model_type: str, reason: str) -> None:
    """Record that `model_type` is refused, and why (`"<model_type>: <reason>"` is the error line)."""
    if model_type in _BY_NAME or model_type in _REFUSED:
        raise ValueError(f"model_type {model_type!r} is already registered; edit its entry instead")
    _REFUSED[model_type] = reason


for _arch in ENTRIES:
    register_arch(_arch)
for _model_type, _reason in REFUSED.items():
    refuse_model_type(_model_type, _reason)


def lookup_arch(model_type: str | None) -> MoEArch | None:
    """The registered `MoEArch` of `model_type` (or of a type it aliases), or None."""
    return _BY_NAME.get(model_type) if model_type else None


def refusal(model_type: str) -> str | None:
    """The one-line reason a model type is refused (`"phimoe: sparsemixer routing ..."`), or None."""
    reason = _REFUSED.get(model_type)
    return None if reason is None else f"{model_type}: {reason}"


def supported_model_types() -> list[str]:
    """Every model type occult_ft supports (entries and their aliases), sorted."""
    return sorted(_BY_NAME)


def refused_model_types() -> dict[str, str]:
    """model type -> why it is refused."""
    return dict(sorted(_REFUSED.items()))


def representative_model_types() -> dict[str, str]:
    """One supported model type per router convention (`MoEArch.convention` -> model type), the first
    of: a core type, a text-only causal LM (a multimodal entry's `*_text` alias before the entry
    itself), any other type; ties broken by name."""

    def rank(name: str) -> tuple:
        has_text_alias = name in _REGISTRY and any(
            loads_as(a) == "causal_lm" for a in _REGISTRY[name].aliases
        )
        return (name not in CORE_MODEL_TYPES, loads_as(name) != "causal_lm", has_text_alias, name)

    out: dict[str, str] = {}
    for name in sorted(_BY_NAME, key=rank):
        out.setdefault(_BY_NAME[name].convention, name)
    return out


def _model_type_of(obj) -> str:
    if isinstance(obj, str):
        return obj
    config = getattr(obj, "config", obj)
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(obj).__name__} has no config.model_type; pass a transformers model"
        )
    return model_type


def get_arch(obj) -> MoEArch:
    """The `MoEArch` for a model, a config (object or config.json dict) or a `model_type` string.

    Raises:
        UnsupportedModelError: one line naming the type and what is missing (a refused type), or, for an
            unknown one, the supported types and how to add one.
    """
    model_type = _model_type_of(obj)
    arch = _BY_NAME.get(model_type)
    if arch is not None:
        return arch
    line = refusal(model_type)
    if line is not None:
        raise UnsupportedModelError(line)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}. "
        "To add one, register a MoEArch in occult_ft/models/entries.py (see occult_ft/models/registry.py)"
    )


def unwrap_model(model: nn.Module, keep_peft: bool = False) -> nn.Module:
    """The model inside its wrappers: the one walker of occult_ft.

    Strips, outermost first, DDP / DeepSpeed engine / accelerate wrappers (`.module`) and, unless
    `keep_peft`, a PEFT model (`PeftModel.get_base_model()`); stops at the transformers
    `PreTrainedModel`, or at whatever has no wrapper left (returned as it is, `None` included).

    Args:
        model: a model, wrapped or not.
        keep_peft: stop at a PEFT model (`peft_config`) instead: the module whose parameter names DDP
            and PEFT's saved adapters use. A model without PEFT unwraps as with False.
    """
    from transformers import PreTrainedModel

    for _ in range(8):  # DDP(PeftModel(model)) is the deepest stack seen; 8 bounds a wrapper cycle
        if isinstance(model, PreTrainedModel) or (keep_peft and hasattr(model, "peft_config")):
            break
        get_base_model = getattr(model, "get_base_model", None)  # PEFT's PeftModel
        if callable(get_base_model):
            model = get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = cast(nn.Module, model.module)
        else:
            break
    return model


def _active_module(module: nn.Module) -> nn.Module:
    """Resolve a PEFT `ModulesToSaveWrapper` to the copy that the forward pass actually runs."""
    to_save = getattr(module, "modules_to_save", None)
    if isinstance(to_save, nn.ModuleDict) and len(to_save) > 0:
        active = getattr(module, "active_adapter", None)
        if isinstance(active, (list, tuple)):
            active = active[0] if active else None
        if isinstance(active, str) and active in to_save:
            return to_save[active]
        return next(iter(to_save.values()))
    return module


def find_moe_layers(model: nn.Module, check: bool = True) -> list[MoELayer]:
    """Every routed MoE block of the language model of `model`, in layer order (dense layers such as
    DeepSeek's `first_k_dense_replace` or Qwen's `mlp_only_layers` are skipped).

    The first call on a model with real weights runs the router self-check
    (`occult_ft.models.selfcheck.check_model_routing`, cached on the model; `check=False` skips it).

    Raises:
        UnsupportedModelError: for an unregistered or refused model type, or a registered one with no
            MoE layer.
        RouterCheckError: when the model's own router disagrees with its registry entry.
    """
    base = unwrap_model(model)
    arch = get_arch(base)
    layers = [
        MoELayer(
            index,
            name,
            block,
            _active_module(getattr(block, arch.router_attr)),
            cast(nn.Module, block.experts),
            arch,
        )
        for index, name, block in moe_blocks(arch, base)
    ]
    if not layers:
        raise UnsupportedModelError(
            f"found no MoE block (`{arch.block_attr or 'the decoder layer'}` with `{arch.router_attr}` and "
            f"`experts`) in this {arch.model_type} model; is it a dense configuration?"
        )
    if check:
        check_model_routing(base, layers)
    return layers


def moe_layer_indices(config) -> list[int]:
    """The decoder layers of `config` (object or config.json dict) that hold routed experts, from the
    config alone (a multimodal config is read through `text_config`). A layer is dense when any of the
    dense-layer fields the family uses says so:

        first_k_dense_replace / num_dense_layers   the first k layers (DeepSeek, GLM, AFMoE, LFM2)
        mlp_only_layers                            listed layers (Qwen)
        decoder_sparse_step s                      all but every s-th layer (Qwen: (i + 1) % s == 0 is MoE)
        moe_layer_start_index / _end_index / _interval   ERNIE 4.5's window and stride
        moe_layer_freq                             an int stride or a 0/1 list (DeepSeek-style configs)
        mlp_layer_types / layers_block_type        per-layer kinds, "sparse" or "moe" are MoE: when the config
                                                   has such a list it alone decides
        layers_num_experts                         per-layer expert counts, MoE above 1 (Jamba): the same
        enable_moe_block = False, 0 experts        no MoE layer at all
    """
    cfg = text_config(config)
    get: Callable[[str], Any] = cfg.get if isinstance(cfg, dict) else lambda key: getattr(cfg, key, None)
    n = int(get("num_hidden_layers"))
    if get("enable_moe_block") is False or config_num_experts(cfg) in (None, 0):
        return []
    for key in ("mlp_layer_types", "layers_block_type"):  # an explicit per-layer list decides alone
        kinds = get(key)
        moe = (
            [str(kind).lower() in ("sparse", "moe") for kind in kinds]
            if isinstance(kinds, (list, tuple))
            else []
        )
        if any(moe):  # lists of attention / mamba kinds say nothing about the MLPs
            return [i for i, on in enumerate(moe) if on]
    counts = get("layers_num_experts")
    if isinstance(counts, (list, tuple)):
        return [i for i, count in enumerate(counts) if count and count > 1]
    dense: set[int] = set()
    for key in ("first_k_dense_replace", "num_dense_layers"):
        dense |= set(range(int(get(key) or 0)))
    dense |= set(get("mlp_only_layers") or ())
    step = get("decoder_sparse_step")
    if isinstance(step, int) and step > 1:
        dense |= {i for i in range(n) if (i + 1) % step}
    if get("moe_layer_start_index") is not None:
        start, end = int(get("moe_layer_start_index")), get("moe_layer_end_index")
        end = n - 1 if end is None or int(end) < 0 else int(end)
        interval = int(get("moe_layer_interval") or 1)
        dense |= {i for i in range(n) if not ((i + 1) % interval == 0 and start <= i <= end)}
    freq = get("moe_layer_freq")
    if isinstance(freq, int) and freq > 1:
        dense |= {i for i in range(n) if i % freq}
    elif isinstance(freq, (list, tuple)):
        dense |= {i for i, on in enumerate(freq) if not on}
    return [i for i in range(n) if i not in dense]
