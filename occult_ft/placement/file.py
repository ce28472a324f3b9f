"""The `Placement` of a whole model and its JSON file (format `occult_ft.placement`, version 2; version
1 files still load).

The file holds, per MoE layer, D lists of E/D original expert ids (one line per device group), plus the
model it was made for and `metrics`. Version 2 gives the metrics a schema: `metrics["layers"][layer]`
holds the layer's figures (`compute_placement`: comm_complexity, load_imbalance, the load bound kept, the
lower bound and gap, seconds, held-out and pruned figures; `FIGURE_TYPES`), checked on load; version 1
metrics stay informational. Loading validates everything and raises a one-line `PlacementError` naming the
field and the fix: sizes are checked against the groups actually listed before anything is derived from
them (a bogus `num_experts` fails fast), and two keys naming one layer ("1" and "01", or a key given
twice) are refused. Saving is atomic (`occult_ft.fileio`: a temporary sibling, then a rename).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from ..checks import is_int, is_positive_int
from ..fileio import atomic_write_text
from ..metrics import expert_device_from_groups
from .core import RERUN, PlacementError, validate_sizes

__all__ = ["FIGURE_TYPES", "PLACEMENT_FORMAT", "PLACEMENT_VERSION", "READABLE_VERSIONS", "Placement"]

PLACEMENT_FORMAT = "occult_ft.placement"
PLACEMENT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_NUMBER = "number"
FIGURE_TYPES = {  # version 2: what a layer's figures may hold (absent keys are allowed; None = unknown)
    "tokens": _NUMBER,
    "comm_complexity_sequential": _NUMBER,
    "comm_complexity": _NUMBER,
    "load_imbalance": _NUMBER,
    "load_bound": _NUMBER,
    "lower_bound": _NUMBER,
    "gap": _NUMBER,
    "seconds": _NUMBER,
    "node_complexity": _NUMBER,
    "node_lower_bound": _NUMBER,
    "node_gap": _NUMBER,
    "removed_share": _NUMBER,
    "max_devices_per_token": _NUMBER,
    "optimal": bool,
    "note": str,
    "criterion": str,
    "held_out": dict,
    "pruned": dict,
}


def _check_figures(figures, where: str) -> None:
    """Version-2 figures: a dict of known keys whose values have the listed types (or are null)."""
    if not isinstance(figures, dict):
        raise PlacementError(f"{where} is {type(figures).__name__}, not an object of figures; {RERUN}")
    for key, value in figures.items():
        kind = FIGURE_TYPES.get(key)
        if kind is None:
            raise PlacementError(f"{where} has the unknown figure {key!r}; {RERUN}")
        if value is None:
            continue
        if kind is _NUMBER:
            # bool is an int subclass (True would pass as 1); value == value is False only for NaN
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
            ok = ok and abs(value) != float("inf")  # JSON has no infinity either: the file stays portable
        else:
            ok = isinstance(value, cast(type, kind))
        if not ok:
            raise PlacementError(
                f"{where} figure {key!r} is {value!r}, not a {getattr(kind, '__name__', kind)}; {RERUN}"
            )
        if kind is dict:  # held_out and pruned hold figures of the same kinds, one level down
            _check_figures(value, f"{where} {key}")


def _check_metrics(metrics, layers: set[int]) -> None:
    """Version-2 metrics: an object whose `layers` (if any) are figures of this placement's layers."""
    if not isinstance(metrics, dict):
        raise PlacementError(f"placement metrics are {type(metrics).__name__}, not an object; {RERUN}")
    per_layer = metrics.get("layers", {})  # a hand-written file may carry no figures at all
    if not isinstance(per_layer, dict):
        raise PlacementError(f"placement metrics 'layers' must map layer index -> figures; {RERUN}")
    _check_layer_keys(per_layer, "placement metrics")
    for key, figures in per_layer.items():
        if int(key) not in layers:
            raise PlacementError(
                f"placement metrics give figures for layer {key}, which the placement lacks; {RERUN}"
            )
        _check_figures(figures, f"placement metrics layer {key}")


