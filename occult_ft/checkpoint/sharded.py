"""Each rank reads only what it holds: an expert-parallel model built straight from safetensors files.

`occult_ft.checkpoint.load.load_sharded_model(path, rank, size, placement)` (built here by
`build_sharded_model`) never materialises an expert the rank does not hold,
on the host or on its device:

1. the model skeleton is built on the `meta` device (`auto_model_class(config).from_config`);
2. the placement is checked on the skeleton (`permute_experts` on meta tensors only validates), then
   every MoE layer's fused expert tensors are cut, still on meta, to the P = E / D experts of block
   `rank` of the *placed* order, and the kernel is switched to "occult_ep" (the same `ExpertShard`
   record as `occult_ft.dispatch.shard_experts` writes);
3. the skeleton is materialised (`to_empty`) and every tensor is read from disk with plain file reads
   straight into its parameter (no mmap, so no page of the file counts in this process's memory):
   replicated tensors whole (router rows reordered by the placement at read time), expert tensors only
   for the original ids `order[rank * P : (rank + 1) * P]`, in placed order.

Checkpoint key names come from transformers' own conversion mapping (see `_conversions`).

`place_sharded(model, placement)` re-reads the expert block and the router rows of a model loaded
this way in a new placed order (what `placement: auto` does after profiling the sequential layout).

Shape legend: E experts of a layer, D expert-parallel size, P = E / D, H hidden, I expert intermediate.
"""

from __future__ import annotations

import io
import json
import os
import re
from typing import Any, cast

import torch
from torch import nn

from ..apply import resolve_placement
from ..dispatch import EXPERTS_IMPLEMENTATION, ExpertShard
from ..fileio import reading
from ..layout import ExpertLayout
from ..models.family import auto_model_class
from ..models.registry import MoELayer, find_moe_layers, unwrap_model
from ..placement import permute_experts

__all__ = [
    "SafetensorsReader",
    "check_unquantized",
    "build_sharded_model",
    "place_sharded",
    "sharded_placement",
]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsReader:
    """Tensors of the `*.safetensors` files of a model directory, read with plain `readinto` calls.

    Attributes:
        entries: checkpoint key -> (file, dtype, shape, byte offset of its data in the file).
    """

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(
                f"{directory!r} holds no *.safetensors weights; save the model with save_pretrained "
                "(safetensors) or use expert_parallel_size=1"
            )
        self.entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int]] = {}
        for name in files:
            path = os.path.join(directory, name)
            with reading(path, fix="it is truncated or not a safetensors file: write or download it again"):
                with open(path, "rb") as fh:
                    size = int.from_bytes(fh.read(8), "little")
                    if not 0 < size <= os.path.getsize(path) - 8:
                        raise EOFError(f"its header length {size} does not fit the file")
                    header = json.loads(fh.read(size))
                last = max(
                    (int(m["data_offsets"][1]) for k, m in header.items() if k != "__metadata__"), default=0
                )
                if 8 + size + last > os.path.getsize(path):
                    raise EOFError(
                        f"it holds {os.path.getsize(path)} bytes, its header describes {8 + size + last}"
                    )
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in _DTYPES:
                    raise ValueError(
                        f"{path}: tensor {key!r} has dtype {meta['dtype']}, which the sharded loader does not "
                        "read; use expert_parallel_size=1 or convert the checkpoint"
                    )
                start = 8 + size + int(meta["data_offsets"][0])
                self.entries[key] = (path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), start)
        self._handles: dict[str, io.BufferedReader] = {}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][2]

    def read_into(self, key: str, out: torch.Tensor, rows: list[int] | None = None) -> None:
        """Copy tensor `key` (or its dim-0 `rows`, in that order) into `out` (same shape, any dtype)."""
        path, dtype, shape, start = self.entries[key]
        want = (len(rows), *shape[1:]) if rows is not None else shape
        if tuple(out.shape) != tuple(want):
            raise ValueError(
                f"checkpoint tensor {key!r} gives shape {want}, the model expects {tuple(out.shape)}"
            )
        direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(want, dtype=dtype)
        fh = self._handles.get(path)
        if fh is None:
            fh = self._handles[path] = open(path, "rb")
        flat = target.reshape(len(rows), -1) if rows is not None else target.reshape(1, -1)
        row_bytes = flat[0].numel() * flat.element_size() if flat.shape[0] else 0
        for j, row in enumerate(rows if rows is not None else [0]):
            fh.seek(start + row * row_bytes)
            fh.readinto(memoryview(flat[j].view(torch.uint8).numpy()))  # type: ignore[arg-type]
        if not direct:
            out.copy_(target)

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles = {}


