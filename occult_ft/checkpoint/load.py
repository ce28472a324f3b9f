"""Loading checkpoints: model paths (local, Hub, `embedded`), tokenizers, and `occult_ft.from_pretrained`,
which gives a pruned checkpoint (full or LoRA adapter) its pruned routing back.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn
from transformers.utils import logging

from ..apply import apply_occult, permute_state_dict, placed_similarity
from ..dispatch import EXCHANGES, check_exchange_settings, configure_exchange, enable_decode_capacity
from ..dispatch.comm import close_process_group_at_exit
from ..embedded import embedded_model_path
from ..fileio import ReadError, read_json_object, reading_directory, recover_directory
from ..models.family import architecture_model_type, auto_model_class
from ..models.registry import get_arch
from ..routing import PruningConfig
from .convert import maybe_convert
from .format import (
    CheckpointError,
    OccultBlock,
    block_placement,
    check_block_kept,
    model_block,
    read_block,
    read_similarity,
)
from .remote_code import set_auto_map
from .save import record_block, restore_base_routing
from .sharded import build_sharded_model

__all__ = [
    "resolve_model_path",
    "local_model_dir",
    "load_tokenizer",
    "load_model_and_tokenizer",
    "read_model_config",
    "from_pretrained",
    "load_sharded_model",
    "can_load_sharded",
    "restore_occult",
    "check_adapter_base",
    "describe_budget",
]


def _check_exists(path: str) -> None:
    """A path that is clearly local (not a Hub id `org/name`) must exist."""
    if os.path.exists(path):
        return
    if (
        path.startswith(("/", "./", "../", "~"))
        or path.count("/") > 1
        or os.path.sep != "/"
        and os.path.sep in path
    ):
        raise CheckpointError(
            f"model {path!r} does not exist; pass a local model directory or a Hub model id"
        )


def resolve_model_path(path: str) -> str:
    """`embedded` -> the shipped base model's directory; local directories -> absolute paths."""
    if path == "embedded":
        return embedded_model_path()
    recover_directory(path)  # a checkpoint whose directory swap was interrupted: finished first
    return os.path.abspath(path) if os.path.isdir(path) else path


def local_model_dir(path: str) -> str:
    """A local directory for `path`; Hub ids are downloaded (side files such as adapters and the
    similarity tables must be read from disk)."""
    path = resolve_model_path(path)
    if os.path.isdir(path):
        return path
    _check_exists(path)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path)
    except Exception as exc:  # network, auth, offline mode: all end the same way for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot fetch model {path!r} from the Hub: {first}") from None


def load_tokenizer(*sources: str | None):
    """The tokenizer of the first source (model dir or Hub id) that has one, e.g. a checkpoint then
    its base model. Raises CheckpointError naming the sources when none has one."""
    from transformers import AutoTokenizer

    tried = [s for s in sources if s]
    for source in tried:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, KeyError):
            continue
        if _has_vocabulary(tokenizer):
            return tokenizer
    raise CheckpointError(
        f"found no tokenizer in {', '.join(map(repr, tried)) or 'no source'}; save one beside the model "
        "(tokenizer.save_pretrained)"
    )


