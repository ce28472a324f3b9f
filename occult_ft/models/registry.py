"""The architecture registry: the only place in occult_ft that knows HF module paths and router maths.

Every supported transformers 5.x MoE block has the same skeleton (see the facts note):

    block.<router_attr>   router module, forward(x_TH) -> (logits_TE, weights_TK, topk_ids_TK)
    block.experts         fused experts: gate_up_proj (E, 2I, H) [GPT-OSS: (E, H, 2I) + biases], down_proj
    block.<shared ...>    optional shared experts (always run, never routed)

What differs per architecture is written once here, as a `MoEArch` entry keyed by HF `model_type`:
the router attribute, how the router scores experts for *selection* (softmax / sigmoid + correction
bias / raw logits) and how it turns the selected experts into *gate weights* (renormalisation,
`routed_scaling_factor`, GPT-OSS's softmax over the k logits). The routing criteria in
`occult_ft.routing` only ever call `selection_scores`, `probabilities` and `gate_weights`.

Shape legend: T tokens, E routed experts, K experts per token (top-k), H hidden size.

Adding an architecture: build one `MoEArch(...)` below and pass it to `register_arch`; the
table-driven tests in `tests/test_models.py` then cover it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "MoEArch",
    "MoELayer",
    "UnsupportedModelError",
    "register_arch",
    "get_arch",
    "lookup_arch",
    "config_num_experts",
    "NATIVE_ROUTING_FIELDS",
    "supported_model_types",
    "find_moe_layers",
    "unwrap_model",
    "tiny_config",
]


#: config fields that may carry a device budget natively (DeepSeek-V2/V3 group-limited routing)
NATIVE_ROUTING_FIELDS = ("n_group", "topk_group", "topk_method")
#: config fields that name the number of routed experts, by architecture
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def config_num_experts(config) -> int | None:
    """Routed experts per layer from a config object or a `config.json` dict (None when absent)."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return next((int(get(k)) for k in EXPERT_COUNT_FIELDS if get(k)), None)


class UnsupportedModelError(ValueError):
    """Raised for a model whose `model_type` has no `MoEArch` entry."""


