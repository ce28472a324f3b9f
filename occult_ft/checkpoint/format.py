"""The checkpoint format: the `occult` block of config.json (or `occult_config.json` of a LoRA adapter),
the similarity tables file (`occult_similarity.tables`) and the files a checkpoint directory holds. The one reader and writer of them.

The block is an `OccultBlock`, a frozen, versioned, self-validating record (as PEFT's configs are):

    OccultBlock(placed=True, num_devices=4, num_nodes=1,
                pruning=PruningConfig(4, max_devices_per_token=2, criterion="similarity"),
                placement=PlacementRecord("search", {0: ((3, 9, ...), ...), ...}),
                expert_order="placed", base_model="allenai/OLMoE-1B-7B-0924", model_type="olmoe",
                extra={"train_mode": "moe", ...})

and `to_dict` writes the flat JSON object checkpoints have always carried:

    "occult": {"version": 3, "placed": true, "num_devices": 4, "num_nodes": 1,
               "max_devices_per_token": 2, "max_nodes_per_token": null, "criterion": "similarity",
               "gate_weights": "model", "placement": {"algorithm": "search", "layers": {"0": [[...]]}},
               "expert_order": "placed", "base_model": "...", "model_type": "olmoe", "train_mode": "moe",
               "device_bias": {"0": [0.004, -0.002, 0.0, -0.002], ...}}

(`base_routing`, e.g. `{"n_group": 1, "topk_group": 1}`, where config.json carries the budget in the
model's own group-routing fields.)

`from_dict` reads every version written so far (1: occult_ft 0.1, the same keys without
`expert_order`/`model_type`; 2: without `device_bias`; 3: without `base_routing`) and refuses newer ones, contradictions (a placement for another device
count than the block's, a budget for another layout, duplicate layers) and bad values in one line that
names the file. Other modules read blocks only through this class and `read_block` / `model_block`; `pruned` is the one definition of "a budget restricts the routing" (device or node budget).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checks import is_int, is_positive_int, nodes_divide
from ..fileio import atomic_save, atomic_write_text, load_safetensors, read_json_object
from ..models.family import architecture_model_type
from ..models.registry import NATIVE_ROUTING_FIELDS, config_num_experts, lookup_arch, unwrap_model
from ..placement import Placement
from ..routing import PruningConfig
from .convert import DEEPSEEK_MODEL_TYPE

__all__ = [
    "OCCULT_KEY",
    "SIMILARITY_FILE",
    "LEGACY_SIMILARITY_FILES",
    "ADAPTER_OCCULT_FILE",
    "REMOTE_MODULE",
    "REMOTE_CODE_FILE",
    "AUTO_CLASS",
    "BLOCK_VERSION",
    "EXPERT_ORDERS",
    "PRUNING_KEYS",
    "KNOWN_KEYS",
    "CheckpointError",
    "PlacementRecord",
    "OccultBlock",
    "read_block",
    "check_block_kept",
    "model_block",
    "block_placement",
    "CheckpointSummary",
    "similarity_file",
    "read_similarity",
    "write_similarity",
    "write_adapter_block",
    "has_remote_code",
    "describe_checkpoint",
]

OCCULT_KEY = "occult"
SIMILARITY_FILE = "occult_similarity.tables"
"""The similarity tables (safetensors bytes). Its name must not end in `.safetensors` (nor `.bin`, `.pt`):
serving engines and Hub downloads glob `*.safetensors` as weight shards, and vLLM read occult_ft 0.1's
`occult_similarity.safetensors` as the weights of a model named `layers`."""
LEGACY_SIMILARITY_FILES = ("occult_similarity.safetensors",)
"""Names earlier releases wrote the tables under (read, never written; removed when the tables are
rewritten beside them)."""
ADAPTER_OCCULT_FILE = "occult_config.json"
REMOTE_MODULE = "occult_pruned_routing"
REMOTE_CODE_FILE = f"{REMOTE_MODULE}.py"
AUTO_CLASS = "AutoModelForCausalLM"
BLOCK_VERSION = 4
"""Version written now. 1: occult_ft 0.1 (no `expert_order` / `model_type` keys); 2: the typed block;
3: `device_bias` (the pruned routers' selection bias per device, optional); 4: `base_routing` (the
model's own group-routing fields where config.json's carry the budget, optional)."""
EXPERT_ORDERS = ("placed", "original")
PRUNING_KEYS = ("max_devices_per_token", "max_nodes_per_token", "criterion", "gate_weights")
KNOWN_KEYS = (
    "version",
    "placed",
    "num_devices",
    "num_nodes",
    *PRUNING_KEYS,
    "placement",
    "expert_order",
    "base_model",
    "model_type",
    "device_bias",
    "base_routing",
)


class CheckpointError(ValueError):
    """A model path or checkpoint that cannot be used."""


@dataclass(frozen=True)
class PlacementRecord:
    """Which original experts each device holds, per MoE layer: the provenance of a placed model (its
    weights are already permuted, so device d holds placed experts [d*E/D, (d+1)*E/D)).

    Args:
        algorithm: the placement algorithm that produced it.
        groups: MoE layer index -> one tuple of original expert ids per device (equal sizes).
    """

    algorithm: str
    groups: Mapping[int, tuple[tuple[int, ...], ...]]

    @property
    def num_devices(self) -> int:
        return len(next(iter(self.groups.values())))

    @property
    def num_experts(self) -> int:
        return sum(len(g) for g in next(iter(self.groups.values())))

    def to_dict(self) -> dict:
        return {
            "algorithm": self.algorithm,
            "layers": {str(i): [list(g) for g in groups] for i, groups in sorted(self.groups.items())},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "the occult block") -> PlacementRecord:
        """Validated: layers keyed by distinct integers, each a partition of range(E) into equal groups."""
        if not isinstance(data, Mapping) or not isinstance(data.get("layers"), Mapping) or not data["layers"]:
            raise CheckpointError(
                f"{source}: placement must be an object with non-empty 'layers'; rewrite it with occult_ft"
            )
        algorithm = data.get("algorithm", "unknown")
        groups: dict[int, tuple[tuple[int, ...], ...]] = {}
        for key, layer in data["layers"].items():
            try:
                index = int(key)
            except (TypeError, ValueError):
                raise CheckpointError(f"{source}: placement layer key {key!r} is not an integer") from None
            if index in groups:
                raise CheckpointError(
                    f"{source}: placement lists MoE layer {index} twice (keys such as '1' and '01'); keep one"
                )
            if (
                not isinstance(layer, (list, tuple))
                or not layer
                or not all(isinstance(g, (list, tuple)) and all(is_int(e) for e in g) for g in layer)
            ):
                raise CheckpointError(
                    f"{source}: placement layer {index} must be a list of expert-id lists, one per device"
                )
            groups[index] = tuple(tuple(int(e) for e in g) for g in layer)
        record = cls(str(algorithm), groups)
        record.check(source)
        return record

    def check(self, source: str = "the occult block") -> None:
        """Every layer: D equal groups forming a permutation of range(E), the same D and E everywhere."""
        d, e = self.num_devices, self.num_experts
        for index, layer in self.groups.items():
            flat = sorted(x for g in layer for x in g)
            if len(layer) != d or flat != list(range(e)) or len({len(g) for g in layer}) != 1:
                raise CheckpointError(
                    f"{source}: placement layer {index} is not a partition of the {e} experts into {d} equal "
                    "groups; rewrite the placement with occult-ft place"
                )

    @classmethod
    def from_placement(cls, placement: Placement) -> PlacementRecord:
        return cls(
            placement.algorithm,
            {
                int(i): tuple(tuple(int(e) for e in g) for g in groups)
                for i, groups in placement.groups.items()
            },
        )

    def expert_order(self, layer: int) -> list[int]:
        """Original expert id of each placed slot of `layer`."""
        return [e for g in self.groups[layer] for e in g]


@dataclass(frozen=True)
class OccultBlock:
    """The `occult` block of a checkpoint: how its experts are placed and how its routing is pruned.

    Args:
        placed: the stored experts are in placed order (device d holds [d*E/D, (d+1)*E/D)); False for a
            LoRA adapter whose base model is stored unplaced.
        num_devices: D, the expert-parallel layout the placement and the budget refer to (None when the
            block records neither).
        num_nodes: N, the nodes the D devices span.
        pruning: the budget (None: routing is the model's own top-k).
        placement: placement provenance (None when unknown).
        expert_order: order of the expert tensors of a LoRA adapter: `placed` or `original` (the base
            model's own order, what training saves for stock PEFT).
        base_model: the model this checkpoint derives from.
        model_type: HF model_type of the base (recorded for adapters).
        extra: other recorded settings (`train_mode`, `comm_complexity_before/after`, `license`, ...),
            JSON values, written and read back as they are.
        device_bias: MoE layer index -> one selection bias per device (`occult_ft.routing.rules.
            add_device_bias`), learnt by the trainer's device balancing; None: no bias. Needs a budget.
        base_routing: the model's own values of the group-routing fields (`NATIVE_ROUTING_FIELDS`:
            `n_group`, `topk_group`, `topk_method`; None for one it did not set) where config.json
            carries the budget in them instead (`MoEArch.native_group_fields`, so that stock
            transformers routes pruned by itself). occult_ft's loaders put them back before pruning,
            so the unpruned routing (the removed mass, another budget in `analyze`) is the model's own.
            None: config.json's fields are the model's own (or, before version 4, unknown).
        version: the format version read (`BLOCK_VERSION` for new blocks).
    """

    placed: bool = True
    num_devices: int | None = None
    num_nodes: int = 1
    pruning: PruningConfig | None = None
    placement: PlacementRecord | None = None
    expert_order: str = "placed"
    base_model: str | None = None
    model_type: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    device_bias: Mapping[int, tuple[float, ...]] | None = None
    base_routing: Mapping[str, Any] | None = None
    version: int = BLOCK_VERSION

    def __post_init__(self):
        self._check("the occult block")

    def _check(self, source: str) -> None:
        if not is_int(self.version) or not 1 <= self.version <= BLOCK_VERSION:
            raise CheckpointError(
                f"{source}: version {self.version!r} was written by a newer occult_ft (this one reads 1.."
                f"{BLOCK_VERSION}); upgrade occult_ft"
            )
        if not isinstance(self.placed, bool):
            raise CheckpointError(f"{source}: placed={self.placed!r} must be true or false")
        d, n = self.num_devices, self.num_nodes
        if d is not None and not is_positive_int(d):
            raise CheckpointError(f"{source}: num_devices={d!r} must be a positive integer")
        if not (is_positive_int(n) if d is None else nodes_divide(d, n)):
            raise CheckpointError(
                f"{source}: num_nodes={n!r} must be a positive integer dividing num_devices={d}"
            )
        if self.expert_order not in EXPERT_ORDERS:
            raise CheckpointError(
                f"{source}: expert_order={self.expert_order!r} must be one of {', '.join(EXPERT_ORDERS)}"
            )
        if (self.pruning is not None or self.placement is not None) and d is None:
            raise CheckpointError(f"{source}: a budget or a placement needs num_devices; the block has none")
        p = self.pruning
        if p is not None and (p.num_devices != d or p.num_nodes != n):
            raise CheckpointError(
                f"{source}: the budget is for {p.num_devices} devices on {p.num_nodes} nodes but the block "
                f"records {d} devices on {n} nodes; rewrite the checkpoint with occult_ft"
            )
        if self.placement is not None and self.placement.num_devices != d:
            raise CheckpointError(
                f"{source}: num_devices={d} but its placement lists {self.placement.num_devices} groups per "
                "layer; the block contradicts itself: re-save the checkpoint with occult_ft"
            )
        for key in self.extra:
            if key in KNOWN_KEYS:
                raise CheckpointError(f"{source}: extra setting {key!r} shadows a field of the block")
        self._check_device_bias(source)
        self._check_base_routing(source)

    def _check_base_routing(self, source: str) -> None:
        """The model's own group fields: only `NATIVE_ROUTING_FIELDS`, ints or strings (or null), and only
        beside a budget (they are recorded where the budget replaced them)."""
        if self.base_routing is None:
            return
        if self.pruning is None:
            raise CheckpointError(
                f"{source}: base_routing is recorded without a budget (it is what a budget's native fields "
                "replaced); drop base_routing or record max_devices_per_token"
            )
        if not isinstance(self.base_routing, Mapping) or not self.base_routing:
            raise CheckpointError(
                f"{source}: base_routing={self.base_routing!r} must map {', '.join(NATIVE_ROUTING_FIELDS)} "
                "to the model's own values; re-save the checkpoint with occult_ft"
            )
        for key, value in self.base_routing.items():
            if key not in NATIVE_ROUTING_FIELDS or not (
                value is None or isinstance(value, str) or is_int(value)
            ):
                raise CheckpointError(
                    f"{source}: base_routing {key!r}: {value!r} is not a group-routing field of "
                    f"{', '.join(NATIVE_ROUTING_FIELDS)} with an int or string value; re-save the checkpoint "
                    "with occult_ft"
                )

    def _check_device_bias(self, source: str) -> None:
        """A bias is a budget's: D finite numbers per MoE layer."""
        if self.device_bias is None:
            return
        if self.pruning is None:
            raise CheckpointError(
                f"{source}: device_bias is recorded without a budget (it only steers pruned routing); "
                "drop device_bias or record max_devices_per_token"
            )
        for index, values in self.device_bias.items():
            if (
                not is_int(index)
                or len(values) != self.num_devices
                or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
            ):
                raise CheckpointError(
                    f"{source}: device_bias of MoE layer {index!r} must be {self.num_devices} finite numbers "
                    f"(one per device), got {list(values)!r}; re-save the checkpoint with occult_ft"
                )

    @classmethod
    def build(
        cls,
        pruning: PruningConfig | None = None,
        placement: Placement | PlacementRecord | None = None,
        *,
        placed: bool = True,
        num_devices: int | None = None,
        num_nodes: int | None = None,
        expert_order: str = "placed",
        base_model: str | None = None,
        model_type: str | None = None,
        device_bias: Mapping[int, Any] | None = None,
        **extra,
    ) -> OccultBlock:
        """The block of a model placed by `placement` and pruned by `pruning` (D and N taken from them
        when not given; a pruning config without a budget is recorded as no pruning)."""
        record = placement if isinstance(placement, PlacementRecord) or placement is None else None
        if isinstance(placement, Placement):
            record = PlacementRecord.from_placement(placement)
        if num_devices is None:
            num_devices = (
                pruning.num_devices if pruning is not None else getattr(placement, "num_devices", None)
            )
        if num_nodes is None:
            num_nodes = (
                pruning.num_nodes if pruning is not None else getattr(placement, "num_nodes", None) or 1
            )
        budget = (
            pruning
            if pruning is not None
            and (pruning.max_devices_per_token is not None or pruning.max_nodes_per_token is not None)
            else None
        )
        return cls(
            placed=placed,
            num_devices=num_devices,
            num_nodes=num_nodes,
            pruning=budget,
            placement=record,
            expert_order=expert_order,
            base_model=base_model,
            model_type=model_type,
            extra=dict(extra),
            device_bias=cls.bias_values(device_bias) if budget is not None else None,
        )

    @staticmethod
    def bias_values(bias: Mapping[int, Any] | None) -> dict[int, tuple[float, ...]] | None:
        """layer -> tuple of floats from tensors or lists (None and {} stay None)."""
        if not bias:
            return None
        out = {}
        for index, values in bias.items():
            seq = values.tolist() if isinstance(values, torch.Tensor) else values
            out[int(index)] = tuple(float(v) for v in seq)
        return out

    def device_bias_tensors(self) -> dict[int, torch.Tensor] | None:
        """layer -> (D,) fp32 tensor of the recorded bias (None without one)."""
        if self.device_bias is None:
            return None
        return {i: torch.tensor(v, dtype=torch.float32) for i, v in self.device_bias.items()}

    # ---- what it means ----------------------------------------------------------------------------
    @property
    def pruned(self) -> bool:
        """A device or node budget restricts the routing (below D devices or below N nodes)."""
        return self.pruning is not None and self.pruning.active

    def with_changes(self, **changes) -> OccultBlock:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- (de)serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The flat JSON object of config.json's `occult` entry / `occult_config.json`."""
        out: dict[str, Any] = {
            "version": BLOCK_VERSION,
            "placed": self.placed,
            "num_devices": self.num_devices,
            "num_nodes": self.num_nodes,
        }
        if self.pruning is not None:
            out.update({k: getattr(self.pruning, k) for k in PRUNING_KEYS})
        if self.placement is not None:
            out["placement"] = self.placement.to_dict()
        out["expert_order"] = self.expert_order
        for key in ("base_model", "model_type"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.device_bias is not None:
            out["device_bias"] = {str(i): list(v) for i, v in sorted(self.device_bias.items())}
        if self.base_routing is not None:
            out["base_routing"] = dict(self.base_routing)
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "the occult block") -> OccultBlock:
        """The block of a saved `occult` entry (any version so far), validated.

        Raises:
            CheckpointError: one line naming `source` and the bad field.
        """
        if not isinstance(data, Mapping):
            raise CheckpointError(
                f"{source}: the occult block must be a JSON object, got {type(data).__name__}"
            )
        get = data.get
        version = get("version", 1)
        num_devices, num_nodes = get("num_devices"), get("num_nodes", 1)
        pruning = None
        if get("max_devices_per_token") is not None or get("max_nodes_per_token") is not None:
            try:
                pruning = PruningConfig(
                    num_devices=num_devices,  # type: ignore[arg-type]  # PruningConfig refuses a bad value
                    max_devices_per_token=get("max_devices_per_token"),
                    criterion=get("criterion") or "score",
                    gate_weights=get("gate_weights") or "model",
                    num_nodes=num_nodes,
                    max_nodes_per_token=get("max_nodes_per_token"),
                )
            except ValueError as err:
                raise CheckpointError(f"{source}: {err}") from None
        placement = PlacementRecord.from_dict(get("placement"), source) if get("placement") else None
        extra = {k: v for k, v in data.items() if k not in KNOWN_KEYS}
        bias = get("device_bias")
        if bias is not None:
            if not isinstance(bias, Mapping) or not all(
                isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v)
                for v in bias.values()
            ):
                raise CheckpointError(
                    f"{source}: device_bias must map MoE layer indices to lists of numbers; re-save the "
                    "checkpoint with occult_ft"
                )
            try:
                bias = {int(k): tuple(float(x) for x in v) for k, v in bias.items()}
            except (TypeError, ValueError):
                raise CheckpointError(f"{source}: device_bias layer keys must be integers") from None
        try:
            return cls(
                placed=get("placed", True),
                num_devices=num_devices,
                num_nodes=num_nodes,
                pruning=pruning,
                placement=placement,
                expert_order=get("expert_order") or "placed",
                base_model=get("base_model"),
                model_type=get("model_type"),
                extra=extra,
                device_bias=bias,
                base_routing=get("base_routing"),
                version=version,
            )
        except CheckpointError as err:
            raise CheckpointError(str(err).replace("the occult block", source, 1)) from None