# ---- key mapping: which checkpoint tensors make which model tensor ----------------------------------
# transformers.conversion_mapping.get_model_conversion_mapping names the checkpoint keys: per-expert Hub
# tensors (`...experts.3.w1.weight`) are assembled into the fused (P, 2I, H) / (P, H, I) blocks as its
# `MergeModulelist(dim=0)` (+ `Concatenate(dim=1)`) operations say, each expert read into its own rows;
# other operation chains run transformers' operations on this rank's experts only. Fused tensors stored
# as such (`...experts.gate_up_proj`, (E, ...)) are read row by row. Tied weights are re-tied and buffers
# missing from the checkpoint (rotary `inv_freq`) are initialised by transformers' `initialize_weights`,
# which skips every tensor read from disk.
def _conversions(model: nn.Module):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return [t for t in transforms if not isinstance(t, WeightConverter)], converters


def _plan(model: nn.Module, reader: SafetensorsReader):
    """model key -> ("plain", ckpt key) or ("converted", converter, {pattern: {expert id: ckpt key}})."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _conversions(model)
    meta_state = model.state_dict()
    plan: dict[str, tuple] = {}
    for key in reader.entries:
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)  # type: ignore[arg-type]
        if pattern is None:
            plan[target] = ("plain", key)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        renamed = key
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        items = plan.setdefault(target, ("converted", converter, {}))[2].setdefault(pattern, {})
        found = re.search(pattern.replace("*.", r"(\d+)\."), renamed)  # the item (expert) id of the key
        items[int(found.group(1)) if found and found.groups() else len(items)] = key
    return plan


def _fill_converted(model, reader, target, converter, sources, out, experts: list[int] | None):
    """Fill `out` from per-item checkpoint tensors `sources` {pattern: {index: key}}, items `experts`
    (default all, in index order) stacked on dim 0."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    patterns = [p for p in converter.source_patterns if p in sources]
    stacked = experts is not None and not any("*" in p for p in patterns)  # one tensor holds every expert
    ids = sorted(sources[patterns[0]]) if experts is None or stacked else experts
    ops = converter.operations
    simple = (
        isinstance(ops[0], MergeModulelist)
        and ops[0].dim == 0
        and (len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1))
    )
    if simple and not stacked and (len(ops) == 2 or len(patterns) == 1):
        # MergeModulelist(0) stacks the items; Concatenate(1) then joins the patterns along each item's rows
        for j, e in enumerate(ids):
            row = 0
            for p in patterns:
                key = sources[p][e]
                rows = reader.shape(key)[0]
                reader.read_into(key, out[j].narrow(0, row, rows))
                row += rows
            if row != out.shape[1]:
                raise ValueError(f"{target}: checkpoint rows {row} do not fill the model's {out.shape[1]}")
        return
    collected: dict[str, Any] = {}  # pattern -> per-item tensors, then what the converter ops make
    for p in patterns:
        collected[p] = []
        for e in ids:
            shape = reader.shape(sources[p][e])
            tensor = torch.empty(shape, dtype=reader.entries[sources[p][e]][1])
            reader.read_into(sources[p][e], tensor)
            collected[p].append(tensor)
    for op in ops:
        collected = op.convert(
            collected,
            source_patterns=converter.source_patterns,
            target_patterns=converter.target_patterns,
            full_layer_name=target,
            model=model,
            config=model.config,
        )
    (value,) = collected.values()
    if stacked:  # Inkling 2 stores the fused experts whole: convert them, then keep this rank's rows
        value = value.index_select(0, torch.tensor(experts, device=value.device))
    out.copy_(value)


