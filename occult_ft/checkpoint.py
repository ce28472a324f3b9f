"""Pruned checkpoints: standard HF checkpoints whose experts are placed and whose routing is pruned.

A checkpoint written here is an ordinary transformers checkpoint (plain `from_pretrained` loads it)
whose experts have been permuted so that device d of D holds the contiguous block
[d*E/D, (d+1)*E/D). Without a budget it is the same function as the original model. With a budget,
`config.json` carries an `occult` block and `occult_ft.from_pretrained` returns the model with the
pruned routing active:

    "occult": {"version": 1, "num_devices": 4, "num_nodes": 1, "max_devices_per_token": 2,
               "criterion": "score", "gate_weights": "model", "placed": true,
               "placement": {"algorithm": "search", "layers": {"0": [[...], ...]}}, ...}

`placement.layers` records which original experts each device holds (provenance; the weights are
already permuted). The similarity criterion's tables live beside the weights in
`occult_similarity.safetensors` (already in placed order). A LoRA adapter directory carries the same
block in `occult_config.json`; there `placed` is false and loading permutes the base model first.
DeepSeek-V3 with `device_topk_sum` (and DeepSeek-V2 with `device_max`) also get the native
`n_group`/`topk_group` fields, so stock transformers routes identically without occult_ft.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .convert import maybe_convert
from .models.registry import get_arch, unwrap_model
from .routing import PruningConfig, apply_pruning

__all__ = [
    "OCCULT_KEY",
    "SIMILARITY_FILE",
    "ADAPTER_OCCULT_FILE",
    "occult_block",
    "write_native_group_fields",
    "save_pruned",
    "from_pretrained",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "resolve_model_path",
    "CheckpointError",
]

OCCULT_KEY = "occult"
SIMILARITY_FILE = "occult_similarity.safetensors"
ADAPTER_OCCULT_FILE = "occult_config.json"
BLOCK_VERSION = 1


class CheckpointError(ValueError):
    """A model path or checkpoint that cannot be used."""


def occult_block(
    pruning: PruningConfig | None, placement=None, placed: bool = True, num_nodes: int = 1, **extra
) -> dict:
    """The `occult` config block for a model placed by `placement` and pruned by `pruning`."""
    block = {"version": BLOCK_VERSION, "placed": placed, "num_nodes": num_nodes}
    if pruning is not None:
        block.update(pruning.to_dict())
    if placement is not None:
        block["num_devices"] = placement.num_devices
        block["num_nodes"] = placement.num_nodes
        block["placement"] = {
            "algorithm": placement.algorithm,
            "layers": {str(k): v for k, v in placement.groups.items()},
        }
    block.update(extra)
    return block


def write_native_group_fields(config, pruning: PruningConfig) -> bool:
    """Express device-limited routing in the model's own config where transformers can (in place).

    DeepSeek-V3: `n_group=D`, `topk_group=M` (groups ranked by the sum of their top-2 scores: our
    `device_topk_sum`, which uses the same top-2 on DeepSeek-V3; needs at least 2 experts per device). DeepSeek-V2: `topk_method="group_limited_greedy"`, `n_group=D`,
    `topk_group=M` (groups ranked by their best score: our `device_max`/`score`).
    Returns True when the fields were written.
    """
    if not pruning.active:
        return False
    arch = get_arch(config)
    m = pruning.max_devices_per_token
    per_device = (
        int(getattr(config, "num_local_experts", 0) or getattr(config, "n_routed_experts", 0))
        // pruning.num_devices
    )
    if arch.native_group_routing == "topk_sum" and pruning.criterion == "device_topk_sum" and per_device >= 2:
        config.n_group, config.topk_group = pruning.num_devices, m
        return True
    if arch.native_group_routing == "max" and pruning.criterion in ("device_max", "score"):
        config.topk_method, config.n_group, config.topk_group = "group_limited_greedy", pruning.num_devices, m
        return True
    return False


def save_pruned(
    model: nn.Module,
    out_dir: str,
    tokenizer=None,
    pruning: PruningConfig | None = None,
    placement=None,
    similarity: dict[int, torch.Tensor] | None = None,
    extra: dict | None = None,
) -> str:
    """Write a placed (already permuted) model as a pruned checkpoint; returns `out_dir`."""
    from safetensors.torch import save_file

    base = unwrap_model(model)
    os.makedirs(out_dir, exist_ok=True)
    block = occult_block(pruning, placement, placed=True, **(extra or {}))
    config = base.config
    previous = getattr(config, OCCULT_KEY, None)
    setattr(config, OCCULT_KEY, block)
    if pruning is not None:
        write_native_group_fields(config, pruning)
    try:
        base.save_pretrained(out_dir)
    finally:
        if previous is None:
            try:
                delattr(config, OCCULT_KEY)
            except AttributeError:
                pass
        else:
            setattr(config, OCCULT_KEY, previous)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    if similarity:
        save_file(
            {f"layers.{i}": t.float().contiguous() for i, t in similarity.items()},
            os.path.join(out_dir, SIMILARITY_FILE),
        )
    return out_dir


def _read_similarity(path: str) -> dict[int, torch.Tensor] | None:
    file = os.path.join(path, SIMILARITY_FILE)
    if not os.path.isfile(file):
        return None
    from safetensors.torch import load_file

    return {int(k.split(".")[1]): v for k, v in load_file(file).items()}


def _pruning_from_block(block: dict) -> PruningConfig | None:
    if not block or block.get("max_devices_per_token") is None:
        return None
    return PruningConfig(
        num_devices=int(block["num_devices"]),
        max_devices_per_token=int(block["max_devices_per_token"]),
        criterion=block.get("criterion", "score"),
        gate_weights=block.get("gate_weights", "model"),
    )


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
        from .embedded import embedded_model_path

        return embedded_model_path()
    return os.path.abspath(path) if os.path.isdir(path) else path


def _local_dir(path: str) -> str:
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


def load_model_and_tokenizer(path: str, dtype=None, **kwargs):
    """`AutoModelForCausalLM` + `AutoTokenizer` for a local dir, a Hub id or `embedded` (the shipped
    base model), with one-line errors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = maybe_convert(resolve_model_path(path))  # absolute; DeepSeek-MoE -> its qwen2_moe conversion
    _check_exists(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load model {path!r}: {first}") from None
    get_arch(model)  # unsupported types fail here, with the list of supported ones
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    if tokenizer is not None and not _has_vocabulary(tokenizer):
        tokenizer = None  # a folder without tokenizer files: transformers builds an empty default one
    return model, tokenizer


def _has_vocabulary(tokenizer) -> bool:
    return len(tokenizer) > 8


def from_pretrained(path: str, dtype=None, is_trainable: bool = False, **kwargs) -> nn.Module:
    """Load an occult_ft checkpoint with its pruned routing active.

    Accepts a full checkpoint directory (or Hub id) written by `save_pruned` / `OccultTrainer`, any
    plain HF MoE checkpoint (returned unchanged), or a LoRA adapter directory written by
    `OccultTrainer` (the base model named in it is loaded, placed, pruned, and the adapter attached).
    """
    path = _local_dir(path)
    adapter_cfg = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter_cfg):
        return _from_adapter(path, dtype=dtype, is_trainable=is_trainable, **kwargs)
    model, _ = load_model_and_tokenizer(path, dtype=dtype, **kwargs)
    block = getattr(model.config, OCCULT_KEY, None)
    pruning = _pruning_from_block(block)
    if pruning is not None:
        apply_pruning(model, pruning, similarity=_read_similarity(path))
    return model


