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

`peft` is imported only when a function here runs.
"""

from __future__ import annotations

from torch import nn

from ..models.registry import find_moe_layers, get_arch, unwrap_model

__all__ = ["ATTENTION_PROJECTIONS", "is_peft_model", "lora_targets", "build_lora_config", "apply_lora"]

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def is_peft_model(model: nn.Module) -> bool:
    """True for a PEFT-wrapped model (also inside DDP/DeepSpeed wrappers)."""
    seen = 0
    while (
        seen < 4
        and not hasattr(model, "peft_config")
        and isinstance(getattr(model, "module", None), nn.Module)
    ):
        model, seen = model.module, seen + 1
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
    layers = find_moe_layers(base)
    block_attr = layers[0].name.rsplit(".", 1)[-1]  # "mlp" for every registered architecture
    linear_names = {
        name.rsplit(".", 1)[-1] for name, module in base.named_modules() if isinstance(module, nn.Linear)
    }
    modules = [name for name in ATTENTION_PROJECTIONS if name in linear_names] if attention else []
    params = [f"{block_attr}.experts.{name}" for name in _EXPERT_WEIGHTS if name in arch.expert_params]
    return {
        "target_modules": modules,
        "target_parameters": params,
        "modules_to_save": [f"{block_attr}.{arch.router_attr}"],
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
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets["target_modules"] or None,
        target_parameters=targets["target_parameters"],
        modules_to_save=targets["modules_to_save"],
        task_type="CAUSAL_LM",
    )


def apply_lora(
    model: nn.Module, r: int = 16, alpha: float = 32.0, dropout: float = 0.0, attention: bool = True
):
    """Wrap `model` with LoRA adapters (call after placement and `apply_pruning`).

    Returns:
        The `peft.PeftModel`; only the adapters and the routers are trainable.
    """
    from peft import get_peft_model

    return get_peft_model(model, build_lora_config(model, r, alpha, dropout, attention))
