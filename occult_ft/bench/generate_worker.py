"""One contender of the generation benchmark, inside one of its D processes (launched by torchrun).

`python -m torch.distributed.run --nproc_per_node D -m occult_ft.bench.generate_worker SPEC.json`: every
process loads the contender's model expert parallel (`occult_ft.from_pretrained(expert_parallel_size=D)`
or transformers' `DistributedConfig(ep_size=D)`), takes its own `batch` prompts (rows [r * B, (r + 1) * B)
of `spec["prompts"]`) and runs greedy `generate` `warmup + iters` times with `min_new_tokens` =
`max_new_tokens` (every rank makes the same forward calls), after a barrier each. Hooks on the model
time every forward (synchronising CUDA around it): the first of a call is the prefill, the others decode
steps. It also counts the host synchronisations of one decode step's MoE blocks, per layer
(`HostSyncCounter`). Rank 0 writes every rank's times and generated tokens to `spec["result"]`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.load import from_pretrained
from ..dispatch.comm import close_process_group, exit_rank
from ..models import find_moe_layers
from .syncs import HostSyncCounter
from .worker_results import gather_to_rank0

__all__ = ["load_contender", "main"]


def load_contender(spec: dict, world: int) -> Any:
    """The contender's model on this rank (expert parallel over the default group)."""
    contender = spec["contender"]
    device = spec["device"]
    if contender["kind"] == "hf_native_ep":
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        # as the train-step benchmark builds it: transformers asks ep_size to divide fsdp_size x tp_size
        config = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
        native = AutoModelForCausalLM.from_pretrained(
            spec["checkpoint"], distributed_config=config, dtype=torch.float32
        )
        return native.eval()
    model = from_pretrained(
        spec["checkpoint"],
        dtype=torch.float32,
        expert_parallel_size=world,
        exchange=contender["exchange"],
        nodes=spec["nodes"],
        exchange_capacity=contender["capacity"],
        device_map=f"cuda:{torch.cuda.current_device()}" if device == "cuda" else None,
    )
    return model.eval()


class _ForwardClock:
    """Wall time of every forward of the model (CUDA synchronised around it)."""

    def __init__(self, model: nn.Module, cuda: bool):
        self.cuda = cuda
        self.times: list[float] = []
        self._start = 0.0
        self.handles = [
            model.register_forward_pre_hook(self._begin),
            model.register_forward_hook(self._end),
        ]

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _begin(self, *args) -> None:
        self._start = self._now()

    def _end(self, *args) -> None:
        self.times.append(self._now() - self._start)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _syncs_per_decode_layer(model: Any, ids: torch.Tensor, eos) -> float:
    """Host synchronisations inside the MoE blocks of the second decode step, per MoE layer."""
    layers = find_moe_layers(model)
    counter = HostSyncCounter(keep_sites=False)
    counter.enabled = False
    calls = {"n": 0}

    def count(module, args, kwargs):  # the third forward of generate: prefill, decode, decode
        calls["n"] += 1

    handles = [model.register_forward_pre_hook(count, with_kwargs=True)]
    for layer in layers:
        block = layer.experts
        handles.append(
            block.register_forward_pre_hook(lambda *a: setattr(counter, "enabled", calls["n"] == 3))
        )
        handles.append(block.register_forward_hook(lambda *a: setattr(counter, "enabled", False)))
    try:
        with counter, torch.no_grad():
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=eos)
    finally:
        for handle in handles:
            handle.remove()
    return counter.count / len(layers)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    model = load_contender(spec, world)
    device = next(model.parameters()).device
    batch = spec["batch"]
    prompts = torch.load(spec["prompts"], weights_only=True)
    ids = prompts[rank * batch : (rank + 1) * batch].to(device)
    eos = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    clock = _ForwardClock(model, cuda)
    forwards: list[list[float]] = []
    tokens: list[list[int]] = []
    n = spec["new_tokens"]
    for _ in range(spec["warmup"] + spec["iters"]):
        dist.barrier()
        clock.times = []
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=eos)
        forwards.append(list(clock.times))
        tokens = out[:, ids.shape[1] :].tolist()
    clock.close()
    syncs = _syncs_per_decode_layer(model, ids, eos) if spec["contender"]["kind"] == "occult_ep" else None
    mine = {"forwards": forwards, "tokens": tokens, "syncs_per_decode_layer": syncs}
    gather_to_rank0(mine, spec["result"], world)
    close_process_group()  # the gather ended on a barrier


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank(0)
