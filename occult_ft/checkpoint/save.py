"""Writing pruned checkpoints: the `occult` block and native routing fields in config.json, the
similarity tables, remote code and the model card beside the weights.

`apply_occult` (occult_ft/apply.py) records an `OccultBlock` in the model's config and calls
`attach_occult_save`, so from then on the model's own `save_pretrained` (also through `push_to_hub`,
and on the model `merge_and_unload` returns) writes a complete pruned checkpoint, whatever produced the
model: a user's `apply_occult`, `occult_ft.from_pretrained`, or the trainer. `save_pruned` is the same
save into a directory swapped in whole, with the tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types

import torch
from torch import nn
from transformers.utils import logging

from ..fileio import atomic_directory, umask_modes
from ..models.registry import (
    NATIVE_ROUTING_FIELDS,
    config_num_experts,
    get_arch,
    text_config,
    unwrap_model,
)
from ..routing import PruningConfig, router_device_bias, router_similarity
from .card import is_occult_card, write_model_card
from .format import OCCULT_KEY, OccultBlock, PlacementRecord, model_block, write_similarity
from .remote_code import needs_remote_code, set_auto_map, write_remote_code

__all__ = [
    "write_native_group_fields",
    "occult_config_fields",
    "with_base_routing",
    "restore_base_routing",
    "with_router_bias",
    "record_block",
    "attach_occult_save",
    "save_pruned",
]

logger = logging.get_logger(__name__)
_MISSING = object()


def write_native_group_fields(config, pruning: PruningConfig | None) -> bool:
    """Express the budget in the model's own config where stock transformers can (in place; see
    `MoEArch.native_group_fields`). Returns True when the fields were written."""
    return pruning is not None and get_arch(config).write_native_routing(config, pruning)


@contextlib.contextmanager
def occult_config_fields(config, block: OccultBlock, save_dir: str | os.PathLike | None = None):
    """Within the context, `config` carries `block` (and the native routing fields of its budget); the
    config's previous values come back afterwards. Wrap `save_pretrained` calls in it.

    With `save_dir` (the directory the body saves into) and a budget that the native fields cannot
    express, `config.auto_map` points `AutoModelForCausalLM` at remote code, and once the body has
    written `config.json` there the code follows it (`occult_ft.checkpoint.remote_code`): stock
    transformers with `trust_remote_code=True` then routes with the budget. A stale occult `auto_map`
    entry (from a loaded checkpoint) is dropped otherwise."""
    inner = text_config(config)  # where the routing fields live (a multimodal config's text_config)
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name in (
        *((config, name) for name in (OCCULT_KEY, "auto_map")),
        *((inner, name) for name in NATIVE_ROUTING_FIELDS),
    )]  # fmt: skip
    block = with_base_routing(block, config)
    setattr(config, OCCULT_KEY, block.to_dict())
    # a device bias is not expressible in native fields: such a budget goes through remote code
    native = block.device_bias is None and write_native_group_fields(config, block.pruning)
    remote = save_dir is not None and needs_remote_code(block.pruning, native, config.model_type)
    set_auto_map(config, remote)
    try:
        yield config
        if (
            remote
            and save_dir is not None
            and os.path.isfile(os.path.join(os.fspath(save_dir), "config.json"))
        ):
            write_remote_code(save_dir, config)  # only where this process saved the config
    finally:
        for obj, name, value in saved:
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, value)


def with_base_routing(block: OccultBlock, config) -> OccultBlock:
    """`block` recording the model's own group-routing fields when its budget is about to be written in
    them (`OccultBlock.base_routing`): the config's values now, unless the config already carries the
    budget's (a checkpoint loaded without putting them back), whose own values only the block can know."""
    arch, fields = get_arch(config), None
    if block.device_bias is None and block.pruning is not None:
        fields = arch.native_group_fields(config_num_experts(config), block.pruning)
    if not fields:
        return block if block.base_routing is None else block.with_changes(base_routing=None)
    if arch.native_routing_matches(config.to_dict(), block.pruning):
        return block
    inner = text_config(config)
    return block.with_changes(base_routing={key: getattr(inner, key, None) for key in fields})


def restore_base_routing(model: nn.Module, block: OccultBlock) -> None:
    """Put back the model's own group-routing fields (config and routers) where a checkpoint's config
    carries its budget in them and its block recorded them (`OccultBlock.base_routing`): a no-op
    otherwise. occult_ft's loaders call it before pruning, whose routing it does not change (the
    native fields express exactly that budget, `MoEArch.native_group_fields`)."""
    if block.base_routing is None or block.pruning is None:
        return
    arch = get_arch(model)
    if arch.native_routing_matches(model.config.to_dict(), block.pruning):  # type: ignore[operator, union-attr]
        arch.set_group_fields(model, dict(block.base_routing))


def _write_card(save_directory: str) -> None:
    """The model card beside a saved checkpoint, unless a README.md that is not an occult_ft card is
    there (a user's file is never replaced); a card that cannot be built is a warning, not a failure."""
    readme = os.path.join(save_directory, "README.md")
    if os.path.exists(readme) and not is_occult_card(readme):
        logger.warning(f"{readme} is not an occult_ft model card: left as it is, no card written")
        return
    try:
        write_model_card(save_directory)
    except (OSError, ValueError) as exc:
        logger.warning(f"saved {save_directory} without its model card: {exc}")


