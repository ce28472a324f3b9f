"""The `Placement` of a whole model and its JSON file (format `occult_ft.placement`, version 1).

The file holds, per MoE layer, D lists of E/D original expert ids (one line per device group), plus the
model it was made for and informational metrics. Loading validates everything and raises a one-line
`PlacementError` naming the field and the fix; sizes are checked against the groups actually listed
before anything is derived from them, so a bogus `num_experts` fails fast. Saving is atomic (a temporary
sibling, then `os.replace`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..metrics import expert_device_from_groups
from .core import _RERUN, PlacementError, _is_int, _validate_sizes

__all__ = ["PLACEMENT_FORMAT", "PLACEMENT_VERSION", "Placement"]

PLACEMENT_FORMAT = "occult_ft.placement"
PLACEMENT_VERSION = 1


def _check_listed_experts(groups: dict, num_experts: int) -> None:
    """num_experts must be what every layer lists: checked before anything O(num_experts) runs, so a
    file claiming 10**15 experts fails at once."""
    for layer, layer_groups in groups.items():
        if not isinstance(layer_groups, list):
            raise PlacementError(
                f"placement layer {layer} is {type(layer_groups).__name__}, not a list of device groups; {_RERUN}"
            )
        listed = sum(len(g) if isinstance(g, list) else 0 for g in layer_groups)
        if listed != num_experts:
            raise PlacementError(
                f"placement layer {layer} lists {listed} experts but num_experts={num_experts}; {_RERUN}"
            )


def _check_groups(groups, num_experts: int, num_devices: int, where: str) -> list[list[int]]:
    if not isinstance(groups, list) or len(groups) != num_devices:
        n = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise PlacementError(f"{where} has {n} device groups but num_devices={num_devices}; {_RERUN}")
    per, seen = num_experts // num_devices, set()
    for d, group in enumerate(groups):
        if not isinstance(group, list) or not all(_is_int(e) for e in group):
            raise PlacementError(f"{where} device {d} is not a list of expert ids: {group!r}; {_RERUN}")
        if len(group) != per:
            raise PlacementError(
                f"{where} device {d} holds {len(group)} experts; each of the {num_devices} devices must hold "
                f"{num_experts}/{num_devices}={per}; {_RERUN}"
            )
        for e in group:
            if not 0 <= e < num_experts:
                raise PlacementError(f"{where} has expert id {e} outside 0..{num_experts - 1}; {_RERUN}")
            if e in seen:
                raise PlacementError(f"{where} places expert {e} on two devices; {_RERUN}")
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
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise PlacementError(
                    f"placement {name}={getattr(self, name)!r} must be a positive integer; {_RERUN}"
                )
        if not isinstance(self.groups, dict) or not self.groups:
            raise PlacementError(f"placement has no layers; {_RERUN}")
        _check_listed_experts(self.groups, self.num_experts)
        try:
            _validate_sizes(self.num_experts, self.num_devices, self.num_nodes)
        except PlacementError as err:
            raise PlacementError(f"placement {err}") from None
        self.groups = {
            int(layer): _check_groups(groups, self.num_experts, self.num_devices, f"placement layer {layer}")
            for layer, groups in sorted(self.groups.items())
        }

    @property
    def layers(self) -> list[int]:
        return sorted(self.groups)

    def _layer_groups(self, layer: int) -> list[list[int]]:
        if layer not in self.groups:
            raise PlacementError(f"placement has no layer {layer}; it covers layers {self.layers}; {_RERUN}")
        return self.groups[layer]

    def expert_device(self, layer: int) -> torch.Tensor:
        """(E,) int64 device of each original expert id of `layer`."""
        return expert_device_from_groups(self._layer_groups(layer), self.num_experts)

    def expert_order(self, layer: int) -> torch.Tensor:
        """(E,) int64: new expert j is original expert order[j] (device d holds new ids d*E/D .. +E/D-1)."""
        return torch.tensor([e for group in self._layer_groups(layer) for e in group], dtype=torch.long)

    def check_model(
        self, num_experts: int, layer_indices: Iterable[int], model_type: str | None = None
    ) -> None:
        """Raise `PlacementError` unless this placement fits a model with these experts and MoE layers."""
        if num_experts != self.num_experts:
            raise PlacementError(
                f"placement was made for {self.num_experts} experts, model has {num_experts}; {_RERUN}"
            )
        layers = sorted(int(i) for i in layer_indices)
        if layers != self.layers:
            raise PlacementError(f"placement covers MoE layers {self.layers}, model has {layers}; {_RERUN}")
        if model_type is not None and self.model_type is not None and model_type != self.model_type:
            raise PlacementError(
                f"placement was made for a {self.model_type} model, this one is {model_type}; {_RERUN}"
            )

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
        lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "layers": {']
        for i, layer in enumerate(self.layers):
            body = ",\n".join(f"      {json.dumps(g)}" for g in self.groups[layer])
            lines.append(f'    "{layer}": [\n{body}\n    ]' + ("," if i < len(self.groups) - 1 else ""))
        metrics = json.dumps(self.metrics, indent=2).replace("\n", "\n  ")
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
        from ..fileio import atomic_write_text

        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        """Read and validate a placement file; every problem raises a one-line `PlacementError`."""
        path = Path(path)
        if not path.is_file():
            raise PlacementError(f"placement file '{path}' not found; create it with `occult-ft place`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            where = (
                f" at line {err.lineno}, column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
            )
            raise PlacementError(f"placement file '{path}' is not valid JSON{where}; {_RERUN}") from None
        if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlacementError(
                f"'{path}' is not an occult_ft placement file (format={found!r}, expected "
                f"{PLACEMENT_FORMAT!r}); {_RERUN}"
            )
        if data.get("version") != PLACEMENT_VERSION:
            raise PlacementError(
                f"'{path}' has placement version {data.get('version')!r}; this occult_ft reads version "
                f"{PLACEMENT_VERSION}; {_RERUN}"
            )
        for key in ("num_experts", "num_devices", "num_nodes", "algorithm", "layers"):
            if key not in data:
                raise PlacementError(f"placement file '{path}' lacks the {key!r} field; {_RERUN}")
        if not isinstance(data["layers"], dict):
            raise PlacementError(
                f"placement file '{path}': 'layers' must map layer index -> groups; {_RERUN}"
            )
        bad_keys = [k for k in data["layers"] if not k.lstrip("-").isdigit()]
        if bad_keys:
            raise PlacementError(
                f"placement file '{path}' has layer key {bad_keys[0]!r}, not an integer; {_RERUN}"
            )
        try:
            return cls(
                model=data.get("model"),
                model_type=data.get("model_type"),
                num_experts=data["num_experts"],
                num_devices=data["num_devices"],
                num_nodes=data["num_nodes"],
                algorithm=str(data["algorithm"]),
                groups={int(k): v for k, v in data["layers"].items()},
                metrics=data.get("metrics") or {},
            )
        except PlacementError as err:
            raise PlacementError(f"placement file '{path}': {err}") from None