# ---- reading blocks -------------------------------------------------------------------------------
def read_block(path: str | os.PathLike) -> OccultBlock | None:
    """The block of a checkpoint directory: `occult_config.json` of a LoRA adapter, else the `occult`
    entry of `config.json`; None when it has none."""
    path = os.fspath(path)
    adapter_file, config_file = os.path.join(path, ADAPTER_OCCULT_FILE), os.path.join(path, "config.json")
    if os.path.isfile(adapter_file):
        return OccultBlock.from_dict(read_json_object(adapter_file), adapter_file)
    if os.path.isfile(config_file):
        config = read_json_object(config_file)
        check_block_kept(config, config_file)
        data = config.get(OCCULT_KEY)
        return OccultBlock.from_dict(data, f"{config_file} (occult)") if data else None
    return None


def check_block_kept(config: Mapping, source: str) -> None:
    """Refuse a config.json (a dict) that names occult_ft's pruned-routing class (`Occult<Base>` in
    `architectures`, or `auto_map` into `occult_pruned_routing.py`) but lost its `occult` block: every
    loader would route it with the unpruned top-k over experts stored in placed order."""
    if config.get(OCCULT_KEY):
        return
    names = [str(a) for a in config.get("architectures") or [] if str(a).startswith("Occult")]
    names += [
        str(v) for v in (config.get("auto_map") or {}).values() if str(v).startswith(f"{REMOTE_MODULE}.")
    ]
    if names:
        raise CheckpointError(
            f"{source} names {names[0]} (a checkpoint occult_ft pruned) but has no occult block, without which "
            "it would route unpruned; put back the config.json it was saved with"
        )


