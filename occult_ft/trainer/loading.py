"""Loading the model of a run: a model directory, Hub id, `embedded`, a pruned checkpoint (pruning
active) or an occult_ft LoRA adapter directory; and the checks that need the loaded model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer

from ..checkpoint.load import from_pretrained, resolve_model_path
from ..embedded import embedded_model_path
from ..fileio import read_json_object
from ..models.family import auto_model_class
from ..models.registry import unwrap_model
from ..plan import COMPENSATED_OPTIMS
from .config import OccultArguments, check_before_loading

__all__ = [
    "load_training_model",
    "load_training_tokenizer",
    "load_precision",
    "round_keeping_residuals",
    "check_seq_len",
    "may_move_to",
]


def load_precision(path: str, args: OccultArguments) -> torch.dtype | None:
    """float32 when a 16-bit `full` / `moe` run that `CompensatedAdamW` will train (optim adamw_torch, no
    DeepSpeed or FSDP) starts from a local checkpoint stored in float32: the model is then loaded and
    prepared in float32 and rounded to `model_dtype` by `round_keeping_residuals`, whose residuals seed
    the optimizer's compensation. Loaded straight in 16 bits, the start is rounded and every update
    smaller than half a 16-bit step from it is lost against the float32 run (0.92x its mean movement on
    the tiny OLMoE of `benchmarks/bf16_updates.py`). None: load in `model_dtype`."""
    if (
        args.model_dtype not in ("bfloat16", "float16")
        or args.train_mode not in ("full", "moe")
        or args.deepspeed
        or args.fsdp
        or args.optim not in COMPENSATED_OPTIMS
    ):
        return None
    path = embedded_model_path() if path == "embedded" else path
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config) or os.path.isfile(os.path.join(path, "adapter_config.json")):
        return None
    stored = read_json_object(config)
    stored_dtype = stored.get("dtype") or stored.get("torch_dtype")
    return torch.float32 if stored_dtype == "float32" else None


@torch.no_grad()
def round_keeping_residuals(model: nn.Module, dtype: torch.dtype) -> dict[nn.Parameter, torch.Tensor]:
    """Round a model loaded in float32 to `dtype` as loading it in `dtype` would have (parameters that
    transformers keeps in float32, such as DeepSeek-V3's router, stay float32), in place; returns, for each
    trainable parameter rounded, what the rounding lost (float32 value - rounded value, in `dtype`), for
    `CompensatedAdamW.seed_compensation`."""
    base = unwrap_model(model)
    config = base.config
    with torch.device("meta"):
        reference = auto_model_class(config).from_config(config, dtype=dtype)
    wanted = {name: p.dtype for name, p in reference.named_parameters()}
    residuals: dict[nn.Parameter, torch.Tensor] = {}
    for name, p in base.named_parameters():
        target = wanted.get(name, dtype)
        if p.dtype != torch.float32 or target == torch.float32:
            continue
        rounded = p.detach().to(target)
        if p.requires_grad:
            residuals[p] = (p.detach() - rounded.float()).to(target)
        p.data = rounded
    config.dtype = dtype  # as from_pretrained(dtype=...) records it; saved checkpoints say so
    return residuals


def load_training_model(
    path: str, args: OccultArguments, dtype: torch.dtype | None = None
) -> tuple[nn.Module, Any]:
    """(model, tokenizer) for `path`: a model dir or Hub id, `embedded`, a pruned checkpoint (pruning
    active) or an occult_ft LoRA adapter directory (loaded trainable); in `dtype` when given (else
    `args.model_dtype`)."""
    if path == "embedded":
        path = embedded_model_path()
    check_before_loading(args)
    if dtype is None:
        dtype = None if args.model_dtype == "auto" else getattr(torch, args.model_dtype)
    is_adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
    if is_adapter and args.train_mode != "lora":
        raise ValueError(
            f"model_name_or_path={path!r} is a LoRA adapter; set train_mode='lora' to continue training it"
        )
    model = (
        from_pretrained(path, dtype=dtype, is_trainable=True)
        if is_adapter
        else from_pretrained(path, dtype=dtype)
    )
    return model, load_training_tokenizer(path)


def load_training_tokenizer(path: str):
    """The tokenizer of a run's model: beside it, else (a LoRA adapter) beside the base it names; None
    when neither has one. Read without the model, so a run can tokenize its data before loading it."""
    path = resolve_model_path(path)
    sources = [path]
    adapter = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter):
        base = read_json_object(adapter).get("base_model_name_or_path")
        if isinstance(base, str) and base:
            sources.append(resolve_model_path(base))
    for source in sources:
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, KeyError):
            continue
    return None


def check_seq_len(model, seq_len: int | None, name: str = "seq_len") -> None:
    """Refuse a row length (`seq_len`, TRL's `max_length`; None = unbounded, not checked) above the
    model's `max_position_embeddings` (its losses would be silently wrong)."""
    config = getattr(unwrap_model(model), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len is not None and seq_len > limit:
        raise ValueError(
            f"{name}={seq_len} exceeds the model's max_position_embeddings={limit}; set {name} <= {limit}"
        )


def may_move_to(args: OccultArguments, model: nn.Module) -> bool:
    """Whether the model may go to `args.device` before Trainer does (to profile there)."""
    if args.deepspeed or args.fsdp or getattr(model, "hf_device_map", None) or args.use_cpu:
        return False
    if not torch.cuda.is_available():
        return False
    return next(model.parameters()).device.type == "cpu"
