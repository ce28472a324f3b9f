"""The checkpoint format: the `occult` block of config.json (or `occult_config.json` of a LoRA adapter),
the similarity tables file and the files a checkpoint directory holds. The one reader and writer of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..fileio import atomic_save, atomic_write_text, read_json_object
from ..models.registry import config_num_experts, get_arch, lookup_arch, unwrap_model
from ..placement import Placement
from ..routing import PruningConfig

__all__ = [
    "OCCULT_KEY",
    "SIMILARITY_FILE",
    "ADAPTER_OCCULT_FILE",
    "REMOTE_MODULE",
    "REMOTE_CODE_FILE",
    "BLOCK_VERSION",
    "CheckpointError",
    "CheckpointSummary",
    "occult_block",
    "model_block",
    "read_block",
    "read_similarity",
    "write_similarity",
    "write_adapter_block",
    "pruning_from_block",
    "placement_from_block",
    "has_remote_code",
    "describe_checkpoint",
]

REMOTE_MODULE = "occult_pruned_routing"
REMOTE_CODE_FILE = f"{REMOTE_MODULE}.py"
AUTO_CLASS = "AutoModelForCausalLM"
OCCULT_KEY = "occult"
SIMILARITY_FILE = "occult_similarity.safetensors"
ADAPTER_OCCULT_FILE = "occult_config.json"
BLOCK_VERSION = 1


class CheckpointError(ValueError):
    """A model path or checkpoint that cannot be used."""


# ---- the `occult` block: building it ---------------------------------------------------------------
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


# ---- reading it ------------------------------------------------------------------------------------
def model_block(model: nn.Module) -> dict:
    """The `occult` block a loaded model carries in its config ({} for a plain model)."""
    return dict(getattr(unwrap_model(model).config, OCCULT_KEY, None) or {})


def read_block(path: str) -> dict:
    """The `occult` block of a checkpoint directory: `occult_config.json` of a LoRA adapter, else the
    `occult` entry of `config.json` ({} when there is none)."""
    adapter_file, config_file = os.path.join(path, ADAPTER_OCCULT_FILE), os.path.join(path, "config.json")
    if os.path.isfile(adapter_file):
        return read_json_object(adapter_file)
    if os.path.isfile(config_file):
        return dict(read_json_object(config_file).get(OCCULT_KEY) or {})
    return {}


def read_similarity(path: str) -> dict[int, torch.Tensor] | None:
    """The similarity criterion's tables saved beside a checkpoint (placed order), or None."""
    file = os.path.join(path, SIMILARITY_FILE)
    if not os.path.isfile(file):
        return None
    from safetensors.torch import load_file

    return {int(k.split(".")[1]): v for k, v in load_file(file).items()}


def pruning_from_block(block: dict | None) -> PruningConfig | None:
    """The `PruningConfig` a block records (None without a device or node budget)."""
    if not block or (block.get("max_devices_per_token") is None and block.get("max_nodes_per_token") is None):
        return None
    optional = lambda key: None if block.get(key) is None else int(block[key])  # noqa: E731
    return PruningConfig(
        num_devices=int(block["num_devices"]),
        max_devices_per_token=optional("max_devices_per_token"),
        criterion=block.get("criterion", "score"),
        gate_weights=block.get("gate_weights", "model"),
        num_nodes=int(block.get("num_nodes", 1)),
        max_nodes_per_token=optional("max_nodes_per_token"),
    )


def placement_from_block(block: dict | None, model: nn.Module | None = None, model_type: str | None = None):
    """The `Placement` recorded in an `occult` block (None when it records none)."""
    if not block or not block.get("placement"):
        return None
    if model_type is None:
        model_type = block.get("model_type") or (get_arch(unwrap_model(model)).model_type if model else None)
    layers = {int(k): v for k, v in block["placement"]["layers"].items()}
    first = next(iter(layers.values()))
    return Placement(
        model=block.get("base_model"),
        model_type=model_type,
        num_experts=sum(len(g) for g in first),
        num_devices=len(first),
        num_nodes=int(block.get("num_nodes", 1)),
        algorithm=block["placement"].get("algorithm", "unknown"),
        groups=layers,
        metrics={},
    )