def _expert_tensors(model: nn.Module) -> dict[str, tuple[MoELayer, str, int]]:
    """model key of every expert-indexed tensor (fused experts, router and block rows) -> (MoE layer,
    kind, expert dim), kind "experts" or "router" (router and block tensors: all experts, placed order)."""
    out = {}
    for layer in find_moe_layers(model):
        for kind, path, dim in layer.expert_tensors():
            out[f"{layer.name}.{path}"] = (layer, "experts" if kind == "experts" else "router", dim)
    return out


@torch.no_grad()
def _read(model: nn.Module, reader: SafetensorsReader, placement, only_placed: bool) -> set[str]:
    """Read every model tensor found in the checkpoint (only the expert and router tensors when
    `only_placed`); returns the model keys that were read."""
    plan = _plan(model, reader)
    placed = _expert_tensors(model)
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    done = set()
    for target, tensor in tensors.items():
        if target not in plan or (only_placed and target not in placed):
            continue
        layer, kind, dim = placed.get(target, (None, None, 0))
        order = placement.expert_order(layer.index).tolist() if layer is not None else None
        ids = None
        whole = kind == "router" and dim != 0  # a (1, E) vector: read whole, then reorder its expert dim
        if kind == "experts":
            assert layer is not None and order is not None  # expert tensors come from an MoE layer
            shard = cast(ExpertShard, layer.experts.occult_shard)
            start = shard.rank * shard.experts_per_device
            ids = order[start : start + shard.experts_per_device]
        elif kind == "router" and not whole:
            ids = order
        entry = plan[target]
        if entry[0] == "plain":
            reader.read_into(entry[1], tensor, rows=ids)
        else:
            _fill_converted(model, reader, target, entry[1], entry[2], tensor, ids)
        if whole:
            tensor.copy_(tensor.index_select(dim, torch.tensor(order, device=tensor.device)))
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]
        done.add(target)
    return done


# ---- building the model ---------------------------------------------------------------------------------
def _shard_on_meta(base: nn.Module, rank: int, size: int, group, nodes: int = 1) -> None:
    """`shard_experts` on the meta skeleton: every layer keeps P = E / D experts (still meta)."""
    previous: str | None = base.config._experts_implementation  # type: ignore[union-attr, assignment]
    for layer in find_moe_layers(base):
        experts, names = layer.experts, tuple(layer.arch.expert_params)
        num_experts = int(getattr(experts, names[0]).shape[0])
        per_device = num_experts // size
        for name in names:
            full = getattr(experts, name)
            shard = nn.Parameter(full.detach()[:per_device].clone(), requires_grad=full.requires_grad)
            shard.occult_expert_shard = True  # type: ignore[attr-defined]
            setattr(experts, name, shard)
        experts.occult_shard = ExpertShard(  # type: ignore[assignment]
            group, rank, size, num_experts, per_device, names, previous, nodes
        )
        experts.num_experts = per_device  # type: ignore[assignment]
    base.set_experts_implementation(EXPERTS_IMPLEMENTATION)  # type: ignore[operator]


