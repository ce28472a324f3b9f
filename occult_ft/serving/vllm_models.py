"""vLLM model classes that serve a pruned checkpoint with its pruned routing (imported by vLLM only).

`vllm_plugin.register` registers, for each served model type, one subclass of vLLM's own model class
under two names: `Occult<Base>` (what a checkpoint whose budget stock loaders cannot route names in
its `architectures`, so stock vLLM refuses it) and `<Base>` itself (checkpoints of earlier releases
carry the stock name; a checkpoint without an active budget is served exactly as stock vLLM would).

After vLLM's own `__init__`, `install_routing` replaces the router of every `MoERunner` (vLLM's
FusedMoE pipeline) by an `OccultRouter` that computes the weights and expert ids from the router
logits with `occult_ft.serving.ServedRouting` (occult_ft's registry maths and pruning rules; nothing
copied). The experts kernels, the shared experts and vLLM's expert-parallel sharding are untouched:
the checkpoint's experts are already permuted, so device d of an expert-parallel group of the
checkpoint's size holds the experts the budget counts as device d.

OLMoE: vLLM's `OlmoeForCausalLM` builds an untied `lm_head` whatever `tie_word_embeddings` says (the
embedded model ties them); the served class ties it to the input embeddings when the config does.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.olmoe import OlmoeForCausalLM
from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from ..checkpoint.format import CheckpointError
from .routing import ServedRouting

__all__ = [
    "OccultRouter",
    "install_routing",
    "OccultMixtralForCausalLM",
    "OccultQwen2MoeForCausalLM",
    "OccultQwen3MoeForCausalLM",
    "OccultOlmoeForCausalLM",
    "OccultDeepseekV2ForCausalLM",
    "OccultDeepseekV3ForCausalLM",
    "OccultGptOssForCausalLM",
]


class OccultRouter(BaseRouter):
    """vLLM router of one MoE layer: the checkpoint's pruned routing from the router logits.

    Args:
        inner: the router vLLM built (its top-k, expert count, EPLB state and, for DeepSeek-V3, the
            loaded `e_score_correction_bias` are read from it).
        routing: the checkpoint's `ServedRouting`; layer: the decoder layer index.
        output_scale: a factor the runner applies to the experts' output itself (vLLM's DeepSeek applies
            `routed_scaling_factor` there); the model's own weights include it, so it is divided out.
    """

    def __init__(self, inner, routing: ServedRouting, layer: int, output_scale: float = 1.0):
        super().__init__(
            top_k=inner.top_k, global_num_experts=inner.global_num_experts, eplb_state=inner.eplb_state
        )
        self.inner, self.routing, self.layer, self.output_scale = inner, routing, layer, output_scale
        self.bias_attr = routing.arch.correction_bias_attr

    @property
    def routing_method_type(self) -> RoutingMethodType:
        return RoutingMethodType.Custom

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if self.bias_attr is not None:  # the engine's loaded tensor (loaded after __init__)
            self.routing.set_router_tensor(self.layer, self.bias_attr, self.inner.e_score_correction_bias)
        weights_TK, ids_TK = self.routing.route(self.layer, router_logits)
        self.routing.record(self.layer, hidden_states, weights_TK, ids_TK)
        if self.output_scale != 1.0:
            weights_TK = weights_TK / self.output_scale
        return weights_TK.float().contiguous(), ids_TK.to(indices_type or torch.int32).contiguous()


def install_routing(model: torch.nn.Module, model_config) -> ServedRouting | None:
    """Route every MoE layer of a vLLM `model` with the pruned routing of its checkpoint; None (and no
    change) when the checkpoint records no active budget."""
    routing = ServedRouting.from_checkpoint(model_config.model, revision=model_config.revision)
    if routing is None:
        return None
    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    layers = {runner.layer_id for runner in runners}
    if layers != set(routing.routers):
        raise CheckpointError(
            f"{model_config.model}: vLLM's {type(model).__name__} has MoE layers {sorted(layers)} where the "
            f"checkpoint's config has {sorted(routing.routers)}; occult_ft cannot map its budget onto them"
        )
    for runner in runners:
        if runner.is_monolithic:
            raise CheckpointError(
                f"{model_config.model}: vLLM's MoE backend for {runner.layer_name} routes inside its fused "
                "kernel, so the pruned routing cannot be applied; choose a modular MoE backend "
                "(e.g. --moe-backend triton) or serve with occult_ft.from_pretrained"
            )
        runner.router = OccultRouter(runner.router, routing, runner.layer_id, runner.routed_scaling_factor)
    return routing


def _tie_embeddings(model: Any) -> None:
    """vLLM's OLMoE builds its own `lm_head` whatever the config says: share the input embeddings, as
    the other vLLM models do for `tie_word_embeddings` (a tied checkpoint stores no `lm_head`)."""
    model.lm_head = model.lm_head.tie_weights(model.model.embed_tokens)


def _served_class(base: Any, name: str) -> type:
    """`base` (a vLLM causal-LM class) whose MoE layers route with the checkpoint's budget."""

    class Served(base):
        def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            config = vllm_config.model_config.hf_config
            if base is OlmoeForCausalLM and getattr(config, "tie_word_embeddings", False):
                _tie_embeddings(self)
            self.occult_routing = install_routing(self, vllm_config.model_config)

    Served.__name__ = Served.__qualname__ = name  # vLLM's registry and logs name the class
    Served.__module__ = __name__
    return Served


OccultMixtralForCausalLM = _served_class(MixtralForCausalLM, "OccultMixtralForCausalLM")
OccultQwen2MoeForCausalLM = _served_class(Qwen2MoeForCausalLM, "OccultQwen2MoeForCausalLM")
OccultQwen3MoeForCausalLM = _served_class(Qwen3MoeForCausalLM, "OccultQwen3MoeForCausalLM")
OccultOlmoeForCausalLM = _served_class(OlmoeForCausalLM, "OccultOlmoeForCausalLM")
OccultDeepseekV2ForCausalLM = _served_class(DeepseekV2ForCausalLM, "OccultDeepseekV2ForCausalLM")
OccultDeepseekV3ForCausalLM = _served_class(DeepseekV3ForCausalLM, "OccultDeepseekV3ForCausalLM")
OccultGptOssForCausalLM = _served_class(GptOssForCausalLM, "OccultGptOssForCausalLM")