def model_block(model: nn.Module) -> OccultBlock | None:
    """The block a loaded or applied model carries in its config (None for a plain model)."""
    data = getattr(unwrap_model(model).config, OCCULT_KEY, None)
    return OccultBlock.from_dict(data, "the model config's occult block") if data else None


def block_placement(block: OccultBlock | None, model_type: str | None = None) -> Placement | None:
    """The placement a block records, as a `Placement` (None when it records none)."""
    if block is None or block.placement is None:
        return None
    record = block.placement
    return Placement(
        model=block.base_model,
        model_type=model_type or block.model_type,
        num_experts=record.num_experts,
        num_devices=record.num_devices,
        num_nodes=block.num_nodes,
        algorithm=record.algorithm,
        groups={i: [list(g) for g in groups] for i, groups in record.groups.items()},
        metrics={},
    )


# ---- side files ----------------------------------------------------------------------------------
def similarity_file(path: str) -> str | None:
    """The similarity tables file of checkpoint directory `path` (today's name, else a name an earlier
    release wrote), or None."""
    for name in (SIMILARITY_FILE, *LEGACY_SIMILARITY_FILES):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return file
    return None


def read_similarity(path: str) -> dict[int, torch.Tensor] | None:
    """The similarity criterion's tables saved beside a checkpoint (placed order), or None."""
    file = similarity_file(path)
    if file is None:
        return None
    return {int(k.split(".")[1]): v for k, v in load_safetensors(file).items()}