def check_unquantized(config, path: str) -> None:
    """Refuse a quantized checkpoint (FP8 DeepSeek-V3.2 / Kimi-K2 / MiniMax-M2, MXFP4 gpt-oss) in one line:
    its tensors are codes and scales, which this loader would read as weights."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = (
            quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        )
        raise ValueError(
            f"checkpoint {path!r} stores quantized weights (quant_method={method!r}); the expert-parallel "
            "loader reads unquantized tensors only: dequantize it to a bf16 checkpoint first "
            "(recipes/README.md, 'Quantized checkpoints')"
        )


def _checkpoint_dtype(reader: SafetensorsReader) -> torch.dtype:
    floats = [d for _, d, _, _ in reader.entries.values() if d.is_floating_point]
    return floats[0] if floats else torch.float32


def build_sharded_model(
    path: str,
    config,
    rank: int,
    size: int,
    placement="sequential",
    dtype=None,
    group=None,
    device=None,
    nodes: int = 1,
) -> nn.Module:
    """A causal-LM whose MoE layers hold only expert block `rank` of `size`, read straight from disk.

    Args:
        path: a local model directory with `config.json` and safetensors weights.
        config: its config (`occult_ft.checkpoint.load.read_model_config`), of a registered type.
        rank / size: this rank's position in its expert-parallel group and D (P = E / D experts each).
        placement: a `Placement`, a placement JSON path or "sequential" (for D devices); the experts
            are read in its placed order, the router rows reordered to match. None: the stored order.
        dtype: parameter dtype (None / "auto": the config's dtype, else the checkpoint's).
        group: the expert-parallel process group recorded on each layer's `ExpertShard`.
        device: where the tensors are allocated (default CPU).
        nodes: N nodes of D / N consecutive ranks, recorded on each `ExpertShard` (the two-stage
            exchange crosses them; its sub-groups are built by `configure_exchange`).

    Returns:
        the model in eval mode, equal to `from_pretrained` + `permute_experts` + `shard_experts`.
    """
    if not 0 <= rank < size:
        raise ValueError(
            f"rank={rank} is outside the expert-parallel group of size {size}; use 0..{size - 1}"
        )
    check_unquantized(config, path)
    reader = SafetensorsReader(path)
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or _checkpoint_dtype(reader)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, dtype=dtype)
    layers = find_moe_layers(model)
    if not layers:
        raise ValueError(
            f"checkpoint {path!r} has no MoE layers, so no experts to shard; load it without expert_parallel_size"
        )
    num_experts = layers[0].num_experts
    if num_experts % size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"expert_parallel_size={size} does not divide the {num_experts} experts of each MoE layer; "
            f"use one of {', '.join(map(str, divisors))}"
        )
    ExpertLayout(num_experts, size, nodes)  # N divides D
    if placement is None or (isinstance(placement, str) and placement == "sequential"):
        placement = resolve_placement("sequential", model, size)  # the stored order
    placement = resolve_placement(placement, model, None)
    permute_experts(model, placement)  # on meta: checks the placement against the model, moves nothing
    _shard_on_meta(model, rank, size, group, nodes)
    model.to_empty(device=device or "cpu")  # new Parameter objects: mark the shards again
    for layer in find_moe_layers(model):
        for name in cast(ExpertShard, layer.experts.occult_shard).param_names:
            getattr(layer.experts, name).occult_expert_shard = True
    try:
        done = _read(model, reader, placement, only_placed=False)
    finally:
        reader.close()
    _finish(model, done, path)
    model.occult_sharded_source = (path, placement)
    return model


def _finish(model: nn.Module, done: set[str], path: str) -> None:
    """Tie weights, initialise what the checkpoint lacks (non-persistent buffers) and refuse gaps."""
    model.tie_weights()  # type: ignore[operator]
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    persistent = set(model.state_dict())
    missing = sorted(k for k in persistent - done - tied)
    if missing:
        raise ValueError(
            f"checkpoint {path!r} lacks {len(missing)} tensors of the model, e.g. {missing[0]!r}; "
            "is it a complete checkpoint of this architecture?"
        )
    for module in model.modules():
        own = list(module.parameters(recurse=False)) + [
            b for b in module.buffers(recurse=False) if b is not None
        ]
        if own and all(getattr(t, "_is_hf_initialized", False) for t in own):
            module._is_hf_initialized = True  # type: ignore[assignment]
    model.initialize_weights()  # type: ignore[operator]
    model.config._name_or_path = path  # type: ignore[union-attr]
    model.eval()


def sharded_placement(model: nn.Module):
    """The placement a model loaded by `load_sharded_model` was read in, or None for other models."""
    source = getattr(unwrap_model(model), "occult_sharded_source", None)
    return source[1] if source is not None else None


def place_sharded(model: nn.Module, placement) -> None:
    """Re-read the expert block and router rows of a `load_sharded_model` model in `placement`'s order
    (nothing happens when it was read in that order already)."""

    base = unwrap_model(model)
    path, current = cast(tuple, base.occult_sharded_source)
    placement = resolve_placement(placement, base, None)
    if _same_order(placement, current):
        base.occult_sharded_source = (path, placement)  # type: ignore[assignment]
        return
    reader = SafetensorsReader(path)
    try:
        _read(base, reader, placement, only_placed=True)
    finally:
        reader.close()
    base.occult_sharded_source = (path, placement)  # type: ignore[assignment]


def _same_order(a, b) -> bool:
    """Whether two placements put the experts of every layer in the same placed order."""
    return a.layers == b.layers and all(torch.equal(a.expert_order(i), b.expert_order(i)) for i in a.layers)
