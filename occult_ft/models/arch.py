"""Router conventions: `MoEArch`, everything occult_ft knows about one HF MoE architecture, and its maths.

Every transformers 5.x MoE block of the standard family (`@use_experts_implementation`) has the same
skeleton:

    block.<router_attr>   router, forward(x_TH, *router_args) -> (logits_TE, weights_TK, topk_ids_TK)
    block.experts         fused experts, called as experts(x_TH, topk_ids_TK, weights_TK)
    block.<shared ...>    optional shared experts (always run, never routed)

What differs per architecture is how the router turns its first output (`logits_TE`, whatever the
router returns there: raw logits, soft-capped logits or already probabilities) into a *selection*
(scores whose top-k is the choice: softmax, sigmoid, the raw logits, the config's `scoring_func`, plus
an optional correction bias and group limit) and into *gate weights* for that selection
(renormalisation, a scaling factor, a per-expert scale, GPT-OSS's softmax over the k logits). Those
few facts are the fields of a `MoEArch`; the methods below are the maths, pure functions of the router
output, which the pruned router (`occult_ft.routing`), the profiler and the remote-code file call.
`occult_ft.models.selfcheck` proves them against the model's own router whenever a model is touched.

Shape legend: T tokens, E routed experts, K experts per token (top-k), G routing groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..checks import is_positive_int

__all__ = [
    "EXPERT_COUNT_FIELDS",
    "TOP_K_FIELDS",
    "NATIVE_ROUTING_FIELDS",
    "SCORINGS",
    "MoEArch",
    "UnsupportedModelError",
    "config_num_experts",
    "config_top_k",
    "decoder_layers",
    "moe_blocks",
    "text_config",
]

#: config fields that may carry a device budget natively (DeepSeek-V2/V3 group-limited routing)
NATIVE_ROUTING_FIELDS = ("n_group", "topk_group", "topk_method")
#: config fields that name the number of routed experts, by architecture
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: config fields that name the experts per token, by architecture
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")
#: how a router scores experts (see `MoEArch.scoring`)
SCORINGS = ("softmax", "sigmoid", "logits", "probs", "score_fn")


class UnsupportedModelError(ValueError):
    """Raised for a model whose `model_type` has no `MoEArch` entry, or that the registry refuses."""


def text_config(config):
    """The decoder's settings of a config object or a `config.json` dict: its `text_config` when it has
    one (multimodal models), else itself."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    inner = get("text_config")
    return inner if inner is not None else config


def _config_int(config, fields) -> int | None:
    for cfg in (config, text_config(config)):
        get = cfg.get if isinstance(cfg, dict) else lambda key, cfg=cfg: getattr(cfg, key, None)
        for key in fields:
            value = get(key)
            if isinstance(value, (list, tuple)) and value:  # per-layer values (Hunyuan): the largest
                value = max(value)
            if is_positive_int(value):
                return int(value)
    return None


def config_num_experts(config) -> int | None:
    """Routed experts per layer from a config object or a `config.json` dict (None when absent); a
    multimodal config is read through its `text_config`."""
    return _config_int(config, EXPERT_COUNT_FIELDS)


def config_top_k(config) -> int | None:
    """Experts per token from a config object or a `config.json` dict (None when absent)."""
    return _config_int(config, TOP_K_FIELDS)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(dotted path, module list) of the language model's decoder layers: `model.get_decoder().layers`
    (the language model of a multimodal model), else `model.model.layers`."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None  # type: ignore[operator]
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        decoder = getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no decoder `layers` list; is it a language model?"
        )
    path = next((name for name, module in model.named_modules() if module is decoder), "")
    return (f"{path}.layers" if path else "layers"), layers