def _save_pretrained_with_occult(self, save_directory, *args, **kwargs):
    """`save_pretrained` of a model that `attach_occult_save` marked: the class's own save, with the
    model's `occult` block (and native routing fields or remote code) in config.json, the routers'
    similarity tables beside the weights and the model card, so `occult_ft.from_pretrained` of the copy
    routes like this model."""
    # stock save_pretrained(push_to_hub=True) uploads before the side files below exist: push afterwards
    push = kwargs.pop("push_to_hub", False)
    hub = {k: kwargs.pop(k) for k in _PUSH_KWARGS if k in kwargs}
    block = model_block(self)
    if block is not None:
        block = with_router_bias(block, self)
    if block is None:  # the block was removed from the config: a plain save
        result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    else:
        with occult_config_fields(self.config, block, save_directory):
            result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", True):
        umask_modes(os.fspath(save_directory))  # safetensors writes the weights 0600
        write_similarity(os.fspath(save_directory), router_similarity(self))
        if block is not None:
            _write_card(os.fspath(save_directory))
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


def with_router_bias(block: OccultBlock, model: nn.Module) -> OccultBlock:
    """`block` with the device bias `model`'s pruned routers hold now (training moves it after the block
    was recorded); the block as it is when no router holds one or it records no budget."""
    bias = router_device_bias(unwrap_model(model))
    if bias is None or block.pruning is None:
        return block
    return block.with_changes(device_bias=OccultBlock.bias_values(bias))


def record_block(model: nn.Module, block: OccultBlock | None) -> None:
    """Record `block` (the live model's: its experts as they are in memory) in the model's config and
    make its `save_pretrained` write it (`attach_occult_save`); None removes the record."""
    base = unwrap_model(model)
    if block is None:
        base.config.__dict__.pop(OCCULT_KEY, None)
        return
    base.config.__dict__[OCCULT_KEY] = block.to_dict()
    attach_occult_save(base)


def attach_occult_save(model: nn.Module) -> None:
    """Make `model.save_pretrained` (also through `push_to_hub`, and on the model `merge_and_unload`
    returns) write a complete pruned checkpoint of the live model described by the block in its config."""
    base = unwrap_model(model)
    if "save_pretrained" not in vars(base):
        base.save_pretrained = types.MethodType(_save_pretrained_with_occult, base)  # type: ignore[assignment]


def save_pruned(
    model: nn.Module,
    out_dir: str,
    tokenizer=None,
    pruning: PruningConfig | None = None,
    placement=None,
    similarity: dict[int, torch.Tensor] | None = None,
    extra: dict | None = None,
) -> str:
    """Write an Occult model (`apply_occult`, `from_pretrained`, a trained model) as a pruned checkpoint;
    returns `out_dir`.

    The budget, the placement provenance and the similarity tables are read from the model (its
    recorded block and its pruned routers); the other arguments override what the checkpoint records:

    Args:
        model: a placed (already permuted) transformers MoE model; a PEFT model is refused (merge it
            with `merge_and_unload()`, or save the adapter with `OccultTrainer`).
        out_dir: the checkpoint directory; written into a temporary sibling and swapped in whole, so an
            interrupted write leaves the previous `out_dir` untouched and no stale file survives.
        tokenizer: saved beside the model when given.
        pruning: record this budget instead of the model's.
        placement: record this placement (original expert ids per device) as the provenance.
        similarity: save these tables (placed order) instead of the routers'.
        extra: more recorded settings (e.g. `{"base_model": "org/name"}`).
    """
    if hasattr(unwrap_model(model, keep_peft=True), "peft_config"):
        raise ValueError(
            "save_pruned writes full checkpoints and this is a PEFT (LoRA) model; merge it first "
            "(model.merge_and_unload()) or save the adapter with OccultTrainer.save_model"
        )
    base = unwrap_model(model)
    block = model_block(base) or OccultBlock.build(pruning, placement)
    changes: dict = {}
    if pruning is not None:
        budget = OccultBlock.build(pruning).pruning
        changes.update(pruning=budget, num_devices=pruning.num_devices, num_nodes=pruning.num_nodes)
    if placement is not None:
        changes.update(placement=PlacementRecord.from_placement(placement), placed=True)
        changes.setdefault("num_devices", placement.num_devices)
        changes.setdefault("num_nodes", placement.num_nodes)
    if extra:
        known = {f.name for f in dataclasses.fields(OccultBlock)}
        changes.update({k: v for k, v in extra.items() if k in known})
        changes["extra"] = {**block.extra, **{k: v for k, v in extra.items() if k not in known}}
    block = with_router_bias(block.with_changes(**changes) if changes else block, base)
    tables = similarity if similarity is not None else router_similarity(base)
    with atomic_directory(out_dir) as tmp:
        with occult_config_fields(base.config, block, tmp):
            type(base).save_pretrained(base, tmp)  # type: ignore[attr-defined]
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_similarity(tmp, tables)
        _write_card(tmp)
    return out_dir
