"""Loading the model of a run: a model directory, Hub id, `embedded`, a pruned checkpoint (pruning
active) or an occult_ft LoRA adapter directory; and the checks that need the loaded model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer

from ..checkpoint.load import from_pretrained
from ..embedded import embedded_model_path
from ..models.registry import unwrap_model
from .config import OccultArguments, check_before_loading

__all__ = ["load_training_model", "check_seq_len", "may_move_to"]


def load_training_model(path: str, args: OccultArguments) -> tuple[nn.Module, Any]:
    """(model, tokenizer) for `path`: a model dir or Hub id, `embedded`, a pruned checkpoint (pruning
    active) or an occult_ft LoRA adapter directory (loaded trainable)."""
    if path == "embedded":
        path = embedded_model_path()
    check_before_loading(args)
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
    tokenizer = None
    sources = [path] + ([unwrap_model(model).config._name_or_path] if is_adapter else [])  # type: ignore[list-item, union-attr]
    for source in sources:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            break
        except (OSError, ValueError, KeyError):
            continue
    return model, tokenizer


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
