"""A checkpoint's pruned routing for a serving engine: router logits in, (weights, expert ids) out.

A serving engine (vLLM) runs its own kernels and has no transformers router to hook, only the router
logits of each MoE layer. `ServedRouting` reproduces what `occult_ft.from_pretrained(DIR)`'s pruned
routers compute from those logits alone:

    routing = ServedRouting.from_checkpoint(DIR)          # None when the checkpoint routes unpruned
    weights_TK, ids_TK = routing.route(layer, logits_TE)  # layer: decoder layer index

The maths is occult_ft's own, nothing is copied: the model type's `MoEArch` predicts the model's
unpruned choice (`MoEArch.route`, the registry's prediction the router self-check proves) and
`occult_ft.routing.prune_topk` applies the budget (the pure criteria of `occult_ft.routing.rules`). The
router attributes the maths reads (top-k, `norm_topk_prob`, `routed_scaling_factor`, group limits, ...)
come from the stock transformers router of each layer, built on the meta device from the checkpoint's
config (no memory); a tensor the maths reads from the router (DeepSeek-V3's `e_score_correction_bias`)
is the engine's loaded one, given with `set_router_tensor`. A block's `device_bias` (the trainer's
device balancing) is added to the selection scores of each layer as the pruned routers add it.

`RoutingStats` counts, per MoE layer, the devices each routed token reaches (the budget's guarantee,
checked where it is served), and keeps each routed token's router input with the experts and weights
chosen for it (`record`); with `OCCULT_FT_VLLM_ROUTING_STATS=FILE` in the environment the engine's
plugin writes them to FILE after every routed batch (a test hook: it reads them on the host).

Shape legend: T tokens, E routed experts, K experts per token, D devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import torch
from torch import nn

from ..checkpoint.format import (
    LEGACY_SIMILARITY_FILES,
    OCCULT_KEY,
    SIMILARITY_FILE,
    CheckpointError,
    OccultBlock,
    check_block_kept,
    read_similarity,
)
from ..fileio import atomic_write_text, load_safetensors
from ..metrics import contiguous_expert_device
from ..models.arch import MoEArch, moe_blocks
from ..models.family import auto_model_class
from ..models.registry import get_arch
from ..routing import PruningConfig, prune_topk

__all__ = ["STATS_ENV", "RoutingStats", "ServedRouting", "similarity_tables"]

STATS_ENV = "OCCULT_FT_VLLM_ROUTING_STATS"


@dataclasses.dataclass
class RoutingStats:
    """Devices reached per routed token, per MoE layer (decoder layer index): token count, the most
    devices any token reached, and a histogram over 1..D devices."""

    num_devices: int
    layers: dict[int, dict] = dataclasses.field(default_factory=dict)
    #: per layer, every routed token's router input and routing (`add_tokens`): what the engine chose,
    #: to be compared with the pruned routers of `occult_ft.from_pretrained` on the same inputs
    tokens: dict[int, dict] = dataclasses.field(default_factory=dict)

    def add(self, layer: int, ids_TK: torch.Tensor, expert_device_E: torch.Tensor) -> None:
        t = ids_TK.shape[0]
        dev_TK = expert_device_E.to(ids_TK.device)[ids_TK.long()]
        on_TD = torch.zeros(t, self.num_devices, dtype=torch.bool, device=ids_TK.device)
        reached_T = on_TD.scatter_(1, dev_TK, True).sum(dim=1)
        hist = torch.bincount(reached_T, minlength=self.num_devices + 1).tolist()  # host read: test hook
        entry = self.layers.setdefault(layer, {"tokens": 0, "max_devices": 0, "histogram": [0] * len(hist)})
        entry["tokens"] += t
        entry["max_devices"] = max(entry["max_devices"], max((d for d, n in enumerate(hist) if n), default=0))
        entry["histogram"] = [a + b for a, b in zip(entry["histogram"], hist)]

    def add_tokens(
        self, layer: int, inputs_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor
    ) -> None:
        entry = self.tokens.setdefault(layer, {"inputs": [], "weights": [], "ids": []})
        entry["inputs"] += inputs_TH.float().tolist()  # host read: test hook
        entry["weights"] += weights_TK.float().tolist()
        entry["ids"] += ids_TK.tolist()

    def to_dict(self) -> dict:
        return {
            "num_devices": self.num_devices,
            "layers": {str(k): v for k, v in sorted(self.layers.items())},
            "tokens": {str(k): v for k, v in sorted(self.tokens.items())},
        }

    def write(self, path: str) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))


def similarity_tables(model: str, revision: str | None = None) -> dict[int, torch.Tensor] | None:
    """The similarity tables of a local checkpoint folder or a Hub repo (today's file name, else an
    earlier release's), or None."""
    if os.path.isdir(model):
        return read_similarity(model)
    from transformers.utils import cached_file

    for name in (SIMILARITY_FILE, *LEGACY_SIMILARITY_FILES):
        file = cached_file(model, name, revision=revision, _raise_exceptions_for_missing_entries=False)
        if file is not None:
            return {int(k.split(".")[1]): v for k, v in load_safetensors(file).items()}
    return None


def _meta_routers(config, arch: MoEArch) -> dict[int, nn.Module]:
    """Decoder layer index -> the stock transformers router of that MoE layer, on the meta device."""
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    return {index: getattr(block, arch.router_attr) for index, _, block in moe_blocks(arch, model)}


class ServedRouting:
    """The pruned routing of one checkpoint, as a function of each MoE layer's router logits.

    Args:
        config: the checkpoint's transformers config (carrying the `occult` block).
        pruning: the block's active budget.
        similarity: decoder layer index -> (E, E) table, for the `similarity` criterion.
        device_bias: decoder layer index -> (D,) selection bias per device (the block's `device_bias`,
            learnt by the trainer's device balancing): the top-k and the budget are taken on the biased
            scores, as the pruned routers of `occult_ft.from_pretrained` take them.
    """

    def __init__(
        self,
        config,
        pruning: PruningConfig,
        similarity: Mapping[int, torch.Tensor] | None = None,
        device_bias: Mapping[int, torch.Tensor] | None = None,
    ):
        self.arch = get_arch(config)
        self.pruning = pruning
        self.routers = _meta_routers(config, self.arch)
        if not self.routers:
            raise CheckpointError(f"the {self.arch.model_type} config has no MoE layer to route")
        some = next(iter(self.routers.values()))
        num_experts = self.arch.num_experts(some)
        pruning.check(num_experts, self.arch.top_k(some))
        self.expert_device_E = contiguous_expert_device(num_experts, pruning.num_devices)
        self.similarity = dict(similarity or {})
        if pruning.criterion == "similarity":
            missing = sorted(set(self.routers) - set(self.similarity))
            if missing:
                raise CheckpointError(
                    f"criterion 'similarity' needs {SIMILARITY_FILE} beside the checkpoint with tables for "
                    f"MoE layers {missing}; copy the file from where the checkpoint was saved"
                )
        self.device_bias = {i: b.detach().float() for i, b in (device_bias or {}).items()}
        unknown = sorted(set(self.device_bias) - set(self.routers))
        if unknown:
            raise CheckpointError(
                f"the occult block's device_bias names layers {unknown}, which are not MoE layers of this "
                f"{self.arch.model_type} model (MoE layers: {sorted(self.routers)}); re-save the checkpoint"
            )
        self.stats = RoutingStats(pruning.num_devices)
        self._on_device: dict = {}

    @classmethod
    def from_checkpoint(cls, model: str, config=None, revision: str | None = None) -> ServedRouting | None:
        """The routing of checkpoint `model` (folder or Hub id; `config` its loaded config); None when
        its block records no active budget (a placed checkpoint routes like its base)."""
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model, revision=revision)
        data = getattr(config, OCCULT_KEY, None)
        check_block_kept(config.to_dict(), f"{model}: config.json")
        block = OccultBlock.from_dict(data, f"{model}: config.json (occult)") if data else None
        if block is None or not block.pruned:
            return None
        if not block.placed:
            raise CheckpointError(
                f"{model} is a LoRA adapter saved in the base model's expert order; merge it "
                "(occult_ft.from_pretrained(DIR).merge_and_unload(), then save_pretrained) before serving"
            )
        assert block.pruning is not None  # pruned
        tables = similarity_tables(model, revision) if block.pruning.criterion == "similarity" else None
        return cls(config, block.pruning, tables, block.device_bias_tensors())

    def set_router_tensor(self, layer: int, attr: str, tensor: torch.Tensor) -> None:
        """Give layer `layer`'s router a tensor the maths reads (the engine's loaded one)."""
        router = self.routers[layer]
        *path, name = attr.split(".")
        for part in path:
            router = getattr(router, part)
        if name in router._buffers:
            router._buffers[name] = tensor
        elif name in router._parameters:
            router._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        else:
            setattr(router, name, tensor)

    def _on(self, key, tensor: torch.Tensor, device) -> torch.Tensor:
        if (key, device) not in self._on_device:
            self._on_device[(key, device)] = tensor.to(device)
        return self._on_device[(key, device)]

    def route(self, layer: int, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_TK fp32, ids_TK long) of layer `layer` under the budget, from its router logits;
        the weights are the model's own gate weights (renormalisation and scaling included)."""
        router = self.routers[layer]
        ids_TK, weights_TK, _ = self.arch.route(router, logits_TE)
        table = self.similarity.get(layer)
        if table is not None:
            table = self._on(("sim", layer), table, logits_TE.device)
        expert_device = self._on("dev", self.expert_device_E, logits_TE.device)
        bias = self.device_bias.get(layer)
        if bias is not None:
            bias = self._on(("bias", layer), bias, logits_TE.device)
        ids_TK, weights_TK, _ = prune_topk(
            self.arch,
            router,
            logits_TE,
            ids_TK,
            weights_TK,
            self.pruning,
            expert_device,
            table,
            device_bias_D=bias,
        )
        if os.environ.get(STATS_ENV):
            self.stats.add(layer, ids_TK, expert_device)
        return weights_TK.float(), ids_TK

    def record(
        self, layer: int, inputs_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor
    ) -> None:
        """With `OCCULT_FT_VLLM_ROUTING_STATS=FILE` set: keep layer `layer`'s router inputs and the
        routing `route` gave them, and write the stats to FILE (the engine calls it after `route`)."""
        path = os.environ.get(STATS_ENV)
        if path:
            self.stats.add_tokens(layer, inputs_TH, weights_TK, ids_TK)
            self.stats.write(path)