def write_similarity(out_dir: str, similarity: dict[int, torch.Tensor] | None) -> None:
    """Write the similarity tables (placed order) beside a checkpoint (nothing when None/empty); a tables
    file under an earlier release's name is removed, so no file there looks like a weight shard."""
    if not similarity:
        return
    from safetensors.torch import save_file

    tables = {f"layers.{i}": t.detach().float().contiguous().cpu() for i, t in similarity.items()}
    atomic_save(os.path.join(out_dir, SIMILARITY_FILE), lambda tmp: save_file(tables, tmp))
    for name in LEGACY_SIMILARITY_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, name))


def write_adapter_block(out_dir: str, block: OccultBlock) -> None:
    """Write a LoRA adapter's `occult_config.json`."""
    atomic_write_text(os.path.join(out_dir, ADAPTER_OCCULT_FILE), json.dumps(block.to_dict(), indent=2))


def has_remote_code(path: str, config: dict) -> bool:
    """A checkpoint directory whose config.json (a dict) maps an auto class (`AutoModelForCausalLM`, or
    `AutoModelForImageTextToText` for a multimodal type) to our file, and the file is there."""
    targets = [str(v) for v in (config.get("auto_map") or {}).values()]
    ours = any(target.startswith(f"{REMOTE_MODULE}.") for target in targets)
    return ours and os.path.isfile(os.path.join(path, REMOTE_CODE_FILE))