def _check_layer_keys(mapping: dict, where: str) -> None:
    """Layer keys are integers, each naming a different layer ("1" and "01" both name layer 1)."""
    seen: dict[int, str] = {}
    for key in mapping:
        # JSON object keys are strings: "-1" passes here and fails later as a layer the model lacks
        if not isinstance(key, str) or not key.lstrip("-").isdigit():
            raise PlacementError(f"{where} has layer key {key!r}, not an integer; {RERUN}")
        if int(key) in seen:
            raise PlacementError(
                f"{where} has layer keys {seen[int(key)]!r} and {key!r}, both naming layer {int(key)}; keep one "
                f"of them; {RERUN}"
            )
        seen[int(key)] = key


def _refuse_duplicate_keys(pairs: list) -> dict:
    """json object hook: a key given twice in one object is an error, not silently the last one."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise PlacementError(f"the key {key!r} is given twice in one object; keep one of them; {RERUN}")
        out[key] = value
    return out


def _read_placement_json(path: Path) -> Any:
    """The JSON of a placement file (a key given twice is an error, not the last copy)."""
    if not path.is_file():
        raise PlacementError(f"placement file '{path}' not found; create it with `occult-ft place`")
    try:
        # object_pairs_hook sees every key, so a layer given twice is an error, not the last copy
        return json.loads(path.read_text(), object_pairs_hook=_refuse_duplicate_keys)
    except PlacementError as err:
        raise PlacementError(f"placement file '{path}': {err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f" at line {err.lineno}, column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        raise PlacementError(f"placement file '{path}' is not valid JSON{where}; {RERUN}") from None


def _check_placement_header(path: Path, data: Any) -> None:
    """An occult_ft placement file of a readable version with every field, `layers` a mapping."""
    if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PlacementError(
            f"'{path}' is not an occult_ft placement file (format={found!r}, expected "
            f"{PLACEMENT_FORMAT!r}); {RERUN}"
        )
    # True == 1 in Python: a version `true` would otherwise read as version 1
    if data.get("version") not in READABLE_VERSIONS or isinstance(data.get("version"), bool):
        raise PlacementError(
            f"'{path}' has placement version {data.get('version')!r}; this occult_ft reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; {RERUN}"
        )
    for key in ("num_experts", "num_devices", "num_nodes", "algorithm", "layers"):
        if key not in data:
            raise PlacementError(f"placement file '{path}' lacks the {key!r} field; {RERUN}")
    if not isinstance(data["layers"], dict):
        raise PlacementError(f"placement file '{path}': 'layers' must map layer index -> groups; {RERUN}")


def _check_listed_experts(groups: dict, num_experts: int) -> None:
    """num_experts must be what every layer lists: checked before anything O(num_experts) runs, so a
    file claiming 10**15 experts fails at once."""
    for layer, layer_groups in groups.items():
        if not isinstance(layer_groups, list):
            raise PlacementError(
                f"placement layer {layer} is {type(layer_groups).__name__}, not a list of device groups; {RERUN}"
            )
        # a group that is not a list counts 0 here; `_check_groups` names it
        listed = sum(len(g) if isinstance(g, list) else 0 for g in layer_groups)
        if listed != num_experts:
            raise PlacementError(
                f"placement layer {layer} lists {listed} experts but num_experts={num_experts}; {RERUN}"
            )


def _check_groups(groups, num_experts: int, num_devices: int, where: str) -> list[list[int]]:
    if not isinstance(groups, list) or len(groups) != num_devices:
        n = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise PlacementError(f"{where} has {n} device groups but num_devices={num_devices}; {RERUN}")
    per, seen = num_experts // num_devices, set()  # E/D experts per device; `seen`: each expert once
    for d, group in enumerate(groups):
        if not isinstance(group, list) or not all(is_int(e) for e in group):
            raise PlacementError(f"{where} device {d} is not a list of expert ids: {group!r}; {RERUN}")
        if len(group) != per:
            raise PlacementError(
                f"{where} device {d} holds {len(group)} experts; each of the {num_devices} devices must hold "
                f"{num_experts}/{num_devices}={per}; {RERUN}"
            )
        for e in group:  # D groups of E/D distinct ids in 0..E-1: together exactly a permutation of E
            if not 0 <= e < num_experts:
                raise PlacementError(f"{where} has expert id {e} outside 0..{num_experts - 1}; {RERUN}")
            if e in seen:
                raise PlacementError(f"{where} places expert {e} on two devices; {RERUN}")
            seen.add(e)
    return [sorted(g) for g in groups]


@dataclass
class Placement:
    """Expert -> device assignment of every MoE layer of one model.

    Args:
        model: name or path of the profiled model (informational).
        model_type: HF `model_type`, checked by `check_model` when both sides know it.
        num_experts: E routed experts per layer.
        num_devices: D expert-parallel devices; num_nodes: N nodes (device d on node d // (D/N)).
        algorithm: the algorithm that produced it.
        groups: MoE layer index (decoder layer) -> D lists of E/D original expert ids (sorted).
        metrics: informational numbers, e.g. comm_complexity before/after on the profile.
    """

    model: str | None
    model_type: str | None
    num_experts: int
    num_devices: int
    num_nodes: int
    algorithm: str
    groups: dict[int, list[list[int]]]
    metrics: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("num_experts", "num_devices", "num_nodes"):
            if not is_positive_int(getattr(self, name)):
                raise PlacementError(
                    f"placement {name}={getattr(self, name)!r} must be a positive integer; {RERUN}"
                )
        if not isinstance(self.groups, dict) or not self.groups:
            raise PlacementError(f"placement has no layers; {RERUN}")
        # before validate_sizes and _check_groups, which take time and memory in E
        _check_listed_experts(self.groups, self.num_experts)
        try:
            validate_sizes(self.num_experts, self.num_devices, self.num_nodes)
        except PlacementError as err:
            raise PlacementError(f"placement {err}") from None
        # keys as ints in layer order, each group sorted: two equal placements compare equal
        self.groups = {
            int(layer): _check_groups(groups, self.num_experts, self.num_devices, f"placement layer {layer}")
            for layer, groups in sorted(self.groups.items())
        }

    @property
    def layers(self) -> list[int]:
        return sorted(self.groups)

    def _layer_groups(self, layer: int) -> list[list[int]]:
        if layer not in self.groups:
            raise PlacementError(f"placement has no layer {layer}; it covers layers {self.layers}; {RERUN}")
        return self.groups[layer]

    def expert_device(self, layer: int) -> torch.Tensor:
        """(E,) int64 device of each original expert id of `layer`."""
        # expert_device[e] = d for every e in group d: the (E,) map the router's budget and dispatch read
        return expert_device_from_groups(self._layer_groups(layer), self.num_experts)

    def expert_order(self, layer: int) -> torch.Tensor:
        """(E,) int64: new expert j is original expert order[j] (device d holds new ids d*E/D .. +E/D-1)."""
        # the groups concatenated: position p of the placed model holds original expert order[p]
        return torch.tensor([e for group in self._layer_groups(layer) for e in group], dtype=torch.long)

    def check_model(
        self, num_experts: int, layer_indices: Iterable[int], model_type: str | None = None
    ) -> None:
        """Raise `PlacementError` unless this placement fits a model with these experts and MoE layers."""
        if num_experts != self.num_experts:
            raise PlacementError(
                f"placement was made for {self.num_experts} experts, model has {num_experts}; {RERUN}"
            )
        layers = sorted(int(i) for i in layer_indices)
        if layers != self.layers:
            raise PlacementError(f"placement covers MoE layers {self.layers}, model has {layers}; {RERUN}")
        if model_type is not None and self.model_type is not None and model_type != self.model_type:
            raise PlacementError(
                f"placement was made for a {self.model_type} model, this one is {model_type}; {RERUN}"
            )

    def figures(self, layer: int) -> dict | None:
        """The layer's stored figures (`compute_placement`), or None when the file has none for it."""
        per_layer = self.metrics.get("layers") if isinstance(self.metrics, dict) else None
        if not isinstance(per_layer, dict):
            return None
        found = per_layer.get(str(layer))
        return found if isinstance(found, dict) else None

    def to_json(self) -> str:
        """The file text: JSON with one line per device group."""
        head = dict(
            format=PLACEMENT_FORMAT,
            version=PLACEMENT_VERSION,
            model=self.model,
            model_type=self.model_type,
            num_experts=self.num_experts,
            num_devices=self.num_devices,
            num_nodes=self.num_nodes,
            algorithm=self.algorithm,
        )
        # written by hand rather than json.dumps(indent=...), which would give every expert id a line of
        # its own (E x layers lines); one line per device group keeps a diff of two placements readable
        lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "layers": {']
        for i, layer in enumerate(self.layers):
            body = ",\n".join(f"      {json.dumps(g)}" for g in self.groups[layer])
            # each layer: its D groups one per line; a comma after every layer but the last (JSON has no trailing comma)
            lines.append(f'    "{layer}": [\n{body}\n    ]' + ("," if i < len(self.groups) - 1 else ""))
        try:
            # allow_nan=False: json.dumps would otherwise write NaN, which no strict JSON reader takes
            # indented by two more spaces so the block nests under the top-level "metrics" key
            metrics = json.dumps(self.metrics, indent=2, allow_nan=False).replace("\n", "\n  ")
        except ValueError:
            raise PlacementError(
                "placement metrics hold NaN or infinite values, which JSON cannot keep"
            ) from None
        return "\n".join(lines + ["  },", f'  "metrics": {metrics}', "}"]) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the file atomically: a temporary sibling, then `os.replace` (no half-written file)."""
        path = Path(path)
        if not path.parent.is_dir():
            raise PlacementError(
                f"cannot write '{path}': directory '{path.parent}' does not exist; create it first"
            )
        if path.is_dir():
            raise PlacementError(
                f"cannot write '{path}': it is a directory; give a file name like placement.json"
            )
        # written to a temporary file and renamed: a reader never sees half a placement
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Placement:
        """Read and validate a placement file; every problem raises a one-line `PlacementError`."""
        if not isinstance(path, (str, os.PathLike)):
            raise PlacementError(
                f"Placement.load takes the path of a placement file, not a {type(path).__name__}; "
                "create one with `occult-ft place`"
            )
        path = Path(path)
        data = _read_placement_json(path)
        # the header first: a file of another format or version is refused before its groups are looked at
        _check_placement_header(path, data)
        try:
            _check_layer_keys(data["layers"], "placement file")
            if data["version"] >= 2:  # version 1 kept free-form metrics: they are read unchecked
                _check_metrics(data.get("metrics") or {}, {int(k) for k in data["layers"]})
        except PlacementError as err:
            raise PlacementError(
                f"placement file '{path}': {str(err).removeprefix('placement file ')}"
            ) from None
        try:
            return cls(
                model=data.get("model"),
                model_type=data.get("model_type"),
                num_experts=data["num_experts"],
                num_devices=data["num_devices"],
                num_nodes=data["num_nodes"],
                algorithm=str(data["algorithm"]),
                # JSON object keys are strings: layer "12" becomes the int 12 the model's layer indices use
                groups={int(k): v for k, v in data["layers"].items()},
                metrics=data.get("metrics") or {},
            )
        except PlacementError as err:
            raise PlacementError(f"placement file '{path}': {err}") from None
