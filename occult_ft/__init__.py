"""occult_ft: cheaper expert-parallel MoE training and serving (the Occult method, ICML 2025).

Three ways to cut the all-to-all of expert parallelism:
1. exact savings: a de-duplicated all-to-all sends a token once per device, not once per expert
   (`occult_ft.dispatch`);
2. placement: experts that are often co-selected share a device (`occult_ft.placement`);
3. collaboration pruning: each token reaches at most `max_devices_per_token` devices, and
   fine-tuning restores quality (`occult_ft.routing`, `occult_ft.trainer`).

The names below load their module on first use (PEP 562), so `import occult_ft` and the `occult-ft`
command line start without importing torch.

    model, tokenizer = occult_ft.load_model_and_tokenizer("embedded")
    profile = occult_ft.profile_model(model, batches)
    placement = occult_ft.compute_placement(profile, num_devices=4)
    occult_ft.apply_occult(model, placement, occult_ft.PruningConfig(4, max_devices_per_token=2,
                           criterion="similarity"), profile.similarity())
    model.save_pretrained("pruned/")            # a complete pruned checkpoint
    model = occult_ft.from_pretrained("pruned/")  # the same routing
"""

from __future__ import annotations

import importlib
import importlib.metadata

try:  # the version is written once, in pyproject.toml; the installed package's metadata carries it
    __version__ = importlib.metadata.version("occult-ft")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

#: public name -> the module that defines it
_EXPORTS = {
    "apply_occult": "occult_ft.apply",
    "placed_copy": "occult_ft.apply",
    "resolve_placement": "occult_ft.apply",
    "OccultBlock": "occult_ft.checkpoint.format",
    "describe_checkpoint": "occult_ft.checkpoint.format",
    "save_pruned": "occult_ft.checkpoint.save",
    "from_pretrained": "occult_ft.checkpoint.load",
    "load_model_and_tokenizer": "occult_ft.checkpoint.load",
    "comm_complexity": "occult_ft.metrics",
    "intra_share": "occult_ft.metrics",
    "routing_report": "occult_ft.metrics",
    "find_moe_layers": "occult_ft.models",
    "get_arch": "occult_ft.models",
    "supported_model_types": "occult_ft.models",
    "Placement": "occult_ft.placement",
    "compute_placement": "occult_ft.placement",
    "Profile": "occult_ft.profiling",
    "profile_model": "occult_ft.profiling",
    "CRITERIA": "occult_ft.routing",
    "PruningConfig": "occult_ft.routing",
    "apply_pruning": "occult_ft.routing",
    "OccultConfig": "occult_ft.trainer",
    "OccultTrainer": "occult_ft.trainer",
    "train": "occult_ft.trainer",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'occult_ft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [*_EXPORTS, "__version__"]