def _from_adapter(path: str, dtype=None, is_trainable: bool = False, **kwargs) -> nn.Module:
    from peft import PeftModel

    from .placement import Placement, permute_experts

    with open(os.path.join(path, "adapter_config.json")) as f:
        base_name = json.load(f).get("base_model_name_or_path")
    if not base_name:
        raise CheckpointError(
            f"adapter {path!r} names no base_model_name_or_path; add it to adapter_config.json"
        )
    model, _ = load_model_and_tokenizer(base_name, dtype=dtype, **kwargs)
    block = {}
    occult_file = os.path.join(path, ADAPTER_OCCULT_FILE)
    if os.path.isfile(occult_file):
        with open(occult_file) as f:
            block = json.load(f)
    if block.get("placement") and not block.get("placed", False):
        layers = {int(k): v for k, v in block["placement"]["layers"].items()}
        first = next(iter(layers.values()))
        placement = Placement(
            model=base_name,
            model_type=get_arch(model).model_type,
            num_experts=sum(len(g) for g in first),
            num_devices=len(first),
            num_nodes=int(block.get("num_nodes", 1)),
            algorithm=block["placement"].get("algorithm", "unknown"),
            groups=layers,
            metrics={},
        )
        permute_experts(model, placement)
    pruning = _pruning_from_block(block)
    if pruning is not None:
        apply_pruning(model, pruning, similarity=_read_similarity(path))
    model = PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
    model.config.__dict__[OCCULT_KEY] = block
    return model