@dataclass(frozen=True)
class MoEArch:
    """Everything occult_ft needs to know about one HF MoE architecture.

    Args:
        model_type: HF `config.model_type`, the registry key.
        router_attr: attribute of the MoE block holding the router (`gate` or `router`).
        scoring: `softmax` (probabilities over all E), `sigmoid` (independent scores, DeepSeek-V3) or
            `logits` (GPT-OSS: top-k on raw logits, softmax over the k selected logits only).
        renormalize: `True`/`False`, or the name of a router attribute holding the flag
            (`norm_topk_prob`).
        scaling_attr: router attribute with a factor applied to the final weights
            (`routed_scaling_factor`), or None.
        correction_bias_attr: router buffer added to the scores for selection only (DeepSeek-V3).
        shared_attrs: attributes of the block that hold shared experts (informational, never permuted).
        router_params: router tensors indexed by expert along dim 0 (permuted by placement).
        expert_params: experts tensors indexed by expert along dim 0 (permuted by placement).
        native_group_routing: how stock transformers can express device-limited routing, if at all:
            `"topk_sum"` (DeepSeek-V3 `n_group`/`topk_group`) or `"max"` (DeepSeek-V2
            `topk_method="group_limited_greedy"`).
        group_score_topn: how many top scores the model's own group ranking sums (DeepSeek-V3: 2);
            `device_topk_sum` uses it so that the native fields reproduce it for every budget.
        example_config: kwargs for a tiny random config of this type (tests, docs).
    """

    model_type: str
    router_attr: str
    scoring: str
    renormalize: bool | str
    scaling_attr: str | None = None
    correction_bias_attr: str | None = None
    shared_attrs: tuple[str, ...] = ()
    router_params: tuple[str, ...] = ("weight",)
    expert_params: tuple[str, ...] = ("gate_up_proj", "down_proj")
    native_group_routing: str | None = None
    group_score_topn: int | None = None
    example_config: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid", "logits"):
            raise ValueError(
                f"MoEArch({self.model_type!r}).scoring={self.scoring!r}: use 'softmax', 'sigmoid' or 'logits'"
            )

    # ---- router maths (pure functions of the router's logits) -------------------------------------
    def probabilities(self, router: nn.Module, logits_TE: torch.Tensor) -> torch.Tensor:
        """Per-expert router probabilities in fp32 (what "router mass" and similarity are measured in)."""
        if self.scoring == "sigmoid":
            return logits_TE.float().sigmoid()
        return torch.softmax(logits_TE.float(), dim=-1)

    def selection_scores(self, router: nn.Module, logits_TE: torch.Tensor) -> torch.Tensor:
        """Scores whose top-k is the model's expert choice (fp32, higher is better)."""
        if self.scoring == "logits":
            return logits_TE.float()
        scores = self.probabilities(router, logits_TE)
        if self.correction_bias_attr is not None:
            scores = scores + getattr(router, self.correction_bias_attr).float()
        return scores

    def gate_weights(
        self, router: nn.Module, logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor
    ) -> torch.Tensor:
        """The model's own gate weights for an arbitrary selection `topk_ids_TK` (fp32)."""
        if self.scoring == "logits":
            return torch.softmax(logits_TE.float().gather(1, topk_ids_TK), dim=-1)
        weights = self.probabilities(router, logits_TE).gather(1, topk_ids_TK)
        renorm = self.renormalize
        if isinstance(renorm, str):
            renorm = bool(getattr(router, renorm))
        if renorm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_attr is not None:
            weights = weights * float(getattr(router, self.scaling_attr))
        return weights

    def routing_group_size(self, router: nn.Module) -> int:
        """Experts per routing group when the router's own group-limited routing is active
        (DeepSeek-V3 `n_group`/`topk_group`, DeepSeek-V2 `group_limited_greedy`), else 1. Such a
        router scores contiguous blocks of this size, so a placement may move whole blocks only."""
        if self.native_group_routing is None:
            return 1
        num_group, topk_group = getattr(router, "num_group", None), getattr(router, "topk_group", None)
        active = bool(num_group) and bool(topk_group) and 1 < num_group and topk_group < num_group
        if self.native_group_routing == "max":
            active = active and getattr(router, "topk_method", None) == "group_limited_greedy"
        return self.num_experts(router) // int(num_group) if active else 1

    # ---- native routing fields (how a budget is written in the model's own config) ----------------
    def native_group_fields(self, num_experts: int | None, pruning) -> dict | None:
        """The config fields with which stock transformers routes under `pruning` by itself, or None.

        Stock group-limited routing has one level of groups, so exactly one budget may be active:
        - DeepSeek-V3 (`"topk_sum"`): groups ranked by the sum of their top-2 scores and the top-k taken
          inside the kept groups, which is `device_topk_sum` (needs at least 2 experts per group): a
          device budget M gives `n_group=D, topk_group=M`; a node budget alone gives
          `n_group=N, topk_group=max_nodes_per_token`.
        - DeepSeek-V2 (`"max"`): groups ranked by their best score, which is `device_max` / `score` for a
          device budget: `topk_method="group_limited_greedy", n_group=D, topk_group=M`.

        Args:
            num_experts: E (from the config); pruning: a `PruningConfig` (duck-typed) or None.
        """
        if pruning is None or not pruning.active or self.native_group_routing is None:
            return None
        d, n = pruning.num_devices, pruning.num_nodes
        device_on = pruning.max_devices_per_token is not None and pruning.max_devices_per_token < d
        node_on = pruning.max_nodes_per_token is not None and pruning.max_nodes_per_token < n
        if device_on == node_on:  # both or neither: one level of groups cannot express it
            return None
        groups, keep = (d, pruning.max_devices_per_token) if device_on else (n, pruning.max_nodes_per_token)
        per_group = (num_experts or 0) // groups
        if (
            self.native_group_routing == "topk_sum"
            and pruning.criterion == "device_topk_sum"
            and per_group >= 2
        ):
            return {"n_group": groups, "topk_group": int(keep)}
        if self.native_group_routing == "max" and device_on and pruning.criterion in ("device_max", "score"):
            return {"topk_method": "group_limited_greedy", "n_group": d, "topk_group": int(keep)}
        return None

    def write_native_routing(self, config, pruning) -> bool:
        """Write `native_group_fields` into `config` (in place); returns True when it did."""
        fields = self.native_group_fields(config_num_experts(config), pruning)
        for key, value in (fields or {}).items():
            setattr(config, key, value)
        return fields is not None

    def native_routing_matches(self, config: dict, pruning) -> bool:
        """Whether a saved `config.json` (a dict) routes with `pruning`'s budget by itself."""
        fields = self.native_group_fields(config_num_experts(config), pruning)
        return fields is not None and all(config.get(k) == v for k, v in fields.items())

    def num_experts(self, router: nn.Module) -> int:
        return int(router.num_experts)

    def top_k(self, router: nn.Module) -> int:
        return int(router.top_k)


