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
`n_group`/`topk_group` fields, so stock transformers routes identically without occult_ft. Every other
active budget gets remote code (`occult_pruned_routing.py` and `config.auto_map`, see
`occult_ft.remote_code`): stock `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`
then routes with the budget too.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .convert import maybe_convert
from .fileio import atomic_directory, atomic_save, atomic_write_text, read_json_object
from .models.registry import NATIVE_ROUTING_FIELDS, config_num_experts, get_arch, lookup_arch, unwrap_model
from .routing import PruningConfig

__all__ = [
    "OCCULT_KEY",
    "SIMILARITY_FILE",
    "ADAPTER_OCCULT_FILE",
    "CheckpointError",
    "CheckpointSummary",
    "occult_block",
    "model_block",
    "read_block",
    "read_similarity",
    "write_similarity",
    "write_adapter_block",
    "occult_config_fields",
    "pruning_from_block",
    "placement_from_block",
    "describe_checkpoint",
    "write_native_group_fields",
    "save_pruned",
    "attach_occult_save",
    "restore_occult",
    "local_model_dir",
    "from_pretrained",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "resolve_model_path",
]

OCCULT_KEY = "occult"
SIMILARITY_FILE = "occult_similarity.safetensors"
ADAPTER_OCCULT_FILE = "occult_config.json"
BLOCK_VERSION = 1
_MISSING = object()


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
    from .placement import Placement

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
            arch is not None
            and arch.native_routing_matches(
                config, block.get("num_devices"), block.get("max_devices_per_token")
            )
        )
        from .remote_code import has_remote_code

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


# ---- writing it ------------------------------------------------------------------------------------
def write_native_group_fields(config, pruning: PruningConfig) -> bool:
    """Express the budget in the model's own config where stock transformers can (in place; see
    `MoEArch.write_native_routing`). Returns True when the fields were written."""
    if not pruning.active:
        return False
    return get_arch(config).write_native_routing(
        config, pruning.num_devices, pruning.max_devices_per_token, pruning.criterion
    )


@contextlib.contextmanager
def occult_config_fields(
    config, block: dict, pruning: PruningConfig | None, save_dir: str | os.PathLike | None = None
):
    """Within the context, `config` carries `block` (and the native routing fields of `pruning`); the
    config's previous values come back afterwards. Wrap `save_pretrained` calls in it.

    With `save_dir` (the directory the body saves into) and a budget that the native fields cannot
    express, `config.auto_map` points `AutoModelForCausalLM` at remote code, and once the body has
    written `config.json` there the code follows it (`occult_ft.remote_code`): stock transformers
    with `trust_remote_code=True` then routes with the budget. A stale occult `auto_map` entry (from a
    loaded checkpoint) is dropped otherwise."""
    from .remote_code import needs_remote_code, set_auto_map, write_remote_code

    names = (OCCULT_KEY, "auto_map", *NATIVE_ROUTING_FIELDS)
    saved = {name: config.__dict__.get(name, _MISSING) for name in names}
    setattr(config, OCCULT_KEY, block)
    native = pruning is not None and write_native_group_fields(config, pruning)
    remote = save_dir is not None and needs_remote_code(pruning, native, config.model_type)
    set_auto_map(config, remote)
    try:
        yield config
        if remote and os.path.isfile(os.path.join(os.fspath(save_dir), "config.json")):
            write_remote_code(save_dir, config)  # only where this process saved the config
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                config.__dict__.pop(name, None)
            else:
                setattr(config, name, value)


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


def _save_pretrained_with_occult(self, save_directory, *args, **kwargs):
    """`save_pretrained` of a model that `attach_occult_save` marked: the class's own save, with the
    `occult` block (and native routing fields) in config.json and the routers' similarity tables beside
    the weights, so `occult_ft.from_pretrained` of the copy routes like this model."""
    from .apply import applied_similarity

    # stock save_pretrained(push_to_hub=True) uploads before the side files below exist: push afterwards
    push = kwargs.pop("push_to_hub", False)
    hub = {k: kwargs.pop(k) for k in _PUSH_KWARGS if k in kwargs}
    block = self._occult_save_block
    with occult_config_fields(self.config, block, pruning_from_block(block), save_directory):
        result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", True):
        write_similarity(os.fspath(save_directory), applied_similarity(self))
        if push:
            repo_id = hub.pop("repo_id", os.path.basename(os.path.abspath(os.fspath(save_directory))))
            self.push_to_hub(repo_id, **hub)
    return result


_PUSH_KWARGS = (
    "repo_id",
    "commit_message",
    "commit_description",
    "private",
    "token",
    "revision",
    "create_pr",
)


def attach_occult_save(model: nn.Module, block: dict) -> None:
    """Make `model.save_pretrained` (also through `push_to_hub`, and on the model `merge_and_unload`
    returns) write a complete pruned checkpoint of the live, placed model described by `block`."""
    import types

    base = unwrap_model(model)
    if hasattr(base, "get_base_model"):  # a PEFT model: the transformers model inside
        base = base.get_base_model()
    saved = {k: v for k, v in block.items() if k != "expert_order"}
    saved["placed"] = True  # the live experts are in placed order
    base._occult_save_block = saved
    base.save_pretrained = types.MethodType(_save_pretrained_with_occult, base)
    base.config.__dict__[OCCULT_KEY] = saved