@dataclass
class CheckpointSummary:
    """What a checkpoint directory records (for model cards and checks).

    Args:
        path: the checkpoint directory.
        kind: `"full"` (config.json) or `"adapter"` (adapter_config.json).
        block: the `occult` block ({} when there is none).
        config: config.json as a dict ({} for adapters).
        adapter: adapter_config.json as a dict ({} for full checkpoints).
        base_model: the model this checkpoint derives from, when recorded.
        model_type: HF model_type, when known.
        num_experts: E routed experts per layer, when known.
        top_k: k experts per token, when known.
        native_routing: the budget is written in the model's own config (`n_group` / `topk_group`).
        has_similarity: `occult_similarity.safetensors` is present.
        has_tokenizer: tokenizer files are present.
        remote_code: config.json's `auto_map` sends `AutoModelForCausalLM` to the checkpoint's
            `occult_pruned_routing.py` (stock transformers routes with the budget under
            `trust_remote_code=True`).
    """

    path: str
    kind: str
    block: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    adapter: dict = field(default_factory=dict)
    base_model: str | None = None
    model_type: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    native_routing: bool = False
    has_similarity: bool = False
    has_tokenizer: bool = False
    remote_code: bool = False

    @property
    def pruned(self) -> bool:
        """A budget below the device count restricts the routing."""
        m, d = self.block.get("max_devices_per_token"), self.block.get("num_devices")
        return m is not None and (d is None or int(m) < int(d))

    @property
    def needs_occult_ft(self) -> bool:
        """Stock transformers would route differently from training (or cannot attach the placement)."""
        return (self.kind == "adapter" and bool(self.block)) or (self.pruned and not self.native_routing)


def describe_checkpoint(checkpoint_dir: str | os.PathLike) -> CheckpointSummary:
    """Read the config files of a full or adapter checkpoint directory.

    Raises:
        CheckpointError: the directory is missing, or holds neither config.json nor adapter_config.json.
    """
    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint directory {path!r} does not exist; pass the folder written by save/train"
        )
    config_file, adapter_file = os.path.join(path, "config.json"), os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter_file):
        adapter = read_json_object(adapter_file)
        block = read_block(path)
        summary = CheckpointSummary(path, "adapter", block=block, adapter=adapter)
        summary.base_model = block.get("base_model") or adapter.get("base_model_name_or_path")
        summary.model_type = block.get("model_type")
    elif os.path.isfile(config_file):
        config = read_json_object(config_file)
        block = dict(config.get(OCCULT_KEY) or {})
        summary = CheckpointSummary(path, "full", block=block, config=config)
        summary.base_model = block.get("base_model") or config.get("_name_or_path") or None
        summary.model_type = config.get("model_type")
        summary.num_experts = config_num_experts(config)
        summary.top_k = int(config["num_experts_per_tok"]) if config.get("num_experts_per_tok") else None
        arch = lookup_arch(summary.model_type)
        summary.native_routing = bool(
            arch is not None and arch.native_routing_matches(config, pruning_from_block(block))
        )
        summary.remote_code = has_remote_code(path, config)
    else:
        raise CheckpointError(
            f"{path!r} is not a checkpoint (no config.json or adapter_config.json); "
            "pass the directory written by save_pruned, save_model or the trainer"
        )
    groups = (summary.block.get("placement") or {}).get("layers") or {}
    if summary.num_experts is None and groups:
        summary.num_experts = sum(len(g) for g in next(iter(groups.values())))
    summary.has_similarity = os.path.isfile(os.path.join(path, SIMILARITY_FILE))
    summary.has_tokenizer = any(
        os.path.isfile(os.path.join(path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    return summary


def write_similarity(out_dir: str, similarity: dict[int, torch.Tensor] | None) -> None:
    """Write the similarity tables (placed order) beside a checkpoint (nothing when None/empty)."""
    if not similarity:
        return
    from safetensors.torch import save_file

    tables = {f"layers.{i}": t.detach().float().contiguous().cpu() for i, t in similarity.items()}
    atomic_save(os.path.join(out_dir, SIMILARITY_FILE), lambda tmp: save_file(tables, tmp))


def write_adapter_block(out_dir: str, block: dict) -> None:
    """Write a LoRA adapter's `occult_config.json`."""
    atomic_write_text(os.path.join(out_dir, ADAPTER_OCCULT_FILE), json.dumps(block, indent=2))


def has_remote_code(path: str, config: dict) -> bool:
    """A checkpoint directory whose config.json (a dict) maps an auto class (`AutoModelForCausalLM`, or
    `AutoModelForImageTextToText` for a multimodal type) to our file, and the file is there."""
    targets = [str(v) for v in (config.get("auto_map") or {}).values()]
    ours = any(target.startswith(f"{REMOTE_MODULE}.") for target in targets)
    return ours and os.path.isfile(os.path.join(path, REMOTE_CODE_FILE))