def read_model_config(path: str):
    """(config, aliased) of a model directory or Hub id. A config.json whose model_type transformers does
    not know is read as the architecture it is published as (`models.family.PUBLISHED_AS`; Kimi-K2:
    `kimi_k2` with `DeepseekV3ForCausalLM`, aliased=True) without remote code, and any other unknown
    model_type is a one-line `UnsupportedModelError` naming it."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json")
    if os.path.isfile(file):
        raw = read_json_object(file)
        check_block_kept(raw, file)
        known = architecture_model_type(raw, file)
        if known is not None:
            skip = ("model_type", "auto_map", "architectures", "transformers_version")
            fields = {k: v for k, v in raw.items() if k not in skip}
            return AutoConfig.for_model(known, architectures=raw.get("architectures"), **fields), True
    return AutoConfig.from_pretrained(path), False


def load_model_and_tokenizer(path: str, dtype=None, warn_pruned: bool = True, **kwargs):
    """The model (`AutoModelForCausalLM`, or `AutoModelForImageTextToText` for a multimodal type) +
    `AutoTokenizer` for a local dir, a Hub id or `embedded` (the shipped base model), with one-line
    errors; an unsupported or refused model type fails on its config, before any weight loads. A pruned
    occult_ft checkpoint loaded this way routes with its original top-k; `warn_pruned` says so
    (`from_pretrained`, which restores the routing, turns it off)."""
    from transformers import AutoTokenizer

    path = maybe_convert(resolve_model_path(path))  # absolute; DeepSeek-MoE -> its qwen2_moe conversion
    _check_exists(path)
    try:
        config, aliased = read_model_config(path)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load model {path!r}: {first}") from None
    get_arch(config)  # unsupported and refused types fail here, before the weights load
    if aliased:
        kwargs = {**kwargs, "config": config}
    try:
        with reading_directory(path):  # a truncated model.safetensors: one line naming it
            model = auto_model_class(config).from_pretrained(path, dtype=dtype or "auto", **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, ReadError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load model {path!r}: {first}") from None
    set_auto_map(model.config, False)  # the remote code stays with the folder; saves write it anew
    if warn_pruned:
        _warn_if_pruned(model, path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    if tokenizer is not None and not _has_vocabulary(tokenizer):
        tokenizer = None  # a folder without tokenizer files: transformers builds an empty default one
    return model, tokenizer


def describe_budget(pruning: PruningConfig) -> str:
    """`2 devices per token`, `1 node per token` or both: what a budget limits, for messages."""
    parts = []
    for budget, total, unit in (
        (pruning.max_devices_per_token, pruning.num_devices, "device"),
        (pruning.max_nodes_per_token, pruning.num_nodes, "node"),
    ):
        if budget is not None and budget < total:
            parts.append(f"{budget} {unit}{'' if budget == 1 else 's'}")
    return " and ".join(parts) + " per token"


def _warn_if_pruned(model: nn.Module, path: str) -> None:
    """Say so when a pruned checkpoint is about to route without its budget (stock loading)."""
    block = model_block(model)
    if block is None or not block.pruned or block.pruning is None:
        return
    if not get_arch(model).native_routing_matches(model.config.to_dict(), block.pruning):  # type: ignore[operator, union-attr]
        logging.get_logger("occult_ft").warning(
            f"{path} is an occult_ft checkpoint pruned to {describe_budget(block.pruning)} "
            f"({block.pruning.criterion}); loaded here with its original top-k routing. Load it with "
            "occult_ft.from_pretrained to route as it was fine-tuned."
        )


def _has_vocabulary(tokenizer) -> bool:
    return len(tokenizer) > 8


def from_pretrained(
    path: str,
    dtype=None,
    is_trainable: bool = False,
    expert_parallel_size: int | None = None,
    exchange: str = "flat",
    nodes: int = 1,
    exchange_capacity: int | str | None = "auto",
    expert_parallel_group: dist.ProcessGroup | None = None,
    **kwargs,
) -> nn.Module:
    """Load an occult_ft checkpoint with its pruned routing active.

    Accepts a full checkpoint directory (or Hub id) written by `save_pruned` / `OccultTrainer`, any
    plain HF MoE checkpoint (returned unchanged), or a LoRA adapter directory written by
    `OccultTrainer` (the base model named in it is loaded, placed, pruned, and the adapter attached).

    Expert-parallel inference: with `expert_parallel_size=D` > 1, under an initialised
    `torch.distributed` process group of D ranks (or `expert_parallel_group` of D ranks), every rank
    reads only its E / D experts of every MoE layer (block `rank` of the stored, placed order) and the
    MoE layers exchange tokens with the other ranks, so `model.generate` and plain forwards run expert
    parallel. Every rank must make the same forward calls (collectives): the same number of
    `generate` steps (identical inputs with greedy decoding, or `min_new_tokens == max_new_tokens`),
    the same batch size is not required. docs/loading.md, "Expert-parallel inference".

    Args:
        expert_parallel_size: D (None or 1: the whole model in this process).
        exchange: "flat" (de-duplicated, the default), "per_expert" (one row per (token, expert)) or
            "two_stage" (with `nodes` > 1), as `OccultConfig.exchange`.
        nodes: N nodes of D / N consecutive ranks, as `OccultConfig.nodes`.
        exchange_capacity: the flat exchange's decode steps: "auto" (capacity-bounded, C = the largest
            batch of any rank, no host synchronisation per layer), C rows per device, or None (exact, one
            host synchronisation per layer). Prefill is always exact.
        expert_parallel_group: the process group of the D ranks (None: the default group).
    """
    path = local_model_dir(path)
    adapter_cfg = os.path.join(path, "adapter_config.json")
    if expert_parallel_size is not None and expert_parallel_size != 1:
        return _from_pretrained_expert_parallel(
            path,
            expert_parallel_size,
            dtype=dtype,
            exchange=exchange,
            nodes=nodes,
            exchange_capacity=exchange_capacity,
            group=expert_parallel_group,
            **kwargs,
        )
    if (exchange, nodes, exchange_capacity, expert_parallel_group) != ("flat", 1, "auto", None):
        raise ValueError(
            "exchange, nodes, exchange_capacity and expert_parallel_group choose how expert-parallel ranks "
            f"exchange tokens; they need expert_parallel_size > 1 (got {expert_parallel_size!r})"
        )
    if os.path.isfile(adapter_cfg):
        return _from_adapter(path, dtype=dtype, is_trainable=is_trainable, **kwargs)
    model, _ = load_model_and_tokenizer(path, dtype=dtype, warn_pruned=False, **kwargs)
    return restore_occult(model, path)


def _check_inference_settings(size, exchange, nodes, capacity, group) -> int:
    """One-line errors for expert-parallel loading settings; returns this rank in its group."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"expert_parallel_size={size!r} must be a positive integer (1: no expert parallelism)"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"expert_parallel_size={size} needs an initialised torch.distributed process group of {size} ranks; "
            "launch with torchrun and call torch.distributed.init_process_group() first"
        )
    world = dist.get_world_size(group)
    if world != size:
        where = "expert_parallel_group" if group is not None else "the world"
        raise ValueError(
            f"expert_parallel_size={size} but {where} has {world} ranks; launch {size} processes or pass "
            f"expert_parallel_size={world} (or an expert_parallel_group of {size} ranks)"
        )
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} is unknown; use one of {', '.join(EXCHANGES)}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or size % nodes:
        divisors = [n for n in range(1, size + 1) if size % n == 0]
        raise ValueError(f"nodes={nodes!r} must divide expert_parallel_size={size}; use one of {divisors}")
    if capacity != "auto":
        if isinstance(capacity, str):
            raise ValueError(
                f"exchange_capacity={capacity!r} must be 'auto', a number of rows per device, or None (exact)"
            )
        check_exchange_settings(exchange, nodes, 1, capacity)
    else:
        check_exchange_settings(exchange, nodes, 1, None)
    return dist.get_rank(group)


