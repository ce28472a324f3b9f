"""The run's model under expert parallelism: each rank reads only its experts from disk
(`occult_ft.checkpoint.sharded` does the reading; `load_sharded_training_model` adds the trainer's
groups, placement and dtype).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..checkpoint import read_block
from ..checkpoint.load import load_sharded_model, load_tokenizer, local_model_dir, restore_occult
from ..fileio import read_json_object
from ..models.registry import config_num_experts
from .config import OccultArguments
from .expert_parallel import check_expert_parallel_size, expert_parallel_groups

__all__ = ["load_sharded_training_model"]


def load_sharded_training_model(
    path: str, args: OccultArguments, placement=None, dtype=None
) -> tuple[nn.Module, Any]:
    """(model, tokenizer) for `OccultTrainer` under expert parallelism: this rank's shard only.

    The placement read is `placement` (a `Placement`), else `args.placement` when it is a file or
    "sequential"; `auto` reads the sequential layout first (`prepare_model` profiles it under expert
    parallelism and `place_sharded` re-reads the new block). A placed occult_ft checkpoint is read in
    its stored order and gets its pruned routing back, as `occult_ft.from_pretrained` does.
    Collective on first use (builds the expert-parallel groups): call it on every rank. Loaded in
    `dtype` when given, else `args.model_dtype`.
    """

    path = local_model_dir(path)
    size, world = int(args.expert_parallel_size), int(args.world_size)
    check_expert_parallel_size(
        size, world, config_num_experts(read_json_object(os.path.join(path, "config.json")))
    )
    groups = expert_parallel_groups(size, use_deepspeed=bool(args.deepspeed))
    stored = read_block(path)
    if stored is not None and stored.placed:
        placement = None
    elif placement is None and args.placement != "auto":
        placement = args.placement
    if dtype is None:
        dtype = None if args.model_dtype == "auto" else getattr(torch, args.model_dtype)
    model = load_sharded_model(
        path, groups.ep_ranks.index(groups.rank), size, placement, dtype=dtype, group=groups.ep_group
    )
    restore_occult(model, path)
    try:
        tokenizer = load_tokenizer(path)
    except ValueError:
        tokenizer = None
    return model, tokenizer
