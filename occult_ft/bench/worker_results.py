"""How a benchmark worker (`step_worker`, `generate_worker`) hands its ranks' results to the launcher."""

from __future__ import annotations

import json

import torch.distributed as dist

from ..fileio import atomic_write_text

__all__ = ["gather_to_rank0"]


def gather_to_rank0(mine: dict, path: str, world: int) -> None:
    """Gather every rank's `mine` (collective), write the list as JSON to `path` from rank 0 through a
    temporary sibling (the launcher never reads half a file), then wait for every rank."""
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        atomic_write_text(path, json.dumps(gathered))
    dist.barrier()