def _from_pretrained_expert_parallel(
    path: str, size: int, dtype, exchange: str, nodes: int, exchange_capacity, group, **kwargs
) -> nn.Module:
    """`from_pretrained` under expert parallelism: this rank's experts only, the chosen exchange."""
    rank = _check_inference_settings(size, exchange, nodes, exchange_capacity, group)
    close_process_group_at_exit()  # the user's script under torchrun ends with the group alive
    device = kwargs.pop("device_map", None)
    if kwargs:
        raise ValueError(
            f"expert_parallel_size={size} loads with dtype and device_map only; drop {', '.join(sorted(kwargs))}"
        )
    if device is not None and not isinstance(device, str | int) and not hasattr(device, "type"):
        raise ValueError(
            f"device_map={device!r}: expert-parallel loading puts the whole rank on one device; pass a "
            "device such as 'cuda:0'"
        )
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(
            f"{path!r} is a LoRA adapter; expert-parallel loading reads full checkpoints: merge it "
            "(occult_ft.from_pretrained(DIR).merge_and_unload().save_pretrained(OUT)) and load OUT"
        )
    path = maybe_convert(path)  # DeepSeek-MoE -> its qwen2_moe conversion, as without expert parallelism
    model = load_sharded_model(
        path, rank, size, placement=None, dtype=dtype, group=group, device=device, nodes=nodes
    )
    restore_occult(model, path)
    capacity = exchange_capacity if exchange == "flat" else None
    configure_exchange(model, exchange=exchange, capacity=None)
    if capacity is not None:
        enable_decode_capacity(model, capacity, group)
    return model