# ---- what a directory holds ------------------------------------------------------------------------
@dataclass
class CheckpointSummary:
    """What a checkpoint directory records (for model cards and checks).

    Args:
        path: the checkpoint directory.
        kind: `"full"` (config.json) or `"adapter"` (adapter_config.json).
        block: the `OccultBlock` (None when there is none).
        config: config.json as a dict ({} for adapters).
        adapter: adapter_config.json as a dict ({} for full checkpoints).
        base_model: the model this checkpoint derives from, when recorded.
        model_type: HF model_type, when known.
        num_experts: E routed experts per layer, when known.
        top_k: k experts per token, when known.
        native_routing: the budget is written in the model's own config (`n_group` / `topk_group`).
        has_similarity: the similarity tables file is present (`similarity_file`).
        has_tokenizer: tokenizer files are present.
        remote_code: config.json's `auto_map` sends `AutoModelForCausalLM` to the checkpoint's
            `occult_pruned_routing.py` (stock transformers routes with the budget under
            `trust_remote_code=True`).
    """

    path: str
    kind: str
    block: OccultBlock | None = None
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
        """A device or node budget restricts the routing (`OccultBlock.pruned`)."""
        return self.block is not None and self.block.pruned

    @property
    def needs_occult_ft(self) -> bool:
        """Stock transformers would route differently from training (or cannot attach the placement)."""
        return (self.kind == "adapter" and self.block is not None) or (
            self.pruned and not self.native_routing
        )