@dataclass(frozen=True)
class MoELayer:
    """One MoE block of a model, found by `find_moe_layers`.

    Args:
        index: index of the decoder layer (`model.layers[index]`), stable across save/reload.
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


_REGISTRY: dict[str, MoEArch] = {}


def register_arch(arch: MoEArch) -> MoEArch:
    """Add an architecture to the registry; a second entry for one `model_type` is an error."""
    if arch.model_type in _REGISTRY:
        raise ValueError(f"model_type {arch.model_type!r} is already registered; edit its entry instead")
    _REGISTRY[arch.model_type] = arch
    return arch


def lookup_arch(model_type: str | None) -> MoEArch | None:
    """The registered `MoEArch` of `model_type`, or None (for readers of saved configs)."""
    return _REGISTRY.get(model_type) if model_type else None


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def _model_type_of(obj) -> str:
    if isinstance(obj, str):
        return obj
    config = getattr(obj, "config", obj)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(obj).__name__} has no config.model_type; pass a transformers model"
        )
    return model_type


def get_arch(obj) -> MoEArch:
    """The `MoEArch` for a model, a config or a `model_type` string.

    Raises:
        UnsupportedModelError: naming the type, the supported ones and how to add one.
    """
    model_type = _model_type_of(obj)
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}. "
            "To add one, register a MoEArch in occult_ft/models/registry.py (see its docstring)"
        ) from None


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed engine / accelerate (`.module`) and PEFT (`.get_base_model()`) wrappers,
    down to the transformers `PreTrainedModel`."""
    from transformers import PreTrainedModel

    for _ in range(8):
        if isinstance(model, PreTrainedModel):
            break
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
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
        if active in to_save:
            return to_save[active]
        return next(iter(to_save.values()))
    return module


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every routed MoE block of `model`, in layer order (dense layers such as DeepSeek's
    `first_k_dense_replace` or Qwen's `mlp_only_layers` are skipped).

    Raises:
        UnsupportedModelError: for an unregistered model type, or a registered one with no MoE layer.
    """
    base = unwrap_model(model)
    arch = get_arch(base)
    layers: list[MoELayer] = []
    for name, module in base.named_modules():
        if (
            not name.endswith(".mlp")
            or not hasattr(module, "experts")
            or not hasattr(module, arch.router_attr)
        ):
            continue
        parts = name.split(".")
        index = next((int(p) for p in reversed(parts) if p.isdigit()), len(layers))
        router = _active_module(getattr(module, arch.router_attr))
        layers.append(MoELayer(index, name, module, router, module.experts, arch))
    if not layers:
        raise UnsupportedModelError(
            f"found no MoE block (an `.mlp` with `{arch.router_attr}` and `experts`) in this "
            f"{arch.model_type} model; is it a dense configuration?"
        )
    layers.sort(key=lambda layer: layer.index)
    return layers


# ---- the supported architectures --------------------------------------------------------------
_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

register_arch(
    MoEArch(
        "mixtral",
        router_attr="gate",
        scoring="softmax",
        renormalize=True,
        example_config=dict(_TINY, num_local_experts=8, num_experts_per_tok=2),
    )
)
register_arch(
    MoEArch(
        "qwen2_moe",
        router_attr="gate",
        scoring="softmax",
        renormalize="norm_topk_prob",
        shared_attrs=("shared_expert", "shared_expert_gate"),
        example_config=dict(
            _TINY,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
        ),
    )
)
register_arch(
    MoEArch(
        "qwen3_moe",
        router_attr="gate",
        scoring="softmax",
        renormalize="norm_topk_prob",
        example_config=dict(
            _TINY,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=16,
        ),
    )
)
register_arch(
    MoEArch(
        "olmoe",
        router_attr="gate",
        scoring="softmax",
        renormalize="norm_topk_prob",
        example_config=dict(_TINY, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    )
)
# DeepSeek-V2/V3 at tiny width: MLA attention, one shared expert, the first layer dense
_TINY_DEEPSEEK = dict(
    _TINY,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_hidden_layers=3,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
)
register_arch(
    MoEArch(
        "deepseek_v2",
        router_attr="gate",
        scoring="softmax",
        renormalize=False,
        scaling_attr="routed_scaling_factor",
        shared_attrs=("shared_experts",),
        native_group_routing="max",
        example_config=dict(
            _TINY_DEEPSEEK,
            routed_scaling_factor=1.5,
            topk_method="greedy",
            n_group=None,
            topk_group=None,
        ),
    )
)
register_arch(
    MoEArch(
        "deepseek_v3",
        router_attr="gate",
        scoring="sigmoid",
        renormalize="norm_topk_prob",
        scaling_attr="routed_scaling_factor",
        correction_bias_attr="e_score_correction_bias",
        shared_attrs=("shared_experts",),
        router_params=("weight", "e_score_correction_bias"),
        native_group_routing="topk_sum",
        group_score_topn=2,
        example_config=dict(
            _TINY_DEEPSEEK,
            routed_scaling_factor=2.5,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
        ),
    )
)
register_arch(
    MoEArch(
        "gpt_oss",
        router_attr="router",
        scoring="logits",
        renormalize=True,
        router_params=("weight", "bias"),
        expert_params=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
        example_config=dict(
            _TINY,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            layer_types=["full_attention", "sliding_attention"],
            sliding_window=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    )
)


def tiny_config(model_type: str, **overrides):
    """A tiny random config of a registered type (hidden 64, 8 experts): for tests and docs."""
    from transformers import AutoConfig

    kwargs = dict(get_arch(model_type).example_config)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)