def moe_blocks(arch: MoEArch, model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(decoder layer index, dotted path, block) of every routed MoE block of `model`'s language model:
    the decoder layers' `arch.block_attr` modules (the layers themselves when it is None) that hold
    `experts` and the router. Dense layers, vision towers and encoders are not visited."""
    prefix, layers = decoder_layers(model)
    out = []
    for index, layer in enumerate(layers):
        block: nn.Module | None = layer
        for part in (arch.block_attr or "").split(".") if arch.block_attr else ():
            block = getattr(block, part, None)
        if (
            block is None
            or not hasattr(block, "experts")
            or not isinstance(getattr(block, arch.router_attr, None), nn.Module)
        ):
            continue
        out.append((index, f"{prefix}.{index}" + (f".{arch.block_attr}" if arch.block_attr else ""), block))
    return out


def _resolve(obj, path: str):
    """`obj.a.b` for path "a.b"."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class MoEArch:
    """Everything occult_ft needs to know about one HF MoE architecture (a registry entry).

    Args:
        model_type: HF `config.model_type`, the registry key; `aliases` are further model types that
            build the same blocks (a multimodal model's `*_text` decoder, say).
        router_attr: attribute of the MoE block holding the router (`gate`, `router`).
        scoring: how the router's first output becomes per-expert scores: `softmax` (over all E),
            `sigmoid` (independent scores), `logits` (top-k on the raw logits, gate weights a softmax over
            the k selected logits: GPT-OSS, Granite), `probs` (the router returns probabilities already:
            Gemma 4) or `score_fn` (the router's own `score_fn` activation, the config's
            `scoring_func`: DeepSeek-V4). With `scoring_values`, `scoring` names a router attribute
            whose value is looked up there (Cohere2-MoE's `expert_selection_fn`).
        renormalize: `True`/`False`, or the name of a router attribute holding the flag
            (`norm_topk_prob`): the selected weights divided by their sum.
        renorm_eps: added to that sum (the model's own constant, 1e-20 for most).
        renorm_min_attr: router attribute with a floor for that sum instead (ERNIE's `norm_min`).
        scaling_attr: router attribute with a factor applied to the final weights
            (`routed_scaling_factor`), or None. A factor the block applies after the experts is part of
            the model, not of the routing, and is not named here.
        expert_scale_attr: router tensor (E,) multiplying each selected expert's weight (Gemma 4).
        correction_bias_attr: tensor added to the scores for selection only (DeepSeek-V3's
            `e_score_correction_bias`): a router attribute (dotted paths allowed), or, when `router_args`
            names it, the block attribute the block passes to its router.
        bias_on: what the correction bias is added to: `scores` (the scores above) or `logits` (the raw
            logits, Kolibri).
        router_args: block attributes the block passes to its router after the hidden states, in order
            (MiniMax-M2's `e_score_correction_bias`).
        router_input: `tokens` when the block calls its router on (T, H), `batch` on (B, S, H).
        num_experts_attr / top_k_attr: router attributes (dotted) holding E and K.
        native_group_routing: how stock transformers can express device-limited routing, if at all:
            `"topk_sum"` (DeepSeek-V3 `n_group`/`topk_group`) or `"max"` (DeepSeek-V2
            `topk_method="group_limited_greedy"`); the router's group limit is then active whenever
            its `num_group` / `topk_group` say so.
        group_score_topn: how many top scores the model's own group ranking sums (DeepSeek-V3: 2);
            `device_topk_sum` uses it so that the native fields reproduce it for every budget.
        group_mask_fill: the score the router gives experts outside its kept groups (-inf, or 0.0 where
            the model writes `masked_fill(..., 0.0)`).
        block_attr: attribute of the decoder layer holding the MoE block (`mlp`), or None when the
            decoder layer itself holds the router and the experts (Gemma 4).
        shared_attrs: attributes of the block that hold shared experts, never permuted; the first is the
            shared MLP the block calls on its tokens (`shared_mlp_attr`), a gate may follow.
        router_params: router tensors indexed by expert along dim 0, dotted paths (permuted by placement).
        block_params: block tensors indexed by expert along their last dim (a correction bias the block
            holds and passes to its router; permuted by placement).
        expert_params: experts tensors indexed by expert along dim 0 (permuted by placement, sharded by
            expert parallelism).
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
    scoring_values: tuple[tuple[str, str], ...] = ()
    renorm_eps: float = 1e-20
    renorm_min_attr: str | None = None
    expert_scale_attr: str | None = None
    bias_on: str = "scores"
    router_args: tuple[str, ...] = ()
    router_input: str = "tokens"
    num_experts_attr: str = "num_experts"
    top_k_attr: str = "top_k"
    group_mask_fill: float = float("-inf")
    block_attr: str | None = "mlp"
    block_params: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()

    def __post_init__(self):
        kinds = {value for _, value in self.scoring_values} if self.scoring_values else {self.scoring}
        bad = sorted(kinds - set(SCORINGS))
        if bad:
            raise ValueError(
                f"MoEArch({self.model_type!r}).scoring={bad[0]!r}: use one of {', '.join(SCORINGS)}"
            )
        if self.bias_on not in ("scores", "logits"):
            raise ValueError(
                f"MoEArch({self.model_type!r}).bias_on={self.bias_on!r}: use 'scores' or 'logits'"
            )
        if self.router_input not in ("tokens", "batch"):
            raise ValueError(
                f"MoEArch({self.model_type!r}).router_input={self.router_input!r}: use 'tokens' or 'batch'"
            )
        if self.native_group_routing not in (None, "topk_sum", "max"):
            raise ValueError(
                f"MoEArch({self.model_type!r}).native_group_routing={self.native_group_routing!r}: use "
                "None, 'topk_sum' or 'max'"
            )

    # ---- the convention, for people ------------------------------------------------------------------
    @property
    def shared_mlp_attr(self) -> str | None:
        """The block's shared MLP (`exchange_overlap_shared` runs it beside the combine), if any."""
        return self.shared_attrs[0] if self.shared_attrs else None

    @property
    def convention(self) -> str:
        """A short name of the router convention (tables, choosing test representatives)."""
        if self.scoring_values:
            return " or ".join(_SCORING_NAMES[v] for _, v in self.scoring_values)
        name = _SCORING_NAMES[self.scoring]
        if self.correction_bias_attr is not None:
            name += " + selection bias" + (" on logits" if self.bias_on == "logits" else "")
        if self.native_group_routing == "topk_sum":
            name += ", group-limited (top-2 sum)"
        elif self.native_group_routing == "max":
            name += ", group-limited (max)"
        if self.expert_scale_attr is not None:
            name += ", per-expert scale"
        return name

    # ---- router maths (pure functions of the router's first output) ----------------------------------
    def scoring_of(self, router: nn.Module) -> str:
        """The scoring this router uses (resolves `scoring_values` through the router attribute)."""
        if not self.scoring_values:
            return self.scoring
        value = _resolve(router, self.scoring)
        table = dict(self.scoring_values)
        if value not in table:
            raise ValueError(
                f"{self.model_type}: router {self.scoring}={value!r} is not one of {sorted(table)}; "
                "add it to the registry entry's scoring_values"
            )
        return table[value]

    def probabilities(self, router: nn.Module, logits_TE: torch.Tensor) -> torch.Tensor:
        """Per-expert router probabilities in fp32 (what "router mass" and similarity are measured in)."""
        scoring = self.scoring_of(router)
        x_TE = logits_TE.float()
        if scoring == "sigmoid":
            return x_TE.sigmoid()
        if scoring == "probs":
            return x_TE
        if scoring == "score_fn":
            return router.score_fn(x_TE).float()  # type: ignore[operator]
        return torch.softmax(x_TE, dim=-1)

    def call_inputs(self, args: tuple, kwargs: dict) -> tuple:
        """The router call's inputs after the hidden states, in `router_args` order (positional or by name)."""
        out = list(args[: len(self.router_args)])
        out += [kwargs.get(name) for name in self.router_args[len(out) :]]
        return tuple(out)

    def correction_bias(self, router: nn.Module, inputs: tuple = ()) -> torch.Tensor | None:
        """(E,) fp32 selection bias, or None. `inputs` are the router call's arguments after the hidden
        states (where `router_args` puts a bias the block holds)."""
        if self.correction_bias_attr is None:
            return None
        if self.correction_bias_attr in self.router_args:
            i = self.router_args.index(self.correction_bias_attr)
            bias = inputs[i] if i < len(inputs) else None
        else:
            bias = _resolve(router, self.correction_bias_attr)
        return None if bias is None else bias.float().reshape(-1)

    def selection_scores(
        self, router: nn.Module, logits_TE: torch.Tensor, inputs: tuple = ()
    ) -> torch.Tensor:
        """Scores whose top-k is the model's expert choice (fp32, higher is better)."""
        if self.scoring_of(router) == "logits" or self.bias_on == "logits":
            scores_TE = logits_TE.float()
        else:
            scores_TE = self.probabilities(router, logits_TE)
        bias_E = self.correction_bias(router, inputs)
        return scores_TE if bias_E is None else scores_TE + bias_E.to(scores_TE.device)

    def gate_weights(
        self, router: nn.Module, logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, inputs: tuple = ()
    ) -> torch.Tensor:
        """The model's own gate weights for an arbitrary selection `topk_ids_TK` (fp32)."""
        if self.scoring_of(router) == "logits":
            weights_TK = torch.softmax(logits_TE.float().gather(1, topk_ids_TK), dim=-1)
        else:
            weights_TK = self.probabilities(router, logits_TE).gather(1, topk_ids_TK)
            renorm = self.renormalize
            if isinstance(renorm, str):
                renorm = bool(_resolve(router, renorm))
            if renorm:
                total_T1 = weights_TK.sum(dim=-1, keepdim=True)
                if self.renorm_min_attr is not None:
                    total_T1 = total_T1.clamp(min=float(_resolve(router, self.renorm_min_attr)))
                else:
                    total_T1 = total_T1 + self.renorm_eps
                weights_TK = weights_TK / total_T1
        if self.scaling_attr is not None:
            weights_TK = weights_TK * float(_resolve(router, self.scaling_attr))
        if self.expert_scale_attr is not None:
            scale_E = _resolve(router, self.expert_scale_attr).float().reshape(-1)
            weights_TK = weights_TK * scale_E.to(weights_TK.device)[topk_ids_TK]
        return weights_TK

    def routing_group_size(self, router: nn.Module) -> int:
        """Experts per routing group when the router's own group-limited routing is active
        (DeepSeek-V3 `n_group`/`topk_group`, DeepSeek-V2 `group_limited_greedy`), else 1. Such a
        router scores contiguous blocks of this size, so a placement may move whole blocks only."""
        if self.native_group_routing is None:
            return 1
        num_group, topk_group = (
            getattr(router, "num_group", None) or 0,
            getattr(router, "topk_group", None) or 0,
        )
        active = bool(num_group) and bool(topk_group) and 1 < num_group and topk_group < num_group
        if self.native_group_routing == "max":
            active = active and getattr(router, "topk_method", None) == "group_limited_greedy"
        return self.num_experts(router) // int(num_group) if active else 1

    def selectable(self, router: nn.Module, scores_TE: torch.Tensor) -> torch.Tensor | None:
        """(T, E) bool: the experts of the groups the model's own group-limited router allows each token,
        recomputed from the selection scores exactly as the router does; None without a group limit."""
        size = self.routing_group_size(router)
        if size == 1:
            return None
        t, e = scores_TE.shape
        grouped_TGS = scores_TE.view(t, e // size, size)
        if self.native_group_routing == "topk_sum":
            group_TG = grouped_TGS.topk(min(self.group_score_topn or 2, size), dim=-1).values.sum(dim=-1)
        else:
            group_TG = grouped_TGS.max(dim=-1).values
        keep = group_TG.topk(int(router.topk_group), dim=-1).indices  # type: ignore[arg-type]
        mask_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, keep, True)
        return mask_TG.repeat_interleave(size, dim=1)

    def route(self, router: nn.Module, logits_TE: torch.Tensor, inputs: tuple = ()):
        """The registry's prediction of the router's own choice: (topk_ids_TK, weights_TK fp32,
        selection scores_TE as the router ranks them, group mask included)."""
        scores_TE = self.selection_scores(router, logits_TE, inputs)
        mask_TE = self.selectable(router, scores_TE)
        if mask_TE is not None:
            scores_TE = scores_TE.masked_fill(~mask_TE, self.group_mask_fill)
        ids_TK = scores_TE.topk(self.top_k(router), dim=-1).indices
        return ids_TK, self.gate_weights(router, logits_TE, ids_TK, inputs), scores_TE

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
        """Write `native_group_fields` into `config` (in place; its `text_config` for a multimodal one);
        returns True when it did."""
        fields = self.native_group_fields(config_num_experts(config), pruning)
        target = text_config(config)
        for key, value in (fields or {}).items():
            setattr(target, key, value)
        return fields is not None

    def native_routing_matches(self, config: dict, pruning) -> bool:
        """Whether a saved `config.json` (a dict) routes with `pruning`'s budget by itself."""
        fields = self.native_group_fields(config_num_experts(config), pruning)
        inner = text_config(config)
        return fields is not None and all(inner.get(k) == v for k, v in fields.items())

    def set_group_fields(self, model: nn.Module, fields: dict) -> None:
        """Give a built model other group-routing settings (`NATIVE_ROUTING_FIELDS` -> value): its config
        (`text_config` for a multimodal one) and every MoE router, which copied them when it was built
        (`n_group` is the routers' `num_group`). How occult_ft's loaders put back the model's own
        fields that a checkpoint's native budget fields replaced (`OccultBlock.base_routing`)."""
        target = text_config(model.config)
        routers = [getattr(block, self.router_attr) for _, _, block in moe_blocks(self, model)]
        for key, value in fields.items():
            setattr(target, key, value)
            attr = "num_group" if key == "n_group" else key
            for router in routers:
                if hasattr(router, attr):
                    setattr(router, attr, value)

    def num_experts(self, router: nn.Module) -> int:
        return int(_resolve(router, self.num_experts_attr))

    def top_k(self, router: nn.Module) -> int:
        return int(_resolve(router, self.top_k_attr))


_SCORING_NAMES = {
    "softmax": "softmax top-k",
    "sigmoid": "sigmoid top-k",
    "logits": "top-k on logits, softmax over k",
    "probs": "softmax top-k (router returns probabilities)",
    "score_fn": "scoring_func top-k",
}