def save_pruned(
    model: nn.Module,
    out_dir: str,
    tokenizer=None,
    pruning: PruningConfig | None = None,
    placement=None,
    similarity: dict[int, torch.Tensor] | None = None,
    extra: dict | None = None,
) -> str:
    """Write a placed (already permuted) model as a pruned checkpoint; returns `out_dir`.

    The checkpoint is written into a temporary sibling directory and swapped in whole, so an
    interrupted write leaves the previous `out_dir` untouched and no stale file (an old adapter, old
    weights) survives beside the new checkpoint.
    """
    base = unwrap_model(model)
    block = occult_block(pruning, placement, placed=True, **(extra or {}))
    with atomic_directory(out_dir) as tmp:
        with occult_config_fields(base.config, block, pruning, tmp):
            base.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_similarity(tmp, similarity)
    return out_dir


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


def load_model_and_tokenizer(path: str, dtype=None, warn_pruned: bool = True, **kwargs):
    """`AutoModelForCausalLM` + `AutoTokenizer` for a local dir, a Hub id or `embedded` (the shipped
    base model), with one-line errors. A pruned occult_ft checkpoint loaded this way routes with its
    original top-k; `warn_pruned` says so (`from_pretrained`, which restores the routing, turns it off)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = maybe_convert(resolve_model_path(path))  # absolute; DeepSeek-MoE -> its qwen2_moe conversion
    _check_exists(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load model {path!r}: {first}") from None
    get_arch(model)  # unsupported types fail here, with the list of supported ones
    from .remote_code import set_auto_map

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


def _warn_if_pruned(model: nn.Module, path: str) -> None:
    """Say so when a pruned checkpoint is about to route without its budget (stock loading)."""
    from transformers.utils import logging

    block = model_block(model)
    pruning = pruning_from_block(block)
    if pruning is None or not pruning.active:
        return
    native = get_arch(model).native_routing_matches(
        model.config.to_dict(), pruning.num_devices, pruning.max_devices_per_token
    )
    if not native:
        logging.get_logger("occult_ft").warning(
            f"{path} is an occult_ft checkpoint pruned to {pruning.max_devices_per_token} devices per token "
            f"({pruning.criterion}); loaded here with its original top-k routing. Load it with "
            "occult_ft.from_pretrained to route as it was fine-tuned."
        )


def _has_vocabulary(tokenizer) -> bool:
    return len(tokenizer) > 8


def from_pretrained(path: str, dtype=None, is_trainable: bool = False, **kwargs) -> nn.Module:
    """Load an occult_ft checkpoint with its pruned routing active.

    Accepts a full checkpoint directory (or Hub id) written by `save_pruned` / `OccultTrainer`, any
    plain HF MoE checkpoint (returned unchanged), or a LoRA adapter directory written by
    `OccultTrainer` (the base model named in it is loaded, placed, pruned, and the adapter attached).
    """
    path = local_model_dir(path)
    adapter_cfg = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter_cfg):
        return _from_adapter(path, dtype=dtype, is_trainable=is_trainable, **kwargs)
    model, _ = load_model_and_tokenizer(path, dtype=dtype, warn_pruned=False, **kwargs)
    return restore_occult(model, path)


def restore_occult(model: nn.Module, path: str) -> nn.Module:
    """Give a model loaded from checkpoint `path` (its experts as stored) the pruned routing its `occult`
    block records, with the similarity tables saved beside it, and a `save_pretrained` that keeps them."""
    block = model_block(model)
    pruning = pruning_from_block(block)
    if pruning is not None:
        from .apply import apply_occult

        apply_occult(model, pruning=pruning, similarity=read_similarity(path), similarity_placed=True)
    if block:
        attach_occult_save(model, block)
    return model


def _from_adapter(path: str, dtype=None, is_trainable: bool = False, **kwargs) -> nn.Module:
    """An occult_ft LoRA adapter on its base model, placed and pruned like in training.

    `expert_order: "original"` (what training saves at the end): the adapter fits the stock base as it
    is; it is attached first, then the whole model (base experts, routers, LoRA factors) is permuted
    into the placed order. Otherwise (checkpoint-N folders) the adapter is in the placed order: the base
    is permuted first (unless it is stored placed) and the adapter attached to it.
    """
    from peft import PeftModel

    from .apply import apply_occult, permute_state_dict, placed_similarity

    base_name = read_json_object(os.path.join(path, "adapter_config.json")).get("base_model_name_or_path")
    if not base_name:
        raise CheckpointError(
            f"adapter {path!r} names no base_model_name_or_path; add it to adapter_config.json"
        )
    model, _ = load_model_and_tokenizer(base_name, dtype=dtype, **kwargs)
    block = read_block(path)
    placement = None if block.get("placed", False) else placement_from_block(block, model)
    pruning, similarity = pruning_from_block(block), read_similarity(path)
    if block.get("expert_order") == "original" and placement is not None:
        model = PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
        model.load_state_dict(permute_state_dict(model, model.state_dict(), placement))
        similarity = placed_similarity(similarity, placement)
        apply_occult(model, pruning=pruning, similarity=similarity, similarity_placed=True)
    else:
        apply_occult(model, placement, pruning, similarity, similarity_placed=True)
        model = PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
    if block:
        attach_occult_save(model, block)
    model.config.__dict__[OCCULT_KEY] = block
    return model