def describe_checkpoint(checkpoint_dir: str | os.PathLike) -> CheckpointSummary:
    """Read the config files of a full or adapter checkpoint directory.

    Raises:
        CheckpointError: the directory is missing, holds neither config.json nor adapter_config.json, or
            its occult block is broken.
    """
    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint directory {path!r} does not exist; pass the folder written by save/train"
        )
    config_file, adapter_file = os.path.join(path, "config.json"), os.path.join(path, "adapter_config.json")
    block = read_block(path)
    if os.path.isfile(adapter_file):
        adapter = read_json_object(adapter_file)
        summary = CheckpointSummary(path, "adapter", block=block, adapter=adapter)
        summary.base_model = (block and block.base_model) or adapter.get("base_model_name_or_path")
        summary.model_type = block.model_type if block else None
    elif os.path.isfile(config_file):
        config = read_json_object(config_file)
        if config.get("model_type") != DEEPSEEK_MODEL_TYPE:  # converted on load; any other unknown type:
            architecture_model_type(config, config_file)  # refused in one line naming it
        summary = CheckpointSummary(path, "full", block=block, config=config)
        summary.base_model = (block and block.base_model) or config.get("_name_or_path") or None
        summary.model_type = config.get("model_type")
        summary.num_experts = config_num_experts(config)
        summary.top_k = int(config["num_experts_per_tok"]) if config.get("num_experts_per_tok") else None
        arch = lookup_arch(summary.model_type)
        summary.native_routing = bool(
            arch is not None
            and block is not None
            and block.device_bias is None  # native fields cannot carry the bias
            and arch.native_routing_matches(config, block.pruning)
        )
        summary.remote_code = has_remote_code(path, config)
    else:
        raise CheckpointError(
            f"{path!r} is not a checkpoint (no config.json or adapter_config.json); "
            "pass the directory written by save_pruned, save_model or the trainer"
        )
    if summary.num_experts is None and block is not None and block.placement is not None:
        summary.num_experts = block.placement.num_experts
    summary.has_similarity = similarity_file(path) is not None
    summary.has_tokenizer = any(
        os.path.isfile(os.path.join(path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    return summary