def load_sharded_model(
    path: str,
    rank: int,
    size: int,
    placement="sequential",
    dtype=None,
    group=None,
    device=None,
    nodes: int = 1,
) -> nn.Module:
    """A causal-LM whose MoE layers hold only expert block `rank` of `size`, read straight from disk
    (`occult_ft.checkpoint.sharded.build_sharded_model`; same arguments, `path` a local directory or a
    Hub id, whose config is read and checked here: an unsupported or refused type fails in one line)."""
    path = local_model_dir(path)
    config, _ = read_model_config(path)  # Kimi-K2's kimi_k2 reads as deepseek_v3
    get_arch(config)  # an unsupported or refused type fails here, naming why
    return build_sharded_model(path, config, rank, size, placement, dtype, group, device, nodes)


def can_load_sharded(path: str) -> bool:
    """Whether `path` is a model directory (or cached Hub snapshot) of plain safetensors weights that
    the sharded loader reads: a LoRA adapter directory or a non-directory path is not."""

    path = resolve_model_path(path)
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, local_files_only=True)
        except Exception:  # not cached: the ordinary loader downloads it
            return False
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return False
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path)
    )


def restore_occult(model: nn.Module, path: str) -> nn.Module:
    """Give a model loaded from checkpoint `path` (its experts as stored) the pruned routing its `occult`
    block records, with the similarity tables saved beside it, and a `save_pretrained` that keeps them."""
    block = model_block(model)
    if block is None:
        return model
    restore_base_routing(model, block)  # the model's own group fields, where config.json's hold the budget
    if block.pruning is not None:
        apply_occult(
            model,
            pruning=block.pruning,
            similarity=read_similarity(path),
            similarity_placed=True,
            device_bias=block.device_bias_tensors() or {},
        )
    record_block(model, block)
    return model


def check_adapter_base(block: OccultBlock | None, model: nn.Module, adapter_path: str) -> None:
    """Refuse a LoRA adapter on a base of another architecture than the one it was trained on (same
    sizes would attach without an error and compute nonsense)."""
    trained_on = block.model_type if block is not None else None
    found = get_arch(model).model_type
    if trained_on is not None and trained_on != found:
        raise CheckpointError(
            f"adapter {adapter_path!r} was trained on a {trained_on} model but its base is a {found} model; "
            f"point base_model_name_or_path in adapter_config.json at the {trained_on} model it was trained on"
        )


def _from_adapter(path: str, dtype=None, is_trainable: bool = False, **kwargs) -> nn.Module:
    """An occult_ft LoRA adapter on its base model, placed and pruned like in training.

    `expert_order: "original"` (what training saves at the end): the adapter fits the stock base as it
    is; it is attached first, then the whole model (base experts, routers, LoRA factors) is permuted
    into the placed order. Otherwise (checkpoint-N folders) the adapter is in the placed order: the base
    is permuted first (unless it is stored placed) and the adapter attached to it.

    The returned `PeftModel` carries the adapter's block as `occult_adapter_block` (how the adapter is
    stored, for the trainer that continues it); the base model's config records the live block (placed
    order), so a merged model (`merge_and_unload()`) saves as a complete pruned checkpoint.
    """
    from peft import PeftModel

    base_name = read_json_object(os.path.join(path, "adapter_config.json")).get("base_model_name_or_path")
    if not base_name:
        raise CheckpointError(
            f"adapter {path!r} names no base_model_name_or_path; add it to adapter_config.json"
        )
    model, _ = load_model_and_tokenizer(base_name, dtype=dtype, **kwargs)
    block = read_block(path)
    check_adapter_base(block, model, path)
    if block is None:  # a plain PEFT adapter: nothing of occult_ft to restore
        return PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
    placement = None if block.placed else block_placement(block, get_arch(model).model_type)
    similarity = read_similarity(path)
    bias = block.device_bias_tensors() or {}  # a bias is per device: the same in either expert order
    if block.expert_order == "original" and placement is not None:
        model = PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
        model.load_state_dict(permute_state_dict(model, model.state_dict(), placement))
        similarity = placed_similarity(similarity, placement)
        apply_occult(
            model, pruning=block.pruning, similarity=similarity, similarity_placed=True, device_bias=bias
        )
    else:
        apply_occult(model, placement, block.pruning, similarity, similarity_placed=True, device_bias=bias)
        model = PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
    record_block(model, block.with_changes(placed=True, expert_order="placed"))
    model.occult_adapter_block = block  # type: ignore[assignment]
    return model
