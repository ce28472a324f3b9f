"""Writing pruned checkpoints: the `occult` block and native routing fields in config.json, the
similarity tables and remote code beside the weights, and a `save_pretrained` that keeps them.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from torch import nn

from ..apply import applied_similarity
from ..fileio import atomic_directory
from ..models.registry import NATIVE_ROUTING_FIELDS, get_arch, unwrap_model
from ..routing import PruningConfig
from .format import OCCULT_KEY, occult_block, pruning_from_block, write_similarity
from .remote_code import needs_remote_code, set_auto_map, write_remote_code

__all__ = [
    "write_native_group_fields",
    "occult_config_fields",
    "attach_occult_save",
    "save_pruned",
]

_MISSING = object()


def write_native_group_fields(config, pruning: PruningConfig) -> bool:
    """Express the budget in the model's own config where stock transformers can (in place; see
    `MoEArch.native_group_fields`). Returns True when the fields were written."""
    return get_arch(config).write_native_routing(config, pruning)


@contextlib.contextmanager
def occult_config_fields(
    config, block: dict, pruning: PruningConfig | None, save_dir: str | os.PathLike | None = None
):
    """Within the context, `config` carries `block` (and the native routing fields of `pruning`); the
    config's previous values come back afterwards. Wrap `save_pretrained` calls in it.

    With `save_dir` (the directory the body saves into) and a budget that the native fields cannot
    express, `config.auto_map` points `AutoModelForCausalLM` at remote code, and once the body has
    written `config.json` there the code follows it (`occult_ft.checkpoint.remote_code`): stock transformers
    with `trust_remote_code=True` then routes with the budget. A stale occult `auto_map` entry (from a
    loaded checkpoint) is dropped otherwise."""
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


def _save_pretrained_with_occult(self, save_directory, *args, **kwargs):
    """`save_pretrained` of a model that `attach_occult_save` marked: the class's own save, with the
    `occult` block (and native routing fields) in config.json and the routers' similarity tables beside
    the weights, so `occult_ft.from_pretrained` of the copy routes like this model."""
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
